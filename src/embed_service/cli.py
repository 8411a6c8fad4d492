"""`embed-service serve` (every Settings field is a flag (--kebab-case) and an EMBED_* variable) and
`embed-service bench` (load against any OpenAI-compatible embeddings URL) and `embed-service encode` (a
file of texts embedded in process: offline.py).

Several models: `--model` is repeatable, and a per-model flag applies to the `--model` it follows; one given
before the first `--model` applies to every model. `--config FILE` lists models (and server settings) in a
YAML or TOML file. Flags win over the file, which wins over EMBED_* variables (docs/configuration.md)."""

from __future__ import annotations

import argparse
import re
import sys
import typing
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import SettingsError

from embed_service import __version__
from embed_service.config import MODEL_FIELDS, ServeConfig, ServerSettings, Settings
from embed_service.config_file import ConfigFile, ConfigFileError, read_config_file

SCOPES = "_model_scopes"
"""The namespace attribute holding each --model's own flags, in order (flags before the first --model are
plain attributes, as server flags are)."""


def _default_text(default: Any, description: str) -> str:
    """The default as --help shows it. A field whose default depends on the model or the machine says so in
    its description ("Default: ..."); argparse's own "%(default)s" cannot, the flags default to SUPPRESS so
    that only what was given overrides the EMBED_* variables."""
    if "Default:" in description:
        return ""
    if default is None or default is PydanticUndefined:
        return " (default: none)"
    if isinstance(default, bool):
        return " (default: on)" if default else " (default: off)"
    return f" (default: {default})".replace("%", "%%")


def _scoped(action: type[argparse.Action]) -> type[argparse.Action]:
    """`action` for a per-model flag: before the first --model it stores as any flag does (every model's);
    from a --model on, into that model's scope (a new one at each --model)."""

    class Scoped(action):  # type: ignore[misc,valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            scopes = namespace.__dict__.setdefault(SCOPES, [])
            if self.dest == "model":
                scopes.append({})
            if not scopes:
                super().__call__(parser, namespace, values, option_string)
                return
            local = argparse.Namespace(**scopes[-1])
            super().__call__(parser, local, values, option_string)
            scopes[-1] = vars(local)

    return Scoped


def _add_settings_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Every setting as a flag; `names`: only these, for one model and unscoped (`embed-service encode`)."""
    if names is not None:
        server = model = parser.add_argument_group("model settings")
    else:
        server = parser.add_argument_group("server settings (one value for the whole server)")
        model = parser.add_argument_group(
            "model settings (after a --model: that model's; before the first --model: every model's)"
        )
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        flag = "--" + name.replace("_", "-")
        description = field.description or ""
        help_text = description.replace("%", "%%") + _default_text(field.default, description)
        help_text += f" [env: EMBED_{name.upper()}]"
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        per_model = name in MODEL_FIELDS and names is None
        group = model if per_model else server
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        if annotation is bool:
            action: type[argparse.Action] = argparse.BooleanOptionalAction
        elif origin is list:
            action = argparse._AppendAction
            kwargs["help"] += " (repeatable)"
        else:
            action = argparse._StoreAction
            if origin is typing.Literal:
                kwargs["choices"] = list(typing.get_args(annotation))
            else:
                base = args[0] if args else annotation
                kwargs["type"] = base if base in (int, float) else str
        if name == "model" and names is None:
            kwargs["help"] += " (repeatable)"
        group.add_argument(flag, action=_scoped(action) if per_model else action, **kwargs)


def _source(name: str, given: dict[str, str]) -> str:
    """Where a setting's value came from, as the user wrote it: the flag or file key, else the variable."""
    return given.get(name, f"EMBED_{name.upper()}")


