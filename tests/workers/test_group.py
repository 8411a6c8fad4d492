"""The worker group on its own: two real worker processes (gloo) on the packaged default model.

The group lives and dies as a whole: a worker lost at any time fails what waits on the group with an error
naming that worker, reports the death once, and leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvloop
from safetensors.torch import load_file, save_file

from embed_service.outputs import DENSE_ONLY
from embed_service.workers.group import WorkerDiedError, WorkerGroup, free_port
from embed_service.workers.worker import WorkerConfig
from tests.server import HANG_S, wait_until


def config(model: Path) -> WorkerConfig:
    return WorkerConfig(str(model), 128, "float32", "cpu", 1, 2, free_port())


def assert_all_exited(group: WorkerGroup) -> None:
    # The group's watcher thread may be reaping the same processes: a join here can return before that
    # thread has recorded the exit code, so wait for the code rather than trusting one join.
    deadline = time.monotonic() + 10
    for p in group.procs:
        while p.exitcode is None and time.monotonic() < deadline:
            p.join(0.1)
        assert p.exitcode is not None, f"worker pid {p.pid} is still running"


def test_a_killed_worker_fails_the_batch_and_is_reported_once(default_model_path):
    deaths: list[str] = []
    group = WorkerGroup(config(default_model_path), on_death=deaths.append)
    group.start()
    try:
        group.wait_ready(lambda _: None)
        assert [info["rank"] for info in group.rank_info] == [0, 1]
        ids = np.full(2 * 100, 1037, dtype=np.int32)
        out = group.run(ids, np.array([100, 100], dtype=np.int32), [DENSE_ONLY] * 2)
        assert len(out) == 2 and all(o.kinds() == {"dense"} for o in out)
        assert all(o.dense.shape == (384,) and o.dense.dtype == np.float32 for o in out)

        # In flight when rank 1 dies, on any CPU: rank 1 is stopped first, so rank 0 computes up to the
        # first collective and waits there for it; the batch cannot finish before the kill.
        big = np.full(64 * 128, 1037, dtype=np.int32)
        result: dict[str, object] = {}

        def run_big() -> None:
            try:
                group.run(big, np.full(64, 128, dtype=np.int32), [DENSE_ONLY] * 64)
                result["outcome"] = "ok"
            except WorkerDiedError as exc:
                result["outcome"] = exc

        victim = group.pids[1]
        os.kill(victim, signal.SIGSTOP)  # killed below, well within the heartbeat's 5 s
        t = threading.Thread(target=run_big)
        t.start()
        wait_until(lambda: group._lock.locked(), "the batch to be sent")
        os.kill(victim, signal.SIGKILL)
        t.join(HANG_S)
        assert not t.is_alive(), "the batch hangs on a dead group"
        assert f"worker 1 (pid {victim}) was killed by SIGKILL" in str(result["outcome"])
        with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {victim}\) was killed by SIGKILL"):
            group.run(ids, np.array([100, 100], dtype=np.int32), [DENSE_ONLY] * 2)
        assert_all_exited(group)
        # The report comes after the group is marked dead (run() raises first): wait for it. A second one
        # cannot come: the reason is set once, under a lock, before the first report.
        wait_until(lambda: deaths, "the death to be reported")
        assert deaths == [f"worker 1 (pid {victim}) was killed by SIGKILL"]
    finally:
        group.close()


def test_a_worker_that_cannot_load_fails_start_up_and_takes_the_others(default_model_path, tmp_path):
    broken = tmp_path / "missing-a-weight"
    shutil.copytree(default_model_path, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["encoder.layer.3.output.dense.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    group = WorkerGroup(config(broken))
    group.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"failed while loading[\s\S]*encoder.layer.3.output.dense"):
            group.wait_ready(lambda _: None)
        assert_all_exited(group)
    finally:
        group.close()


def test_a_worker_killed_while_loading_does_not_leave_the_others_waiting(default_model_path):
    group = WorkerGroup(config(default_model_path))
    group.start()
    try:
        victim = group.pids[1]
        os.kill(victim, signal.SIGKILL)  # rank 0 would wait for it in the process group's rendezvous
        # The error names the kill: the group saw the exit itself. Waiting out the rendezvous timeout instead
        # (60 s, worker.py) would end in rank 0's own failure, "worker 0 failed while loading: ... timeout".
        with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {victim}\) was killed by SIGKILL"):
            group.wait_ready(lambda _: None)
        assert_all_exited(group)
    finally:
        group.close()


def one_rank(model: Path) -> WorkerConfig:
    return WorkerConfig(str(model), 128, "float32", "cpu", 1, 1, 0)


def test_a_stopped_worker_is_declared_dead_by_its_heartbeat(default_model_path):
    deaths: list[str] = []
    group = WorkerGroup(one_rank(default_model_path), on_death=deaths.append)
    group.start()
    try:
        group.wait_ready(lambda _: None)
        victim = group.pids[0]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: deaths, "the stopped worker to be declared dead")
        print(f"SIGSTOP: declared dead after {time.monotonic() - stopped:.2f}s")
        assert deaths and deaths[0].startswith(
            f"worker 0 (pid {victim}) stopped responding (no heartbeat for"
        )
        assert_all_exited(group)  # killed, although stopped
        with pytest.raises(WorkerDiedError, match="stopped responding"):
            group.run(np.ones(4, dtype=np.int32), np.array([4], dtype=np.int32), [DENSE_ONLY])
    finally:
        group.close()


@pytest.mark.parametrize("path", ["thread", "event loop"])
def test_a_batch_past_its_deadline_kills_the_group_instead_of_waiting_forever(default_model_path, path):
    deaths: list[str] = []
    group = WorkerGroup(one_rank(default_model_path), on_death=deaths.append, batch_timeout=0.02)
    group.start()
    try:
        group.wait_ready(lambda _: None)
        # A worker that cannot answer on any CPU: stopped. Its heartbeat would name it only after 5 s
        # ("stopped responding"); the batch deadline, 0.02 s, is what must end the wait.
        os.kill(group.pids[0], signal.SIGSTOP)
        ids = np.full(4, 1037, dtype=np.int32)
        lengths = np.array([4], dtype=np.int32)
        with pytest.raises(WorkerDiedError, match=r"did not answer a batch of 4 tokens within 0.02s"):
            if path == "thread":
                group.run(ids, lengths, [DENSE_ONLY])
            else:  # WorkerGroup.run_async, on uvloop as the server runs it
                uvloop.run(group.run_async(ids, lengths, [DENSE_ONLY]))
        assert len(deaths) == 1 and "did not answer" in deaths[0]
        assert_all_exited(group)
    finally:
        group.close()


def test_a_worker_stopped_while_loading_fails_start_up_instead_of_hanging_it(default_model_path):
    group = WorkerGroup(one_rank(default_model_path))
    group.start()
    try:
        # its first beat: the worker runs, and loading (import torch) starts now
        wait_until(lambda: group.heartbeats[0].value, "the worker's first heartbeat")
        os.kill(group.pids[0], signal.SIGSTOP)
        with pytest.raises(WorkerDiedError, match=r"stopped responding .* while loading"):
            group.wait_ready(lambda _: None)
        assert_all_exited(group)
    finally:
        group.close()
