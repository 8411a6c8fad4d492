"""Reading a model folder's JSON files: the one reader and the integer check every detector uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def positive_int(cfg: dict[str, Any], key: str, file: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if value is None else f"{value!r}, not a positive integer"
        raise ValueError(f"{file}: {key} is {what}")
    return value
