"""A group of worker processes, one per tensor-parallel rank.

Every batch goes to all ranks; rank 0's result comes back. The group lives or dies as a whole: the ranks
meet in collectives on every layer, so one lost rank leaves the others blocked. A watcher thread waits on
every worker's process sentinel; the first worker to exit kills the rest and reports the death once
(``on_death``), and a batch waiting on the group fails at once with ``WorkerDiedError`` instead of hanging.

A hung group is declared dead the same way, by either of two clocks: a worker whose heartbeat stops for
HEARTBEAT_TIMEOUT_S (stopped or frozen: its heartbeat thread runs beside any compute, see worker.py), or a
batch unanswered after ``batch_timeout`` seconds (a hang the heartbeat cannot see: a deadlock in a
collective, a stuck GPU). Dead groups are not reused; the owner starts a new one (engine/replicas.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from typing import Any

import numpy as np

from embed_service.outputs import OutputRequest, SequenceOutput, check_outputs
from embed_service.workers.worker import WorkerConfig, worker_main

log = logging.getLogger(__name__)

# How long a batch that lost its result pipe waits for the watcher to name the worker that died first
# (rank 0's pipe also closes when another rank dies and rank 0 is killed in turn).
_REASON_WAIT_S = 2.0
# A worker's heartbeat (every 0.25 s) missing this long means it is stopped or frozen, not busy: with both
# replicas computing 4,096-token batches back to back on 2 cores at load 8, the longest silence in 40 s was
# 0.30 s.
HEARTBEAT_TIMEOUT_S = 5.0
_WATCH_INTERVAL_S = 0.5


class BatchOutOfMemoryError(RuntimeError):
    """A sequence of the batch does not fit in the device's memory even alone (the worker split the batch)."""


class WorkerDiedError(RuntimeError):
    """A worker process is gone; the group cannot compute any more."""


