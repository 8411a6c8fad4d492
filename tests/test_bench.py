"""`embed-service bench` against a live server on loopback: a sane report, from either client."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.server import CORPUS


@pytest.mark.parametrize("client", ["python", "wrk"])
def test_bench_reports_throughput_latency_and_the_client_ceiling(exact_server, client, tmp_path):
    if client == "wrk" and shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (.ci/run installs it)")
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "embed_service", "bench", "--url", exact_server.url,
           "--corpus", str(CORPUS / "queries.jsonl"), "--texts", "40", "--inputs-per-request", "4",
           "--concurrency", "2", "--duration", "2", "--encoding-format", "base64", "--client", client,
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert json.loads(run.stdout.strip().splitlines()[-1]) == report  # the JSON line on stdout too
    assert "texts/s" in run.stdout and "client ceiling" in run.stdout  # and the table
    assert report["client"] == client and report["errors"] == 0
    assert report["requests"] > 0
    assert report["texts_per_s"] == pytest.approx(report["requests_per_s"] * 4, rel=0.01)
    # Token counts come from the server's usage: queries are short, but never below [CLS] x [SEP].
    assert 3 <= report["tokens_per_text"] < 256
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    # The null endpoint answers far faster than a model can.
    assert report["ceiling_requests_per_s"] > report["requests_per_s"]


def test_bench_counts_errors_from_a_refusing_server(exact_server, tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "embed_service", "bench", "--url", exact_server.url + "/v1/embeddings",
           "--corpus", str(CORPUS / "queries.jsonl"), "--texts", "4", "--concurrency", "1",
           "--duration", "1", "--model", "no-such-model", "--client", "python", "--no-ceiling",
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "404" in run.stderr  # the warm-up pass names the refusal
