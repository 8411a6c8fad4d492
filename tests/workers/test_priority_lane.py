"""A CPU worker's priority lane (workers/worker.py): a second thread of the same worker process, on the
same weights, answering short requests beside the bulk batch of its main thread, which runs nicer."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from embed_service.engine.engine import BULK_THREAD_NICE
from embed_service.outputs import DENSE_ONLY
from embed_service.workers.group import WorkerDiedError, WorkerGroup, free_port
from embed_service.workers.worker import WorkerConfig


def lane_group(model: Path) -> WorkerGroup:
    cfg = WorkerConfig(str(model), 128, "bfloat16", "cpu", 1, 1, free_port(), priority_lane=True,
                       nice=BULK_THREAD_NICE)  # fmt: skip
    group = WorkerGroup(cfg)
    group.start()
    group.wait_ready(lambda _: None)
    return group


def threads(pid: int) -> dict[str, list[int]]:
    """Thread name -> the niceness of each thread of that name (/proc/PID/task/TID/stat, field 19)."""
    out: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        stat = (task / "stat").read_text()
        out.setdefault(name, []).append(int(stat[stat.rindex(")") + 2 :].split()[16]))
    return out


def test_the_lane_gives_the_main_threads_vectors_beside_a_bulk_batch(default_model_path):
    group = lane_group(default_model_path)
    try:
        rng = np.random.default_rng(0)
        short = rng.integers(1000, 2000, size=(3, 12)).astype(np.int32)
        lengths = np.array([12, 12, 12], dtype=np.int32)
        bulk = np.full(48 * 128, 1037, dtype=np.int32)
        done: dict[str, object] = {}

        def run_bulk() -> None:
            done["bulk"] = group.run(bulk, np.full(48, 128, dtype=np.int32), [DENSE_ONLY] * 48)

        t = threading.Thread(target=run_bulk)
        t.start()
        on_lane = group.run(short.ravel(), lengths, [DENSE_ONLY] * 3, lane=True)
        t.join(120)
        assert not t.is_alive() and len(done["bulk"]) == 48
        on_main = group.run(short.ravel(), lengths, [DENSE_ONLY] * 3)
        for a, b in zip(on_lane, on_main):
            assert a.dense.tobytes() == b.dense.tobytes()  # same weights, same kernels, same bytes
    finally:
        group.close()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread niceness from /proc")
def test_bulk_work_runs_nicer_than_the_lane(default_model_path):
    """The main thread (bulk batches) runs BULK_THREAD_NICE levels nicer than the process started; the
    lane's thread keeps the process's niceness, so on contended cores the kernel runs the lane first."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    group = lane_group(default_model_path)
    try:
        pid = group.pids[0]
        nice = threads(pid)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, own + BULK_THREAD_NICE)  # the main thread
        assert nice["embed-lane"] == [own]
    finally:
        group.close()


def test_a_lane_batch_on_a_dead_worker_fails_with_the_workers_death(default_model_path):
    group = lane_group(default_model_path)
    try:
        os.kill(group.pids[0], signal.SIGKILL)
        group.procs[0].join(30)
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL|exited"):
            group.run(
                np.full(8, 1037, dtype=np.int32), np.array([8], dtype=np.int32), [DENSE_ONLY], lane=True
            )
    finally:
        group.close()
