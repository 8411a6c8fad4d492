"""A group of worker processes, one per tensor-parallel rank.

Every batch goes to all ranks; rank 0's result comes back. A watcher notices a worker that dies and reports
it once; a batch waiting on a dead group fails at once instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from embed_service.workers.worker import WorkerConfig, worker_main

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process is gone; the group cannot compute any more."""


class WorkerGroup:
    def __init__(self, cfg: WorkerConfig, on_death: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.on_death = on_death
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.rank_info: list[dict] = []
        self._lock = threading.Lock()
        self._closing = False
        self.dead_reason: str | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.cfg.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main, args=(rank, self.cfg, child), name=f"embed-worker-{rank}", daemon=True
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def wait_ready(self, on_log: Callable[[str], None]) -> None:
        """Block until every rank has loaded and warmed up; raise if one fails."""
        pending = dict(enumerate(self.conns))
        info: dict[int, dict] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while pending:
            ready = wait(list(pending.values()) + list(sentinels))
            for obj in ready:
                if obj in sentinels and sentinels[obj] in pending:
                    rank = sentinels[obj]
                    conn = pending[rank]
                    if conn.poll():
                        continue  # read its last message first
                    raise WorkerDiedError(
                        f"worker {rank} exited with code {self.procs[rank].exitcode} while loading"
                    )
                if isinstance(obj, Connection):
                    rank = self.conns.index(obj)
                    try:
                        msg = obj.recv()
                    except EOFError:
                        raise WorkerDiedError(f"worker {rank} exited while loading") from None
                    if msg[0] == "log":
                        on_log(msg[1])
                    elif msg[0] == "ready":
                        info[rank] = msg[1]
                        del pending[rank]
                    elif msg[0] == "fatal":
                        raise WorkerDiedError(f"worker {rank} failed while loading:\n{msg[1]}")
        self.rank_info = [info[r] for r in range(len(self.procs))]
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        rank = next(r for r, p in enumerate(self.procs) if p.sentinel in ready)
        self.dead_reason = (
            f"worker {rank} (pid {self.procs[rank].pid}) exited with code {self.procs[rank].exitcode}"
        )
        log.error("%s; the model cannot serve", self.dead_reason)
        self._kill_all()
        if self.on_death:
            self.on_death(self.dead_reason)

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """(T,) int32 token ids, (B,) int32 lengths -> (B, D) float32 pooled vectors. Blocking."""
        with self._lock:
            if self.dead_reason:
                raise WorkerDiedError(self.dead_reason)
            try:
                for conn in self.conns:
                    conn.send(("run", ids, lengths))
                msg = self.conns[0].recv()
            except (EOFError, OSError, BrokenPipeError):
                raise WorkerDiedError(self.dead_reason or "a worker exited during a batch") from None
        if msg[0] == "ok":
            return msg[1]
        raise RuntimeError(msg[1])

    def _kill_all(self) -> None:
        # Killing every rank closes their pipe ends, so a batch blocked on a result gets EOF at once.
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
