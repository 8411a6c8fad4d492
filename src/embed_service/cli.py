"""`embed-service serve` (every Settings field is a flag (--kebab-case) and an EMBED_* variable) and
`embed-service bench` (load against any OpenAI-compatible embeddings URL)."""

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


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from embed_service import bench

        return bench.main(args)
    values: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command"}
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
