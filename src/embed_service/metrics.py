"""Every Prometheus metric the server exports, declared in one place. Names are stable; see docs/metrics.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# Geometric: 0.25 ms .. ~65 s, each bucket twice the last.
DURATION_BUCKETS = tuple(0.00025 * 2**k for k in range(19))
POWERS_OF_TWO = tuple(float(2**k) for k in range(18))

REQUESTS = Counter(
    "embed_requests_total",
    "HTTP responses, by model and status code.",
    ["model", "status"],
    registry=REGISTRY,
)
INPUT_TOKENS = Counter(
    "embed_input_tokens_total",
    "Tokens embedded (after truncation, special tokens included).",
    ["model"],
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "embed_request_duration_seconds",
    "Time from a request's arrival to its response.",
    ["model"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
QUEUE_DURATION = Histogram(
    "embed_queue_duration_seconds",
    "Time a sequence waits in the queue before its batch runs.",
    ["model"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
TOKENIZATION_DURATION = Histogram(
    "embed_tokenization_duration_seconds",
    "Time to tokenize one request's inputs.",
    ["model"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
IMAGES = Counter(
    "embed_images_total", "Image inputs decoded and preprocessed for embedding.", ["model"], registry=REGISTRY
)
IMAGE_BYTES = Counter(
    "embed_image_bytes_total",
    "Encoded bytes of the image inputs decoded (after base64 decoding).",
    ["model"],
    registry=REGISTRY,
)
IMAGE_FETCHES = Counter(
    "embed_image_fetches_total",
    "Image URLs fetched (--allowed-media-domains), by result: ok, not_allowed, redirects, too_large, "
    "timeout, status or failed.",
    ["model", "result"],
    registry=REGISTRY,
)
IMAGE_DECODE_DURATION = Histogram(
    "embed_image_decode_duration_seconds",
    "Time to decode and preprocess one request's images.",
    ["model"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
INFERENCE_DURATION = Histogram(
    "embed_inference_duration_seconds",
    "Forward pass and pooling of one batch.",
    ["model"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "embed_batch_size", "Sequences per batch.", ["model"], buckets=POWERS_OF_TWO, registry=REGISTRY
)
BATCH_TOKENS = Histogram(
    "embed_batch_tokens", "Tokens per batch.", ["model"], buckets=POWERS_OF_TWO, registry=REGISTRY
)
QUEUE_SIZE = Gauge("embed_queue_size", "Sequences waiting to be batched.", ["model"], registry=REGISTRY)
INPUTS_IN_FLIGHT = Gauge(
    "embed_inputs_in_flight",
    "Inputs admitted and not yet answered (queued, tokenizing or running).",
    ["model"],
    registry=REGISTRY,
)
REPLICA_RESTARTS = Counter(
    "embed_replica_restarts_total",
    "Model replicas restarted after a worker died or hung (each attempt, whether it loads or not).",
    ["model"],
    registry=REGISTRY,
)
REPLICAS_READY = Gauge(
    "embed_replicas_ready",
    "Model replicas serving now (below the configured count while one restarts).",
    ["model"],
    registry=REGISTRY,
)


def declare_model(model: str) -> None:
    """Create every per-model series at zero, so dashboards and alerts see them before the first request."""
    for metric in (
        INPUT_TOKENS,
        REQUEST_DURATION,
        QUEUE_DURATION,
        TOKENIZATION_DURATION,
        IMAGES,
        IMAGE_BYTES,
        IMAGE_DECODE_DURATION,
        INFERENCE_DURATION,
        BATCH_SIZE,
        BATCH_TOKENS,
        QUEUE_SIZE,
        INPUTS_IN_FLIGHT,
        REPLICA_RESTARTS,
        REPLICAS_READY,
    ):
        metric.labels(model)


# The exact output cache (cache.py).
CACHE_HITS = Counter(
    "embed_cache_hits_total", "Sequences answered from the output cache.", ["model"], registry=REGISTRY
)
CACHE_MISSES = Counter(
    "embed_cache_misses_total",
    "Sequences the output cache did not hold (computed).",
    ["model"],
    registry=REGISTRY,
)
CACHE_BYTES = Gauge(
    "embed_cache_bytes", "Bytes the in-process output cache holds.", ["model"], registry=REGISTRY
)
CACHE_EVICTIONS = Counter(
    "embed_cache_evictions_total",
    "Entries dropped from the in-process output cache to stay within --cache-bytes.",
    ["model"],
    registry=REGISTRY,
)
CACHE_REDIS_ERRORS = Counter(
    "embed_cache_redis_errors_total",
    "Redis cache lookups and stores that failed (the sequences were computed; nothing failed).",
    ["model"],
    registry=REGISTRY,
)