def settings_errors(exc: Exception, given: dict[str, str]) -> list[str]:
    """One line per invalid setting, naming the flag, file key or variable, the value and what is wrong.
    `given`: how each setting given explicitly was written (``--num-threads``, ``models.yaml: port``)."""
    if isinstance(exc, ValidationError):
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            source = _source(name, given)
            if source.startswith("--"):  # as typed: --num-threads -2
                shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
                lines.append(f"{source} {shown}: {msg}")
            else:
                lines.append(f"{source}={value!r}: {msg}")
        return lines
    # pydantic-settings fails before validation when a variable cannot be decoded at all.
    found = re.search(r'field "(\w+)"', str(exc))
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    return [f"{_source(found.group(1), given) if found else 'settings'}: cannot read the value{cause}"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Refusal(Exception):
    """Settings that cannot be served: the lines say why, each naming what was given."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = lines


def _validate(cls: type[Any], values: dict[str, Any], given: dict[str, str], prefix: str = "") -> Any:
    try:
        return cls(**values)
    except (ValidationError, SettingsError) as exc:
        raise Refusal([prefix + line for line in settings_errors(exc, given)]) from None


def serve_config(values: dict[str, Any]) -> ServeConfig:
    """The server's settings and each model's from the parsed flags (by name; each --model's own under
    SCOPES), the --config file and the EMBED_* variables. Raises Refusal."""
    own: list[dict[str, Any]] = values.pop(SCOPES, [])
    shared = {k: v for k, v in values.items() if k in MODEL_FIELDS}
    server_flags = {k: v for k, v in values.items() if k != "command" and k not in MODEL_FIELDS}
    flag_labels = {k: _flag(k) for k in server_flags}
    server = _validate(ServerSettings, server_flags, flag_labels)
    file = ConfigFile()
    if server.config:
        try:
            file = read_config_file(server.config)
        except ConfigFileError as exc:
            raise Refusal([f"--config: {exc}"]) from None
        from_file = {k: f"{file.path}: {k}" for k in file.server}
        server = _validate(ServerSettings, {**file.server, **server_flags}, from_file | flag_labels)
    if own and file.models:
        raise Refusal([f"--config {file.path} lists models and --model is given too: list them in one place"])
    entries = own or file.models or [{}]
    several = len(entries) > 1
    server_values = server.model_dump()
    models = []
    for i, entry in enumerate(entries):
        top = {k: f"{file.path}: {k}" for k in file.shared}
        flags = {k: _flag(k) for k in shared}
        if own:  # lowest first: the file's top level, flags before the first --model, this --model's flags
            layers = [(file.shared, top), (shared, flags), (entry, {k: _flag(k) for k in entry})]
        else:  # the file's top level, this model's entry, flags before any --model
            mine = {k: f"{file.path}: models[{i}].{k}" for k in entry}
            layers = [(file.shared, top), (entry, mine), (shared, flags)]
        merged: dict[str, Any] = {}
        labels: dict[str, str] = {}
        for layer, given in layers:
            merged |= layer
            labels |= given
        prefix = f"model {i + 1} ({merged.get('model') or 'the default model'}): " if several else ""
        models.append(_validate(Settings, {**server_values, **merged}, labels, prefix))
    return ServeConfig(server, models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embed-service", description="OpenAI-compatible text-embedding server"
    )
    parser.add_argument("--version", action="version", version=f"embed-service {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    _add_settings_flags(serve)
    from embed_service import bench

    bench.add_arguments(
        sub.add_parser(
            "bench",
            help="closed-loop load against an OpenAI-compatible /v1/embeddings URL",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    from embed_service import offline

    encode = sub.add_parser(
        "encode",
        help="embed a file of texts in this process (JSON lines, CSV, Parquet, text -> Parquet or .npy)",
        description="Embed a file of texts in this process, with the server's engine and no HTTP: "
        "streaming, with a progress bar, resumable (a rerun skips the rows written). See docs/offline.md.",
    )
    offline.add_arguments(encode)
    _add_settings_flags(encode, ENCODE_SETTINGS)
    return parser


# The settings `encode` takes: the engine's, not the HTTP server's (and --config, a file of them).
ENCODE_SETTINGS = (
    "config",
    "model",
    "revision",
    "device",
    "dtype",
    "max_input_length",
    "max_batch_tokens",
    "max_batch_requests",
    "data_parallel_size",
    "tensor_parallel_size",
    "num_threads",
    "max_image_pixels",
    "max_image_bytes",
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from embed_service import bench

        return bench.main(args)
    values: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command"}
    if args.command == "encode":
        return _encode(args, {k: v for k, v in values.items() if k in ENCODE_SETTINGS})
    if args.command == "serve":
        try:
            config = serve_config(values)
        except Refusal as exc:
            for line in exc.lines:
                print(f"embed-service: {line}", file=sys.stderr)
            return 2
        from embed_service.server import serve

        return serve(config)
    return 2


def encode_settings(values: dict[str, Any]) -> Settings:
    """`encode`'s one model's settings: its flags (`values`, by name), over the --config file (its top level,
    or its one model), over the EMBED_* variables, as `serve` resolves them. Raises Refusal."""
    config = serve_config(dict(values))
    if len(config.models) > 1:
        raise Refusal(
            [f"--config {config.server.config}: encode embeds with one model, the file lists several"]
        )
    return config.models[0]


def _encode(args: argparse.Namespace, values: dict[str, Any]) -> int:
    from embed_service import offline

    try:  # the settings' refusals as serve gives them, before the input is read
        settings = encode_settings(values)
    except Refusal as exc:
        for line in exc.lines:
            print(f"embed-service: {line}", file=sys.stderr)
        return 2
    try:
        return offline.run(args, settings)
    except (offline.JobError, ValueError) as exc:
        print(f"embed-service: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
