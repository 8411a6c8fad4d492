"""/metrics with several HTTP processes: the engine process's registry, with the HTTP series (requests,
durations, tokenization in the front ends) summed over the front ends' reports."""

from __future__ import annotations

from typing import Any

from prometheus_client.metrics_core import Metric

from embed_service import metrics

# recorded by the front ends (tokenization and image decoding: of the inputs they prepare; the engine
# process records the rest)
FRONT_END_METRICS = (
    metrics.REQUESTS,
    metrics.REQUEST_DURATION,
    metrics.TOKENIZATION_DURATION,
    metrics.IMAGES,
    metrics.IMAGE_BYTES,
    metrics.IMAGE_DECODE_DURATION,
)
HTTP_FAMILIES = (
    "embed_requests",
    "embed_request_duration_seconds",
    "embed_tokenization_duration_seconds",
    "embed_images",
    "embed_image_bytes",
    "embed_image_decode_duration_seconds",
)


def http_samples() -> list[tuple[str, tuple, float]]:
    """This process's HTTP series as (sample name, labels, value): cumulative, so the latest report is all."""
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in FRONT_END_METRICS
        for m in family.collect()
        for s in m.samples
    ]


class SummedHTTP:
    """The engine registry's families, the HTTP ones with each sample summed over the front ends' reports
    (``_created`` timestamps: the earliest)."""

    def __init__(self, reports: dict[int, list[tuple[str, tuple, float]]]):
        self.reports = reports

    def collect(self) -> Any:
        total: dict[tuple[str, tuple], float] = {}
        for samples in self.reports.values():
            for name, labels, value in samples:
                key = (name, labels)
                if name.endswith("_created"):
                    total[key] = min(total.get(key, value), value)
                else:
                    total[key] = total.get(key, 0.0) + value
        for family in metrics.REGISTRY.collect():
            if family.name not in HTTP_FAMILIES:
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in sorted(total.items()):
                if name.startswith(family.name):
                    out.add_sample(name, dict(labels), value)
            yield out
