"""`Embedder` where the engine cannot take the work: a call that finds the capacity held by other callers waits
for it a bounded time, then raises OverloadedError saying so; a script that builds an Embedder without the
``if __name__ == "__main__":`` guard gets one error saying where the guard goes, instead of a worker's
traceback per spawn."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embed_service import Embedder
from embed_service import embedder as embedder_module
from embed_service.engine.errors import OverloadedError

CAPACITY = 64


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    options = {"max_concurrent_requests": CAPACITY, "interactive_reserved_inputs": 0}
    with Embedder(dtype="float32", data_parallel_size=1, **options) as e:
        yield e


def hold_all_capacity(e: Embedder) -> list:
    """Another caller's permits, taken on the engine's loop until the admission has no room left."""

    async def take() -> list:
        permits = []
        while True:
            try:
                permits.append(e._engine.admission.admit(CAPACITY))
            except OverloadedError:
                return permits

    return e._loop.run(take())


def test_waiting_for_capacity_is_bounded(embedder, monkeypatch):
    monkeypatch.setattr(embedder_module, "OVERLOADED_WAIT_S", 0.5, raising=False)
    permits = hold_all_capacity(embedder)
    assert permits
    try:
        # The wait_for only keeps a regression from hanging the suite; the bound is OVERLOADED_WAIT_S.
        with pytest.raises(OverloadedError, match=r"no room for inputs 0\.\.2 within 0\.5 s"):
            asyncio.run(asyncio.wait_for(embedder.aencode(["a", "b", "c"]), 60))
    finally:

        async def release() -> None:
            for permit in permits:
                permit.close()

        embedder._loop.run(release())
    assert embedder.encode(["a", "b", "c"]).shape == (3, 384)  # still serving once the capacity is back


SCRIPT = """
    from embed_service import Embedder

    {body}
"""
BODY = """e = Embedder(dtype="float32", data_parallel_size=1)
    print(e.encode(["hello"]).shape)
    e.close()"""


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(SCRIPT.format(body=body)))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)


def test_a_script_without_the_main_guard_is_told_where_it_goes(tmp_path):
    r = run_script(tmp_path, BODY)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Embedder() ran again in a worker process")
    assert 'under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in r.stderr and r.stderr.count("Traceback") == 1  # no worker's


def test_the_guard_it_names_is_enough(tmp_path):
    guarded = 'if __name__ == "__main__":\n        ' + BODY.replace("\n    ", "\n        ")
    r = run_script(tmp_path, guarded)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(np.zeros((1, 384)).shape)
