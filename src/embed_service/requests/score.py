"""The rerank and classify requests, as the HTTP routes and the Python API both validate them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from embed_service.engine.text import EmbedOptions
from embed_service.requests.fields import TEXT_INPUT, Cut, Priority, check_texts


class RerankDocument(BaseModel):
    """A document as an object (Cohere v1, Jina): its text."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank: Cohere's and Jina's rerank request."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    query: StrictStr = Field(min_length=1)
    """The query every document is scored against."""
    documents: list[StrictStr | RerankDocument] = Field(min_length=1)
    """The documents: strings, or objects with a ``text``. At most --max-client-batch-size."""
    top_n: Cut | None = None
    """Return the best N results only; default, or N at least the number of documents: all of them."""
    return_documents: StrictBool = False
    """Return each result's document text beside its index."""
    truncate: StrictBool = True
    """Cut a pair longer than the max input length (longest_first, as CrossEncoder); false: a 400."""
    max_tokens_per_doc: Cut | None = None
    """Cut each document to this many tokens first (Cohere v2); the pair's limit still applies."""
    rank_fields: Any = None
    """Accepted and ignored (Cohere v1): documents are scored by their text."""
    max_chunks_per_doc: Any = None
    """Accepted and ignored (Cohere v1)."""
    priority: Priority | None = None
    """Accepted and ignored."""
    instruction: StrictStr | None = None
    """An LLM reranker's task instruction (default: --rerank-instruction); a cross-encoder refuses it."""

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        # Said here: pydantic's own message names a union branch ("documents.0.str: ...") and not the
        # object form a client meant to send.
        if not isinstance(v, list):
            raise ValueError("must be a list of strings, or of objects with a text (Cohere v1, Jina)")
        for i, d in enumerate(v):
            if not (isinstance(d, str) or (isinstance(d, dict) and isinstance(d.get("text"), str))):
                got = f"an object with keys {sorted(d)[:5]}" if isinstance(d, dict) else type(d).__name__
                raise ValueError(
                    f'document {i} must be a string or an object with a string text ({{"text": ...}}), '
                    f"got {got}"
                )
        return v

    @property
    def texts(self) -> list[str]:
        """The documents' texts, in order."""
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassifyRequest(BaseModel):
    """POST /classify: texts to classify with a sequence-classification model."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    input: Annotated[list[str], TEXT_INPUT]
    """A text or a list of texts (at most --max-client-batch-size)."""
    truncate: StrictBool | None = None
    """Cut texts longer than the max input length; default: --auto-truncate."""

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_texts(v, "must be a text or a list of texts")


def classify_options(body: ClassifyRequest) -> EmbedOptions:
    """The engine's options for a classify request: truncation only."""
    return EmbedOptions(body.truncate)
