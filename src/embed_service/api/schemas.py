"""Request bodies, validated strictly so every malformed field is a clear 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, field_validator


def _check_input(v: Any) -> list[str] | list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists -> a list of inputs."""
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, list):
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if not v:
        raise ValueError("must not be empty")
    first = v[0]
    if isinstance(first, str):
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise ValueError(f"item {i} is not a string; a list of inputs must not mix types")
            if not s:
                raise ValueError(f"item {i} is an empty string")
        return v
    if _is_int(first):
        if not all(_is_int(t) for t in v):
            raise ValueError("a list of token ids must hold integers only")
        return [v]
    if isinstance(first, list):
        for i, seq in enumerate(v):
            if not isinstance(seq, list) or not all(_is_int(t) for t in seq):
                raise ValueError(f"item {i} is not a list of integer token ids")
            if not seq:
                raise ValueError(f"item {i} is an empty list of token ids")
        return v
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings, per the OpenAI spec, plus the documented extensions."""

    model_config = ConfigDict(extra="ignore")

    input: list[str] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = None
    user: str | None = None
    # Extensions
    truncate: StrictBool | None = None
    truncation_direction: Literal["right", "left"] = "right"
    normalize: StrictBool | None = None
    prompt_name: StrictStr | None = None
    """One of the model's named prompts (config_sentence_transformers.json), prepended to text inputs."""
    prompt: StrictStr | None = None
    """A raw prefix for text inputs, instead of a named prompt."""

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return _check_input(v)


class TokenizeRequest(BaseModel):
    """POST /tokenize: the ids /v1/embeddings would embed."""

    model_config = ConfigDict(extra="ignore")

    input: list[str]
    model: str | None = None
    truncate: StrictBool | None = None
    truncation_direction: Literal["right", "left"] = "right"
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        out = _check_input(v)
        if not isinstance(out[0], str):
            raise ValueError("must be a string or a list of strings")
        return out
