"""`embed-service --version` and `serve --help` showing every setting's default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from pydantic_core import PydanticUndefined

from embed_service.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "embed_service", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "2000"},  # one line per flag
        check=True,
    )
    return out.stdout


def test_version_is_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run("--version").strip() == f"embed-service {version}"


def test_serve_help_shows_every_default():
    # One block per flag: its line and the help text argparse may put on the next.
    blocks = [" ".join(b.split()) for b in re.split(r"\n(?=  -)", run("serve", "--help"))]
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        line = next(b for b in blocks if re.match(rf"{flag}[ ,]", b))
        default = field.default
        if default is None or default is PydanticUndefined:
            assert "Default:" in line or "(default: none)" in line, line
        elif isinstance(default, bool):
            assert f"(default: {'on' if default else 'off'})" in line, line
        else:
            assert f"(default: {default})" in line, line
