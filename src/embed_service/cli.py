"""`embed-service serve` (every Settings field is a flag (--kebab-case) and an EMBED_* variable),
`embed-service bench` (load against any OpenAI-compatible embeddings URL) and `embed-service encode` (a
file of texts embedded in process: offline.py)."""

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
from embed_service.config import Settings


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


def _add_settings_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
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
        if annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif origin is list:
            parser.add_argument(
                flag, action="append", default=argparse.SUPPRESS, help=help_text + " (repeatable)"
            )
        elif origin is typing.Literal:
            parser.add_argument(
                flag, choices=list(typing.get_args(annotation)), default=argparse.SUPPRESS, help=help_text
            )
        else:
            base = args[0] if args else annotation
            kind = base if base in (int, float) else str
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)


def _source(name: str, flags: dict[str, Any]) -> str:
    """Where a setting's value came from, as the user wrote it: the flag, else the variable."""
    return "--" + name.replace("_", "-") if name in flags else f"EMBED_{name.upper()}"


def settings_errors(exc: Exception, flags: dict[str, Any]) -> list[str]:
    """One line per invalid setting, naming the flag or variable, the value and what is wrong."""
    if isinstance(exc, ValidationError):
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            if name in flags:  # as typed: --num-threads -2
                shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
                lines.append(f"{_source(name, flags)} {shown}: {msg}")
            else:
                lines.append(f"{_source(name, flags)}={value!r}: {msg}")
        return lines
    # pydantic-settings fails before validation when a variable cannot be decoded at all.
    found = re.search(r'field "(\w+)"', str(exc))
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    return [f"{_source(found.group(1), flags) if found else 'settings'}: cannot read the value{cause}"]


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


# The settings `encode` takes: the engine's, not the HTTP server's.
ENCODE_SETTINGS = (
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
            settings = Settings(**values)
        except (ValidationError, SettingsError) as exc:
            for line in settings_errors(exc, values):
                print(f"embed-service: {line}", file=sys.stderr)
            return 2
        from embed_service.server import serve

        return serve(settings)
    return 2


def _encode(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    from embed_service import offline

    try:
        Settings(**settings)  # the settings' refusals as serve gives them, before the input is read
    except (ValidationError, SettingsError) as exc:
        for line in settings_errors(exc, settings):
            print(f"embed-service: {line}", file=sys.stderr)
        return 2
    try:
        return offline.run(args, settings)
    except (offline.JobError, ValueError) as exc:
        print(f"embed-service: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
