"""Settings: one pydantic-settings class, every field a CLI flag and an ``EMBED_*`` variable."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


class Settings(BaseSettings):
    """Everything the server can be told. Flags win over ``EMBED_*`` variables, which win over defaults."""

    model_config = SettingsConfigDict(env_prefix="EMBED_", use_attribute_docstrings=True, extra="ignore")

    model: str | None = None
    """Local model directory (Hugging Face / sentence-transformers layout). Default: the packaged all-MiniLM-L6-v2."""

    served_model_name: list[str] = Field(default_factory=list)
    """Names the model answers to (repeatable): the first is canonical, the others aliases. Default: the directory's name."""

    host: str = "127.0.0.1"
    """Address to listen on."""

    port: int = 8000
    """Port to listen on."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity."""

    api_key: str | None = None
    """When set, requests must carry ``Authorization: Bearer <key>`` (/live, /health and /metrics stay open)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: ``auto`` picks CUDA when a GPU is visible, else the CPU."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype. ``auto``: bfloat16 on GPUs that have it (float16 on older ones) and on CPUs
    with AMX or AVX512-BF16, float32 elsewhere. Pooling and normalization always run in float32."""

    max_input_length: int | None = None
    """Tokens per input, special tokens included. Default: the model's (sentence-transformers max_seq_length,
    else the tokenizer's model_max_length, else max_position_embeddings)."""

    auto_truncate: bool = True
    """Cut inputs longer than the max input length (keeping special tokens); when off they get a 400."""

    max_batch_tokens: int | None = None
    """Real tokens per forward pass (a batch always takes at least one sequence). Must be >= the max input
    length. Default: 4096, or the max input length when that is longer."""

    max_batch_requests: int = 256
    """Sequences per forward pass."""

    max_concurrent_requests: int = 1024
    """Inputs admitted and not yet answered (queued or running); an input past it is answered 429 at once."""

    max_client_batch_size: int = 2048
    """Inputs in one request."""

    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body; larger ones get 413."""

    priority_max_tokens: int = 256
    """Requests of at most this many tokens (all inputs together) take the priority lane: every batch takes
    them first, ahead of bulk work. 0: one lane, first come first served."""

    priority_batch_tokens: int = 256
    """A batch carrying priority sequences takes at most this many tokens of bulk work; with two or more
    replicas, while interactive traffic is about (a priority request within the last 2 s), the last
    replica takes bulk work only in batches of at most this many tokens, so a short request never waits
    behind more than that much work; without interactive traffic, batches of up to 8 times this many."""

    data_parallel_size: int | None = None
    """Model replicas, each its own worker process(es) forming its own batches. Default: 2 on a CPU with two
    or more cores at tensor-parallel size 1 when two copies of the weights take at most an eighth of the
    memory (each replica with half the cores as threads), else 1."""

    tensor_parallel_size: int = 1
    """Worker processes the model is sharded over (one per rank)."""

    num_threads: int | None = None
    """Compute threads per worker. Default: the CPU cores divided by (tensor-parallel size x replicas)."""

    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for admitted requests to finish before the server exits anyway."""

    batch_timeout: float | None = None
    """Seconds one batch may take before its replica is declared hung, killed and restarted (the batch is
    retried on another replica). Default: 10 times what the replica's warm-up measured per token of the
    longest inputs, times --max-batch-tokens, and at least 30 s."""

    @field_validator("batch_timeout")
    @classmethod
    def _positive_seconds(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError("must be more than 0 seconds")
        return v

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _split_names(cls, v: object) -> object:
        # EMBED_SERVED_MODEL_NAME="a,b" as well as a JSON list.
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("port")
    @classmethod
    def _port_range(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError("port must be in 0..65535")
        return v

    @field_validator(
        "max_batch_tokens",
        "max_batch_requests",
        "max_concurrent_requests",
        "max_client_batch_size",
        "max_request_bytes",
        "tensor_parallel_size",
        "priority_batch_tokens",
    )
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be at least 1")
        return v
