"""The --config file (YAML or TOML): read and sorted into the server's settings, the settings shared by every
model and each listed model's own (docs/configuration.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embed_service.config import MODEL_FIELDS, SERVER_FIELDS


class ConfigFileError(ValueError):
    """A config file that cannot be read or names a setting wrongly; the message is one line."""


@dataclass
class ConfigFile:
    """A config file's settings by layer, keys as field names: the server's, the per-model settings given at
    the top level (for every model), and each listed model's own."""

    path: Path | None = None  # None: no file
    server: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    models: list[dict[str, Any]] = field(default_factory=list)


def _key(raw: object, path: Path, where: str) -> str:
    if not isinstance(raw, str):
        raise ConfigFileError(f"{path}: {where}: setting names are strings, got {raw!r}")
    return raw.replace("-", "_")  # the flag's spelling (max-batch-tokens) works too


def read_config_file(path: str | Path) -> ConfigFile:
    """Read and sort a YAML or TOML config file (see docs/configuration.md); refuse unknown settings, server
    settings inside a model entry, and a file that is not a mapping."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigFileError(f"{file}: a config file is .yaml, .yml or .toml, not {suffix or 'no suffix'}")
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"{file}: cannot read it: {exc.strerror or exc}") from None
    data: Any
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigFileError(f"{file}: not valid TOML: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:  # its lines say what and where: one line
            raise ConfigFileError(f"{file}: not valid YAML: {' '.join(str(exc).split())}") from None
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigFileError(f"{file}: the top level must be a mapping of settings")
    out = ConfigFile(file)
    for raw, value in data.items():
        name = _key(raw, file, "top level")
        if name == "models":
            continue
        if name in SERVER_FIELDS - {"config"}:
            out.server[name] = value
        elif name in MODEL_FIELDS:
            out.shared[name] = value
        else:
            raise ConfigFileError(f"{file}: unknown setting {raw!r}")
    models = data.get("models", [])
    if not isinstance(models, list):
        raise ConfigFileError(f"{file}: models must be a list of models")
    for i, entry in enumerate(models):
        if isinstance(entry, str):  # a bare name: the model with the settings of the top level
            entry = {"model": entry}
        if not isinstance(entry, dict):
            raise ConfigFileError(f"{file}: models[{i}] must be a mapping of settings or a model name")
        own: dict[str, Any] = {}
        for raw, value in entry.items():
            name = _key(raw, file, f"models[{i}]")
            if name in SERVER_FIELDS:
                raise ConfigFileError(
                    f"{file}: models[{i}].{raw} is a server setting, the same for every model: "
                    "set it at the top level"
                )
            if name not in MODEL_FIELDS:
                raise ConfigFileError(f"{file}: models[{i}]: unknown setting {raw!r}")
            own[name] = value
        out.models.append(own)
    return out
