"""Prometheus metrics: the documented names, a model label on each, and a real Prometheus scraping them."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server import free_port

NAMES = [
    "embed_requests_total",
    "embed_input_tokens_total",
    "embed_request_duration_seconds_bucket",
    "embed_queue_duration_seconds_bucket",
    "embed_tokenization_duration_seconds_bucket",
    "embed_inference_duration_seconds_bucket",
    "embed_batch_size_bucket",
    "embed_batch_tokens_bucket",
    "embed_queue_size",
]


def samples(url: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            out.setdefault(line.split("{")[0].split()[0], []).append(line)
    return out


def test_documented_metrics_with_model_label(exact_server):
    url = exact_server.url
    r = httpx.post(url + "/v1/embeddings", json={"input": ["count these tokens", "and these"]})
    tokens = r.json()["usage"]["prompt_tokens"]
    httpx.post(url + "/v1/embeddings", json={"input": ""})  # a 400
    got = samples(url)
    for name in NAMES:
        assert name in got, f"{name} missing"
        assert all('model="all-MiniLM-L6-v2"' in line for line in got[name]), got[name]
    statuses = {line.split('status="')[1].split('"')[0] for line in got["embed_requests_total"]}
    assert {"200", "400"} <= statuses
    assert float(got["embed_input_tokens_total"][0].split()[-1]) >= tokens


def requests_counted(url: str) -> float:
    return sum(float(line.split()[-1]) for line in samples(url).get("embed_requests_total", []))


def test_probes_and_scrapes_are_not_counted_as_requests(exact_server):
    """EmbedServiceHighErrorRate divides 5xx by embed_requests_total: the 503s /health answers while a
    model loads or the server drains, and every probe and scrape, would otherwise count as traffic."""
    url = exact_server.url
    before = requests_counted(url)  # this scrape itself included
    for path in ("/health", "/live", "/metrics", "/health", "/live", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    assert requests_counted(url) == before
    httpx.post(url + "/v1/embeddings", json={"input": "counted"})
    assert requests_counted(url) == before + 1


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs the prometheus binary (Debian package 'prometheus'; .ci/run installs it)",
)
def test_real_prometheus_scrapes_the_server(exact_server):
    port = free_port()
    target = exact_server.url.removeprefix("http://")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text(
            f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: embed\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            httpx.post(exact_server.url + "/v1/embeddings", json={"input": "scraped"})
            deadline = time.monotonic() + 60
            result: list = []
            while time.monotonic() < deadline and not result:
                time.sleep(1)
                try:
                    q = httpx.get(
                        f"http://127.0.0.1:{port}/api/v1/query",
                        params={"query": 'embed_requests_total{status="200"}'},
                    )
                    result = q.json()["data"]["result"] if q.status_code == 200 else []
                except httpx.TransportError:
                    continue
            assert result, "Prometheus never stored embed_requests_total"
            assert result[0]["metric"]["model"] == "all-MiniLM-L6-v2"
            assert float(result[0]["value"][1]) >= 1
            up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "up"}).json()
            assert up["data"]["result"][0]["value"][1] == "1"
        finally:
            prom.terminate()
            prom.wait(10)
