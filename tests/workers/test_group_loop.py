"""A worker group's batches from the event loop (`WorkerGroup.run_async`), on a real one-rank worker with the
packaged default model: the loop writes the batch and reads the answer itself, on the same pipe and in the
same frames as the thread path (`run`), so the two can take turns; a caller cancelled mid-batch leaves the
answer to its own batch; a worker that dies mid-batch fails it with the reason, and the loop serves on
meanwhile (a batch past its deadline: test_group.py, on both paths). Both loops a server runs on: asyncio's
own and uvloop (uvicorn's where installed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import uvloop

from embed_service.outputs import DENSE_ONLY
from embed_service.workers import group as group_module
from embed_service.workers.group import WorkerDiedError, WorkerGroup
from tests.server import HANG_S, wait_until
from tests.workers.test_group import assert_all_exited, one_rank

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run_on(loop_name: str, coro: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(coro)


def batch(n: int, length: int, token: int) -> tuple[np.ndarray, np.ndarray, list]:
    ids = np.full(n * length, token, dtype=np.int32)
    ids[::length] = 101  # [CLS]
    return ids, np.full(n, length, dtype=np.int32), [DENSE_ONLY] * n


def dense(out: list) -> np.ndarray:
    return np.stack([o.dense for o in out])


@pytest.fixture(scope="module")
def group(default_model_path):
    g = WorkerGroup(one_rank(default_model_path))
    g.start()
    try:
        g.wait_ready(lambda _: None)
        yield g
    finally:
        g.close()


async def until_locked(lock: threading.Lock) -> None:
    """Until `lock` is held (a batch is on the pipe), letting the loop run meanwhile."""
    async with asyncio.timeout(HANG_S):
        while not lock.locked():
            await asyncio.sleep(0)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_loop_and_thread_batches_take_turns_on_one_pipe(group, loop_name):
    a, b = batch(3, 9, 2054), batch(5, 4, 7592)
    ref_a, ref_b = dense(group.run(*a)), dense(group.run(*b))  # the thread path, one batch at a time

    async def main() -> None:
        assert np.array_equal(dense(await group.run_async(*a)), ref_a)
        # A batch from the loop and one from a thread at once: the thread's waits for the pipe, and each
        # caller gets the answer to its own batch.
        loop_batch = asyncio.ensure_future(group.run_async(*a))
        await until_locked(group._lock)
        thread_batch = asyncio.ensure_future(asyncio.to_thread(group.run, *b))
        got_a, got_b = await asyncio.gather(loop_batch, thread_batch)
        assert np.array_equal(dense(got_a), ref_a) and np.array_equal(dense(got_b), ref_b)
        assert np.array_equal(dense(await group.run_async(*b)), ref_b)

    run_on(loop_name, main())
    assert not group._lock.locked()


def test_a_cancelled_caller_leaves_its_answer_to_its_own_batch(group):
    a, b = batch(4, 12, 2054), batch(2, 6, 7592)
    ref_b = dense(group.run(*b))

    async def main() -> None:
        first = asyncio.ensure_future(group.run_async(*a))
        await until_locked(group._lock)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # Its answer is still read (and dropped) by the loop; the pipe is free once it is.
        async with asyncio.timeout(HANG_S):
            while group._lock.locked():
                await asyncio.sleep(0)
        assert np.array_equal(dense(await group.run_async(*b)), ref_b)

    run_on("uvloop", main())


def test_an_answer_larger_than_the_pipe_buffer_is_read_whole(group):
    # 600 sequences: ~0.9 MB of vectors, several socket buffers' worth, read as they come.
    big = batch(600, 2, 1037)
    ref = dense(group.run(*big))

    async def main() -> np.ndarray:
        return dense(await group.run_async(*big))

    got = run_on("uvloop", main())
    assert got.shape == (600, 384) and np.array_equal(got, ref)


def test_a_message_too_large_for_the_loop_goes_through_a_thread(group, monkeypatch):
    a = batch(3, 9, 2054)
    ref = dense(group.run(*a))
    callers: list[threading.Thread] = []
    run = group.run

    def recording_run(*args: Any) -> list:
        callers.append(threading.current_thread())
        return run(*args)

    monkeypatch.setattr(group_module, "_LOOP_MESSAGE_BYTES", 0)
    monkeypatch.setattr(group, "run", recording_run)

    async def main() -> list:
        return await group.run_async(*a)

    assert np.array_equal(dense(run_on("asyncio", main())), ref)
    assert len(callers) == 1 and callers[0] is not threading.main_thread()


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_worker_killed_during_a_loop_batch_fails_it_and_the_loop_serves_on(default_model_path, loop_name):
    deaths: list[str] = []
    g = WorkerGroup(one_rank(default_model_path), on_death=deaths.append)
    g.start()
    try:
        g.wait_ready(lambda _: None)
        victim = g.pids[0]
        os.kill(victim, signal.SIGSTOP)  # it cannot answer on any CPU; killed well within the heartbeat's 5 s

        async def main() -> BaseException | None:
            pending = asyncio.ensure_future(g.run_async(*batch(2, 8, 1037)))
            await until_locked(g._lock)
            # The batch waits on the worker, not the loop: other work on the loop runs meanwhile.
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "served"), HANG_S) == "served"
            assert not pending.done()
            os.kill(victim, signal.SIGKILL)
            try:
                await asyncio.wait_for(pending, HANG_S)
            except WorkerDiedError as exc:
                return exc
            return None

        exc = run_on(loop_name, main())
        assert f"worker 0 (pid {victim}) was killed by SIGKILL" in str(exc)
        assert not g._lock.locked()
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL"):
            run_on(loop_name, g.run_async(*batch(1, 4, 1037)))
        assert_all_exited(g)
        wait_until(lambda: deaths, "the death to be reported")
        assert deaths == [f"worker 0 (pid {victim}) was killed by SIGKILL"]
    finally:
        g.close()
