"""A worker's failures, injected (tests/workers/faults/): the fidelity check refuses a broken kernel, a batch
that runs out of device memory is split or fails alone, a poisoned device restarts its replica.

On a CPU the faults stand in for what only a GPU produces: torch.OutOfMemoryError as CUDA raises it, and
the RuntimeError a device-side assert leaves behind.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server import ServerProcess, refusal
from tests.workers.faults.sitecustomize import FATAL_TOKEN, OOM_TOKEN

FAULTS_DIR = Path(__file__).parent / "faults"
CLS, SEP = 101, 102  # all-MiniLM-L6-v2's WordPiece specials


def faults_env(faults: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "EMBED_TEST_FAULTS": faults}


def embed(server: ServerProcess, inputs: list[list[int]]) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/embeddings", json={"input": inputs, "model": "all-MiniLM-L6-v2"}, timeout=120
    )


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def ids(n: int, marker: int | None = None, seed: int = 0) -> list[int]:
    """[CLS] n - 2 word pieces [SEP], the marker token among them when given."""
    body = np.random.default_rng(seed).integers(2000, 20000, n - 2).tolist()
    if marker is not None:
        body[len(body) // 2] = marker
    return [CLS, *body, SEP]


def test_a_broken_kernel_is_refused_at_start_up():
    why = refusal("--dtype", "float32", env=faults_env("break-kernel"), timeout=180)
    assert "fidelity check failed" in why and "float32 reference" in why, why
    assert "broken (test fault)" in why  # names the kernels it measured


@pytest.fixture(scope="module")
def faulty() -> Iterator[ServerProcess]:
    """One replica at tensor-parallel size 1 with a broken kernel (served anyway, warning), batches of more
    than 40 tokens holding the OOM marker out of memory, and a fatal marker."""
    with ServerProcess(
        "--dtype",
        "float32",
        "--data-parallel-size",
        "1",
        "--fidelity-warn-only",
        env=faults_env("break-kernel,oom-above:40,fatal-token"),
    ) as server:
        yield server


def test_warn_only_serves_and_reports_the_figure(faulty):
    info = httpx.get(faulty.url + "/info").json()
    assert info["kernels"] == "broken (test fault)"
    assert info["fidelity"]["passed"] is False
    assert info["fidelity"]["min_cosine"] < info["fidelity"]["threshold"] == 0.999
    assert "fidelity check failed" in faulty.output()


def test_an_out_of_memory_batch_is_split_and_answered(faulty):
    inputs = [ids(12, OOM_TOKEN, seed=i) for i in range(4)]  # 48 tokens in one batch: out of memory
    together = vectors(embed(faulty, inputs))
    alone = np.concatenate([vectors(embed(faulty, [x])) for x in inputs])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    assert "CUDA out of memory" not in faulty.output()  # handled in the worker, not logged as a failure


def test_an_input_too_large_for_memory_fails_alone_and_the_server_serves_on(faulty):
    r = embed(faulty, [ids(60, OOM_TOKEN)])
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "out_of_memory", r.text
    assert "out of memory on a batch of 60 tokens" in error["message"], r.text
    assert vectors(embed(faulty, [ids(60)])).shape == (1, 384)  # the same length without the fault
    info = httpx.get(faulty.url + "/info").json()
    assert info["replicas"][0]["restarts"] == 0  # no restart: the worker lived through it


def test_a_poisoned_device_restarts_its_replica(faulty):
    r = embed(faulty, [ids(8, FATAL_TOKEN)])
    assert r.status_code == 503, r.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = httpx.get(faulty.url + "/info").json()
        if info["replicas"][0]["state"] == "ready" and info["replicas"][0]["restarts"] == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the replica did not come back: {info['replicas']}\n{faulty.output()[-3000:]}")
    assert vectors(embed(faulty, [ids(8)])).shape == (1, 384)


def test_out_of_memory_at_tensor_parallel_size_2_is_split_on_every_rank():
    """Both ranks run out of memory on the same batch (their shards are the same size), agree on it and
    run the same halves; the group lives."""
    with ServerProcess(
        "--dtype", "float32", "--tensor-parallel-size", "2", env=faults_env("oom-above:40")
    ) as server:
        inputs = [ids(12, OOM_TOKEN, seed=i) for i in range(4)]
        together = vectors(embed(server, inputs))
        alone = np.concatenate([vectors(embed(server, [x])) for x in inputs])
        np.testing.assert_allclose(together, alone, atol=1e-5)
        r = embed(server, [ids(60, OOM_TOKEN)])
        assert r.status_code >= 500, r.text
        assert vectors(embed(server, [ids(20)])).shape == (1, 384)
        assert httpx.get(server.url + "/info").json()["replicas"][0]["restarts"] == 0
