"""A request model's refusal as the engine's error kind: the first error, with the field at fault as its
``param``, in the message every caller sends (an HTTP 400 and the Python API's InvalidInputError alike)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from embed_service.engine.errors import InvalidInputError

M = TypeVar("M", bound=BaseModel)


def invalid_input(errors: Sequence[Mapping[str, Any]]) -> InvalidInputError:
    """pydantic's errors (``exc.errors()``) -> the first one as an InvalidInputError: ``where: message``."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    where = ".".join(loc)
    return InvalidInputError(f"{where}: {msg}" if where else msg, param)


def validate(schema: type[M], data: Any) -> M:
    """`schema` applied to `data`; a refusal as an InvalidInputError."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise invalid_input(exc.errors()) from None
