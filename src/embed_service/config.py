"""Settings, in two parts: the server's (address, keys, HTTP limits, logging) and each model's (what it is, where
it runs, its batch budgets and limits). ``Settings`` is both together: the one-model configuration, every field
a CLI flag and an ``EMBED_*`` variable. Several models: ``ServeConfig`` holds the server's settings and one
``Settings`` per model (the server's settings with that model's), built by the command line from repeated
``--model`` flags or a ``--config`` file (config_file.py)."""

from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def _check_positive(v: Any) -> Any:
    if v is not None and v < 1:
        raise ValueError("must be at least 1")
    return v


def _check_not_negative(v: Any) -> Any:
    if v < 0:
        raise ValueError("must be 0 or more")
    return v


class ServerSettings(BaseSettings):
    """The server's own settings, shared by every model it serves: the address, the keys, the HTTP limits,
    logging, tracing and draining."""

    model_config = SettingsConfigDict(env_prefix="EMBED_", use_attribute_docstrings=True, extra="ignore")

    config: str | None = None
    """A YAML (``.yaml``, ``.yml``) or TOML (``.toml``) file of settings: server settings at the top level and
    the served models under ``models``, each with its own settings (docs/configuration.md, several models).
    Flags win over the file, which wins over ``EMBED_*`` variables."""

    host: str = "127.0.0.1"
    """Address to listen on."""

    port: int = 8000
    """Port to listen on."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity."""

    log_format: Literal["text", "json"] = "text"
    """Log line format, the same for the server's lines and uvicorn's: ``text`` (one readable line each) or
    ``json`` (one JSON object per line, tracebacks included, for log collectors)."""

    otlp_endpoint: str | None = None
    """OpenTelemetry collector to send request traces to, over OTLP/HTTP: its base URL (e.g.
    ``http://otel-collector:4318``; ``/v1/traces`` is added). Needs the ``otel`` extra. Default: no tracing."""

    api_key: str | None = None
    """When set, requests must carry ``Authorization: Bearer <key>`` (/live, /health and /metrics stay open).
    Several keys: separate them with commas. On the command line a key is visible to every local user (the
    process list): pass it in ``EMBED_API_KEY`` or in ``--api-key-file`` instead."""

    api_key_file: str | None = None
    """A file of accepted API keys, one per line (blank lines and ``#`` comments skipped), read at start-up;
    adds to ``--api-key``. Keep it readable by the server's user only."""

    docs: bool = True
    """Serve the API description: /openapi.json, Swagger UI at /docs and ReDoc at /redoc, with their assets
    (no CDN), behind the API key when one is set."""

    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for admitted requests to finish before the server exits anyway."""

    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body; larger ones get 413."""

    max_header_bytes: int = 32 * 1024
    """Largest request head (request line and headers); a larger one gets 431 and the connection is closed."""

    header_timeout: float = 10.0
    """Seconds to receive a request head, counted from the connection's opening (or, on a kept-alive
    connection, from the head's first byte); past it the connection is closed (408 when part of a head came)."""

    body_timeout: float = 60.0
    """Seconds to receive a whole request body once its head is in; past it the request gets 408 and the
    connection is closed."""

    keep_alive_timeout: float = 5.0
    """Seconds an idle kept-alive connection stays open between requests."""

    max_connections: int = 1024
    """Open client connections; a request on a connection past it gets 503 with ``Retry-After`` and the
    connection is closed. Lowered at start-up to what the open-file limit allows (with a warning)."""

    http_processes: int = 1
    """HTTP front-end processes. 1: one process does HTTP and runs the engines. N > 1: N processes share the
    port and do HTTP, auth, validation, the budget checks, the tokenization of texts and response encoding;
    they pass each request's token ids (texts, where it chunks them) to the one process that runs the
    engines (admission, batching, workers, metrics) over a local socket. For a fast accelerator that one
    HTTP process cannot keep busy (docs/performance.md)."""

    engine_call_timeout: float = 600.0
    """With --http-processes N > 1: seconds a front end waits for the engine process to answer one call
    (an embedding request, a tokenization, a drain's wait); past it the request gets 503 and the engine's
    work for it is cancelled."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://otel-collector:4318")
        return v or None

    @field_validator("port")
    @classmethod
    def _port_range(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError("port must be in 0..65535")
        return v

    @field_validator(
        "max_header_bytes",
        "header_timeout",
        "body_timeout",
        "keep_alive_timeout",
        "max_connections",
        "engine_call_timeout",
    )
    @classmethod
    def _positive_http_limit(cls, v: float) -> float:
        if not v > 0:  # NaN too
            raise ValueError("must be positive")
        return v

    @field_validator("http_processes")
    @classmethod
    def _some_processes(cls, v: int) -> int:
        return _check_positive(v)

    @field_validator("max_request_bytes")
    @classmethod
    def _positive_bytes(cls, v: int) -> int:
        return _check_positive(v)

    @field_validator("drain_timeout")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError("must be a number of seconds, 0 or more")
        return v


class ModelSettings(BaseSettings):
    """One served model's settings: what it is, the names it answers to, where and how it runs (device,
    dtype, replicas, tensor-parallel size, threads), its batch budgets and its request limits."""

    model_config = SettingsConfigDict(env_prefix="EMBED_", use_attribute_docstrings=True, extra="ignore")

    model: str | None = None
    """A model directory (Hugging Face / sentence-transformers layout), a Hugging Face cache folder
    (models--org--name) or a Hugging Face repo id (org/name: taken from the local Hugging Face cache, else
    downloaded unless HF_HUB_OFFLINE is set). Default: the packaged all-MiniLM-L6-v2. Repeat it to serve
    several models: the per-model flags after a --model are that model's."""

    revision: str | None = None
    """Branch, tag or commit of a Hugging Face repo id or cache folder given as the model. Default: main."""

    # NoDecode: the variable reaches the validator as written ("a,b"), not JSON-decoded first.
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Names the model answers to (repeatable): the first is canonical, the others aliases. Default: the directory's name, or the repo id."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: ``auto`` picks CUDA when a GPU is visible, else the CPU."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype. ``auto``: bfloat16 on GPUs that have it (float16 on older ones) and on CPUs
    with AMX or AVX512-BF16, float32 elsewhere. Pooling and normalization always run in float32."""

    quantization: Literal["none", "int8"] = "none"
    """``int8`` (CPU only): the attention-output and MLP projections in int8 (query/key/value stay in the dtype), weights per output channel and
    activations per token (VNNI or AMX-INT8 through oneDNN), the rest in the dtype; the start-up fidelity
    check's floor is then 0.995 unless --fidelity-min-cosine says otherwise (docs/performance.md)."""

    max_input_length: int | None = None
    """Tokens per input, special tokens included. Default: the model's (sentence-transformers max_seq_length,
    else the tokenizer's model_max_length, else max_position_embeddings)."""

    auto_truncate: bool = True
    """Cut inputs longer than the max input length (keeping special tokens); when off they get a 400."""

    llm_reranker: bool = False
    """Serve a causal LM (a *ForCausalLM folder, Qwen3-Reranker style) as a reranker: each (query, document)
    is scored by the ``yes`` and ``no`` logits at the last token of Qwen3-Reranker's prompt template
    (docs/models.md). Only /rerank then; off: the folder is served as an embedding model."""

    rerank_instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    """The instruction an LLM reranker's prompt gives when a request names none (``instruction``)."""

    chunk_long_inputs: bool = False
    """Embed a text longer than the max input length as windows whose vectors are averaged, weighted by
    their tokens, instead of truncating it (docs/api.md, long inputs). A request can override it with
    ``chunking``. Token-id inputs are never chunked."""

    chunk_overlap: int = 0
    """Tokens each window of a chunked text shares with the one before it (at most half a window). A
    request can override it with ``chunking.overlap``."""

    max_chunks_per_input: int = 64
    """Windows one chunked text may make; a text that would make more is a 400."""

    max_batch_tokens: int | None = None
    """Real tokens per forward pass (a batch always takes at least one sequence). Must be >= the max input
    length. Default: 4096, or the max input length when that is longer."""

    max_batch_requests: int = 256
    """Sequences per forward pass."""

    max_concurrent_requests: int = 2048
    """Inputs admitted and not yet answered (tokenizing, queued or running), on every route together. A
    request larger than the free capacity is admitted piecewise (its inputs enter as capacity frees); one
    that finds no room at all is answered 429 at once."""

    interactive_reserved_inputs: int = 256
    """Of --max-concurrent-requests, inputs held for interactive requests (at most
    --interactive-max-inputs inputs): bulk requests never take them, so a large request cannot lock
    short ones out. Interactive requests beyond it are admitted as bulk work. At most a quarter of the
    capacity is reserved, whatever the value."""

    interactive_max_inputs: int = 32
    """Requests of at most this many inputs may use the reserved capacity; those of them with at most
    --priority-max-tokens tokens take the priority lane."""

    max_client_batch_size: int = 2048
    """Inputs in one request (on every route); more is a 400."""

    max_input_chars: int = 131072
    """Characters of one input, the prompt included, that the tokenizer may read. Longer texts are cut
    before tokenizing, to what the max input length can use; a text whose truncation cannot be decided
    within this many characters (mostly whitespace) is a 400, as is any longer input with truncation off
    whose length cannot be decided either."""

    max_image_pixels: int = 4096 * 4096
    """Pixels (width x height, from its header, before decoding) of one image input (CLIP, SigLIP); more: 400."""

    max_image_bytes: int = 20 << 20
    """Encoded bytes one image input may have (after base64 decoding); a larger one is a 400."""

    max_request_image_bytes: int = 64 << 20
    """Encoded bytes all the image inputs of one request may have together; more is a 400."""

    max_request_image_pixels: int = 1 << 28
    """Decoded pixels (from each header, before decoding) of all the image inputs of one request; more is a 400."""

    allowed_media_domains: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Hosts image inputs may be fetched from by http:// or https:// URL, each matched exactly (a subdomain
    is a host of its own); comma-separated or repeated. Default: none, and a URL is a 400."""

    allowed_media_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Address ranges (CIDR, e.g. ``10.1.2.0/24``) an allowed host may resolve to although they are private,
    loopback, link-local or otherwise not public, for an internal image store. Default: none."""

    media_fetch_timeout: float = 10.0
    """Seconds the URL fetches of one request's images may take together (every lookup, redirect and body,
    counted from the first fetch); more is a 400."""

    media_max_redirects: int = 3
    """Redirects one image's fetch follows, each checked as the first URL; more is a 400."""

    max_request_chars: int = 8 * 1024 * 1024
    """Characters one request may have tokenized: each input's (prompt + text, at most
    --max-input-chars), summed; more is a 400 before any tokenization."""

    bulk_aging_s: float = 1.0
    """While no batch has served the bulk lane for this many seconds, bulk sequences that have waited longer
    go ahead of priority work, in up to half of each batch's tokens, so bulk work cannot starve behind a
    stream of short requests. 0: off."""

    priority_max_tokens: int = 256
    """Requests of at most this many tokens (all inputs together) take the priority lane: every batch takes
    them first, ahead of bulk work. On a CPU at tensor-parallel size 1 each replica's worker also answers the
    lane on a second thread while its main thread computes bulk work, BULK_THREAD_NICE (10) levels nicer,
    in batches of at most LANE_BATCH_REQUESTS (8) times this many tokens. 0: one lane, first come first
    served, no second thread."""

    priority_batch_tokens: int = 256
    """Without the CPU's lane threads (on a GPU, or at tensor-parallel size > 1) and with two or more
    replicas: while interactive traffic is about (a priority request within the last 2 s), the last replica
    takes bulk work only in batches of at most this many tokens, so a short request never waits behind more
    than that much work; without interactive traffic, batches of up to 8 times this many. (A batch carrying
    priority sequences takes no bulk work, whatever this is.)"""

    data_parallel_size: int | None = None
    """Model replicas, each its own worker process(es) forming its own batches, on its own GPUs. Default: 1,
    or 2 on a CPU at tensor-parallel size 1 when the model's share of the cores (the cores divided by the
    models served) is two or more and two copies of the weights take at most an eighth of its share of the
    memory."""

    tensor_parallel_size: int = 1
    """Worker processes the model is sharded over (one per rank)."""

    num_threads: int | None = None
    """Compute threads per worker. Default: the CPU cores divided between every worker of every model
    (tensor-parallel size x replicas, summed over the models), as evenly as whole threads allow."""

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

    fidelity_min_cosine: float | None = None
    """At start-up each replica embeds a few fixed inputs as it serves them (dtype, quantization, kernels,
    attention, tensor parallelism) and with a float32 reference pass of the same weights; below this cosine
    it refuses to become ready, saying why (/info reports the figure). ``0``: no check. Default: 0.999, and
    0.995 with --quantization int8."""

    fidelity_warn_only: bool = False
    """Serve anyway when the start-up fidelity check fails, with a warning in the log and in /info."""

    cuda_graphs: bool = False
    """On CUDA, capture one CUDA graph of the transformer body per token-count step up to 2,048 tokens at
    start-up and replay it for short batches, so that they are not bound by kernel launches (only with a
    varlen attention backend, torch-varlen or flash-attn, one rank, and families whose attention is
    capture-safe). Every step's replay is checked against the eager forward and the fidelity check runs
    through the replays; a replica whose replay disagrees serves eagerly. /info says which steps, or why
    none. Off by default until benchmarks/gpu_check.sh has passed on a device."""

    batch_invariant: bool = False
    """Every output of a sequence the same bytes whatever else is in its batch, its position, the requests
    in flight and the replica: each matmul runs in fixed tiles of 64 rows and padded attention one sequence
    at a time (ops/invariance.py). Costs 12-30% of bulk throughput on a CPU (docs/performance.md). One choice
    per process: it applies to every model served."""

    cache_bytes: int = 0
    """An exact in-process cache of sequence outputs, keyed by the model's weights digest and revision, the
    dtype, device and options that change an output, and the token ids; LRU, at most this many bytes of
    cached results. 0: no cache. A hit is the bytes a computation gives only when outputs do not depend on
    the batch, so a cache turns --batch-invariant on."""

    cache_url: str | None = None
    """A shared Redis (``redis://host:port/db``, ``rediss://``, ``unix://``) behind the in-process cache, for
    every replica and pod serving the same model: the same keys, values in a pickle-free format. An
    outage or a slow Redis (0.5 s timeouts) degrades to computing, counted in
    embed_cache_redis_errors_total. Turns --batch-invariant on; needs the ``cache`` extra."""

    @field_validator("cache_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("fidelity_min_cosine")
    @classmethod
    def _cosine(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:  # NaN too
            raise ValueError("must be a cosine between 0 and 1")
        return v

    @field_validator("served_model_name", "allowed_media_domains", "allowed_media_networks", mode="before")
    @classmethod
    def _split_names(cls, v: object) -> object:
        # EMBED_SERVED_MODEL_NAME="a,b" or "a" (or a JSON list); each flag value may hold commas too.
        if isinstance(v, str):
            v = json.loads(v) if v.lstrip().startswith("[") else [v]
        if isinstance(v, list) and all(isinstance(item, str) for item in v):
            return [name.strip() for item in v for name in item.split(",") if name.strip()]
        return v

    @field_validator("allowed_media_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(n, strict=False)) for n in v]  # a ValueError names the bad one

    @field_validator("media_fetch_timeout")
    @classmethod
    def _fetch_seconds(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError("must be a number of seconds, more than 0")
        return v

    @field_validator("served_model_name")
    @classmethod
    def _distinct_names(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names must be distinct: {v}")
        return v

    @field_validator(
        "max_batch_tokens",
        "max_batch_requests",
        "max_concurrent_requests",
        "max_client_batch_size",
        "interactive_max_inputs",
        "max_input_chars",
        "max_request_chars",
        "tensor_parallel_size",
        "priority_batch_tokens",
        "max_input_length",
        "data_parallel_size",
        "num_threads",
        "max_chunks_per_input",
        "max_image_pixels",
        "max_image_bytes",
        "max_request_image_bytes",
        "max_request_image_pixels",
    )
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        return _check_positive(v)

    @field_validator(
        "priority_max_tokens",
        "interactive_reserved_inputs",
        "bulk_aging_s",
        "chunk_overlap",
        "media_max_redirects",
    )
    @classmethod
    def _not_negative(cls, v: float) -> float:
        return _check_not_negative(v)


class Settings(ServerSettings, ModelSettings):
    """Everything the server can be told about itself and one model: ``Settings(model=..., dtype=...)`` is a
    one-model configuration. Flags win over ``EMBED_*`` variables, which win over defaults."""

    model_config = SettingsConfigDict(env_prefix="EMBED_", use_attribute_docstrings=True, extra="ignore")


SERVER_FIELDS = frozenset(ServerSettings.model_fields)
MODEL_FIELDS = frozenset(ModelSettings.model_fields)


@dataclass(frozen=True)
class ServeConfig:
    """What ``embed-service serve`` runs: the server's settings and, for each served model in order, the
    server's settings with that model's (the first model answers requests that name none)."""

    server: ServerSettings
    models: list[Settings]

    @classmethod
    def single(cls, settings: Settings) -> ServeConfig:
        return cls(settings, [settings])