def describe_exit(rank: int, pid: int | None, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"worker {rank} (pid {pid}) {how}"


class WorkerGroup:
    """The worker processes of one replica of a model, started together and stopped together; rank r runs
    on ``cfg.devices[r]`` (the replica's own devices in the resource plan)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        on_death: Callable[[str], None] | None = None,
        batch_timeout: float | None = None,
    ):
        if cfg.devices and len(cfg.devices) != cfg.world_size:  # a plan that does not fit the group
            raise ValueError(f"{len(cfg.devices)} devices for {cfg.world_size} ranks: {cfg.devices}")
        self.cfg = cfg
        self.on_death = on_death
        self.batch_timeout = batch_timeout  # seconds; None: wait as long as the workers live
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.lane: Connection | None = None  # rank 0's priority-lane pipe (cfg.priority_lane, worker.py)
        self.heartbeats: list[Any] = []  # one shared c_double per rank: its last beat (time.monotonic())
        self.rank_info: list[dict] = []
        self._lock = threading.Lock()  # one batch in flight on the main pipe
        self._lane_lock = threading.Lock()  # and one on the priority lane's
        self._death_lock = threading.Lock()
        self._dead = threading.Event()
        self._closing = False
        self.dead_reason: str | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        # Call from a thread that outlives the workers (the event loop's): each worker asks the kernel to
        # kill it when its parent thread ends (PR_SET_PDEATHSIG), so a server killed outright leaves none.
        ctx = mp.get_context("spawn")
        for rank in range(self.cfg.world_size):
            parent, child = ctx.Pipe()
            heartbeat = ctx.RawValue("d", 0.0)  # 0: no beat yet (the interpreter is still starting)
            lane = ctx.Pipe() if self.cfg.priority_lane and rank == 0 else None
            p = ctx.Process(
                target=worker_main,
                args=(rank, self.cfg, child, heartbeat, lane[1] if lane else None),
                name=f"embed-worker-{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            if lane:
                lane[1].close()
                self.lane = lane[0]
            self.procs.append(p)
            self.conns.append(parent)
            self.heartbeats.append(heartbeat)

    def wait_ready(self, on_log: Callable[[str], None]) -> None:
        """Block until every rank has loaded and warmed up; on a failure kill every rank, then raise."""
        try:
            self._wait_ready(on_log)
        except BaseException:
            self._kill_all()
            raise
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()

    def _wait_ready(self, on_log: Callable[[str], None]) -> None:
        pending = dict(enumerate(self.conns))  # rank -> pipe, for the ranks not ready yet
        info: dict[int, dict] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout=_WATCH_INTERVAL_S)
            silent = self._silent()
            if silent is not None:  # stopped or frozen while loading: it would keep the others waiting
                raise WorkerDiedError(silent + " while loading")
            for obj in ready:
                if isinstance(obj, Connection):
                    rank = self.conns.index(obj)
                    try:
                        msg = obj.recv()
                    except EOFError:  # it is exiting without a word
                        raise self._exited(rank) from None
                    if msg[0] == "log":
                        on_log(msg[1])
                    elif msg[0] == "ready":
                        info[rank] = msg[1]
                        del pending[rank]
                    elif msg[0] == "fatal":  # its traceback's last line says what; the rest at debug level
                        log.debug("worker %d failed while loading:\n%s", rank, msg[1])
                        last = msg[1].strip().splitlines()[-1] if msg[1].strip() else "no reason given"
                        raise WorkerDiedError(f"worker {rank} failed while loading: {last}")
                else:  # a worker exited, ready or not: the others cannot finish
                    rank = sentinels[obj]
                    if rank in pending and pending[rank].poll():
                        continue  # read its last message (a "fatal" traceback) first
                    raise self._exited(rank)
        self.rank_info = [info[r] for r in range(len(self.procs))]

    def _silent(self) -> str | None:
        """Names the first worker whose heartbeat has stopped, if any."""
        now = time.monotonic()
        for rank, heartbeat in enumerate(self.heartbeats):
            last = heartbeat.value
            if last and now - last > HEARTBEAT_TIMEOUT_S:
                pid = self.procs[rank].pid
                return f"worker {rank} (pid {pid}) stopped responding (no heartbeat for {now - last:.1f}s)"
        return None

    def _exited(self, rank: int) -> WorkerDiedError:
        p = self.procs[rank]
        p.join(5)
        return WorkerDiedError(describe_exit(rank, p.pid, p.exitcode) + " while loading")

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        while True:
            ready = wait(sentinels, timeout=_WATCH_INTERVAL_S)
            if self._closing or self._dead.is_set():
                return
            if ready:
                break
            silent = self._silent()
            if silent is not None:
                self._die(silent)
                return
        gone = [r for r, p in enumerate(self.procs) if p.sentinel in ready]
        for rank in gone:
            self.procs[rank].join(1)  # reap it, so its exit code is known
            self._log_last_words(rank)
        # When several are gone at once, a rank killed by a signal is the cause; the others exited because
        # a collective lost it.
        rank = min(gone, key=lambda r: (self.procs[r].exitcode is None or self.procs[r].exitcode >= 0, r))
        p = self.procs[rank]
        self._die(describe_exit(rank, p.pid, p.exitcode))

    def _log_last_words(self, rank: int) -> None:
        """Log the traceback a failing worker sent before it exited, if any."""
        if rank == 0:
            return  # rank 0 fails only during a batch, and run() reads (and logs) its answer
        conn = self.conns[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "fatal":
                    log.error("worker %d failed:\n%s", rank, msg[1])
        except (EOFError, OSError):
            pass

    def _die(self, reason: str) -> None:
        """Declare the group dead once: kill every rank, then tell the owner."""
        with self._death_lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
        log.error("%s; killing the replica's workers", reason)
        self._kill_all(join=False)
        self._dead.set()
        if self.on_death and not self._closing:
            self.on_death(reason)
        self._kill_all()  # reap them

    def run(
        self, ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest], lane: bool = False
    ) -> list[SequenceOutput]:
        """(T,) int32 token ids, (B,) int32 lengths, B output requests -> B results, each with the kinds
        its sequence asked for (checked: OutputMismatchError otherwise). Blocking. `lane`: on rank 0's
        priority-lane thread (a group started with cfg.priority_lane), beside a batch on the main one.

        Raises WorkerDiedError, naming the worker that died, when the group is or becomes dead.
        """
        conns = self.conns
        if lane:
            if self.lane is None:
                raise ValueError("this group has no priority lane")
            conns = [self.lane]
        with self._lane_lock if lane else self._lock:
            if self.dead_reason:
                raise WorkerDiedError(self.dead_reason)
            try:
                for conn in conns:
                    conn.send(("run", ids, lengths, list(requests)))
                msg = self._answer(conns[0], int(ids.size))
            except (EOFError, OSError):
                msg = _EXITED
        return self._outcome(requests, msg)

    async def run_async(
        self, ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest], lane: bool = False
    ) -> list[SequenceOutput]:
        """`run`, from the event loop: the batch is written to the worker's pipe and its answer read as it
        arrives, both by the loop without waiting, instead of on a compute thread (two hand-offs between
        threads per batch, each waiting for the GIL while the loop runs requests). Where this path cannot
        take the batch it runs `run` on a thread: several ranks, a message over `_LOOP_MESSAGE_BYTES`
        (images), a caller on another thread using the pipe, or a loop without `add_reader`."""
        loop = asyncio.get_running_loop()
        conn = self.lane if lane else (self.conns[0] if len(self.conns) == 1 else None)
        lock = self._lane_lock if lane else self._lock
        payload = b"" if conn is None else _ForkingPickler.dumps(("run", ids, lengths, list(requests)))
        if conn is None or len(payload) > _LOOP_MESSAGE_BYTES or not lock.acquire(blocking=False):
            return await loop.run_in_executor(None, self.run, ids, lengths, requests, lane)
        try:
            if self.dead_reason:
                raise WorkerDiedError(self.dead_reason)
            exchange = _Exchange(loop, conn, payload, lock)  # it releases the lock once the answer is read
        except BaseException:
            lock.release()
            raise
        if exchange.unsupported:
            return await loop.run_in_executor(None, self.run, ids, lengths, requests, lane)
        try:
            # Shielded: a cancelled caller leaves the exchange reading its answer, so the pipe's next batch
            # does not read this one's.
            msg = await asyncio.wait_for(asyncio.shield(exchange.answer), self.batch_timeout)
        except asyncio.TimeoutError:
            msg = ("hung", self._hung(int(ids.size)))
        if msg[0] in ("ok", "error", "oom"):
            return self._outcome(requests, msg)
        # The group is dead or dying: naming the cause may wait for the watcher, and killing joins.
        return await asyncio.to_thread(self._outcome, requests, msg)

    def _outcome(self, requests: list[OutputRequest], msg: tuple) -> list[SequenceOutput]:
        """Rank 0's answer to a batch -> its results, or the error it means. Blocking where the group is
        dead or dying (it waits for the watcher to name the cause, and kills)."""
        if msg[0] == "hung":
            self._die(msg[1])
            raise WorkerDiedError(self.dead_reason)
        if msg[0] == "ok":
            return check_outputs(requests, msg[1])
        if msg[0] == "error":  # one rank only: the batch failed, the worker lives on
            raise RuntimeError(msg[1])
        if msg[0] == "oom":  # split down to one sequence and still too large; the workers live on
            raise BatchOutOfMemoryError(msg[1])
        # Rank 0 is gone or failing: with several ranks the cause is often another rank (rank 0 then fails
        # in a collective, or is killed by the watcher). Let the watcher name it, else name it here.
        if msg[0] == "fatal" and "\n" in msg[1]:
            log.error("worker 0 failed:\n%s", msg[1])
        if not self._dead.wait(_REASON_WAIT_S):
            self._die(f"worker 0 failed during a batch: {msg[1]}")
        raise WorkerDiedError(self.dead_reason)

    def _hung(self, tokens: int) -> str:
        return (
            f"worker 0 (pid {self.procs[0].pid}) did not answer a batch of {tokens} tokens within "
            f"{self.batch_timeout:.3g}s (--batch-timeout)"
        )

    def _answer(self, conn: Connection, tokens: int) -> tuple:
        """Rank 0's answer on `conn` to the batch just sent, or ("hung", reason) past the batch deadline."""
        if self.batch_timeout is None:
            return conn.recv()
        if conn.poll(self.batch_timeout):
            return conn.recv()
        return ("hung", self._hung(tokens))

    def _kill_all(self, join: bool = True) -> None:
        # Killing every rank closes their pipe ends, so a batch blocked on a result gets EOF at once.
        for p in self.procs:
            if p.is_alive():
                p.kill()
        if join:
            for p in self.procs:
                p.join(5)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank: ask politely, then kill what is left after `timeout` seconds."""
        self._closing = True
        # Not while a batch is being sent (two writers would interleave on a pipe); a batch stuck past
        # the timeout is ended by the kill below.
        for lock, conns in ((self._lock, self.conns), (self._lane_lock, [self.lane] if self.lane else [])):
            if lock.acquire(timeout=timeout):
                try:
                    for conn in conns:
                        with contextlib.suppress(Exception):
                            conn.send(("stop",))
                finally:
                    lock.release()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in [*self.conns, *([self.lane] if self.lane else [])]:
            conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_EXITED = ("fatal", "a worker exited during a batch")
# A batch message written by the loop: at most this many bytes, so that it fits in the pipe's empty socket
# buffer (Linux: 208 KiB by default) and is written whole at once. A 4,096-token batch of 256 sequences is
# about 25 KB; an image's pixels are larger and go through a thread.
_LOOP_MESSAGE_BYTES = 64 * 1024
_READ_CHUNK = 1 << 20


class _Exchange:
    """One batch's message and answer on a worker's pipe, driven by the event loop's readiness callbacks,
    never blocking it: the message is written as multiprocessing.Connection frames it (a 4-byte big-endian
    length, then the pickle), and the answer read the same way (or -1 and an 8-byte length, for a body over
    2 GiB), so `WorkerGroup.run` and this path speak one protocol on one pipe, one batch at a time (the pipe's
    lock, held from the write until the answer is read whole or the pipe closes). It reads and writes
    through its own duplicate of the pipe's descriptor with MSG_DONTWAIT on each call, and leaves the pipe in
    blocking mode for `run` (uvloop sets it non-blocking while it watches it); it reads no byte past its
    answer.

    `answer` resolves to the worker's message, or to ("fatal", ...) when the pipe closes (the worker exited).
    `unsupported`: this pipe or loop cannot do it (not a socket, no add_reader); nothing was written and the
    lock is released.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: Connection,
        payload: bytes | memoryview,
        lock: threading.Lock,
    ):
        self.loop, self.lock = loop, lock
        self.answer: asyncio.Future = loop.create_future()
        self.unsupported = False
        self._out = memoryview(struct.pack("!i", len(payload)) + payload)
        self._buf = bytearray()
        self._need = 4  # bytes of the answer's frame known to be needed so far
        self._header = 0  # the frame's header length, once known (4, or 12 for a body over 2 GiB)
        self._reading = self._writing = self._finished = False
        fd = os.dup(conn.fileno())
        try:
            self.sock = socket.socket(fileno=fd)
        except OSError:  # not a socket: a pipe made otherwise
            os.close(fd)
            self.unsupported = True
            lock.release()
            return
        try:
            loop.add_reader(self.sock.fileno(), self._readable)
            self._reading = True
        except NotImplementedError:
            self.sock.close()
            self.unsupported = True
            lock.release()
            return
        self._write()

    def _write(self) -> None:
        try:
            n = self.sock.send(self._out, socket.MSG_DONTWAIT)
        except BlockingIOError:
            n = 0
        except OSError:
            self._finish(_EXITED)
            return
        self._out = self._out[n:]
        if self._out and not self._writing:
            self.loop.add_writer(self.sock.fileno(), self._write)
            self._writing = True
        elif not self._out and self._writing:
            self.loop.remove_writer(self.sock.fileno())
            self._writing = False

    def _readable(self) -> None:
        try:
            while len(self._buf) < self._need:
                chunk = self.sock.recv(min(self._need - len(self._buf), _READ_CHUNK), socket.MSG_DONTWAIT)
                if not chunk:
                    self._finish(_EXITED)
                    return
                self._buf += chunk
                if not self._header and len(self._buf) >= 4:
                    (size,) = struct.unpack("!i", self._buf[:4])
                    if size >= 0:
                        self._header, self._need = 4, 4 + size
                    elif len(self._buf) < 12:
                        self._need = 12
                    else:
                        self._header = 12
                        self._need = 12 + struct.unpack("!Q", self._buf[4:12])[0]
        except BlockingIOError:
            return  # the rest when it arrives
        except OSError:
            self._finish(_EXITED)
            return
        if self._header and len(self._buf) >= self._need:
            try:
                msg = _ForkingPickler.loads(memoryview(self._buf)[self._header :])
            except Exception as exc:  # a torn or foreign message: the pipe cannot be trusted any more
                msg = ("fatal", f"an unreadable answer from worker 0: {exc!r}")
            self._finish(msg)

    def _finish(self, msg: tuple) -> None:
        if self._finished:
            return
        self._finished = True
        fd = self.sock.fileno()
        if self._reading:
            self.loop.remove_reader(fd)
        if self._writing:
            self.loop.remove_writer(fd)
        self._reading = self._writing = False
        # uvloop's poll handle (libuv) made the descriptor non-blocking, and the pipe's own descriptor with
        # it (one open file): `run` on a thread needs it blocking again.
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
        self.sock.close()
        self.lock.release()
        if not self.answer.done():
            self.answer.set_result(msg)
