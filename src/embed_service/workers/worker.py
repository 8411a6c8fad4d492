"""The body of one worker process: build this rank's shard of the model, warm up, then run batches.

Messages in: ("run", ids (T,) int32, lengths (B,) int32, requests: B OutputRequests) or ("stop",). Messages
out: ("log", text) and ("ready", info) while starting; then, from rank 0 only, ("ok", B SequenceOutputs, in
batch order, each with the kinds its sequence asked for) or ("error", text) per batch (outputs.py). A parent that goes away closes the pipe, and the worker exits.

A heartbeat thread writes the monotonic clock into a shared double every HEARTBEAT_INTERVAL_S: the group's
watcher reads it to tell a stopped or frozen worker (SIGSTOP, a frozen cgroup) from a busy one, which keeps
beating while its compute threads run (torch releases the GIL inside its ops).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

HEARTBEAT_INTERVAL_S = 0.25


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str
    max_input_length: int
    dtype: str
    device: str
    num_threads: int
    world_size: int
    dist_port: int
    devices: tuple[str, ...] = ()  # one per rank, from the resource plan (plan.py); empty: cuda:rank or cpu


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent goes (Linux); a no-op elsewhere.

    A server killed outright (SIGKILL, OOM killer) then leaves no worker behind, even one blocked in a
    collective that would otherwise wait for its timeout.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the parent went before the request took effect


def beat(heartbeat: Any) -> None:
    """Write the clock into `heartbeat` (a shared c_double) for as long as the process runs."""

    def loop() -> None:
        while True:
            heartbeat.value = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=loop, name="heartbeat", daemon=True).start()


def worker_main(rank: int, cfg: WorkerConfig, conn: Connection, heartbeat: Any = None) -> None:
    # The server decides when its workers stop ("stop", or its pipe closing). A signal sent to the whole
    # process group (Ctrl-C in a terminal, systemd stopping a unit's control group) must start the
    # server's drain, not kill the workers under the requests it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    if heartbeat is not None:
        beat(heartbeat)
    try:
        _serve(rank, cfg, conn)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except Exception:
        try:
            conn.send(("fatal", traceback.format_exc()))
        except Exception:
            pass
        sys.exit(1)


def _serve(rank: int, cfg: WorkerConfig, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from embed_service.models.loader import Embedder
    from embed_service.models.spec import load_spec
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import OutputRequest
    from embed_service.parallel import set_tensor_parallel
    from embed_service.workers.device import DTYPES, rank_device

    torch.set_num_threads(cfg.num_threads)
    device = rank_device(cfg.device, cfg.devices, rank)
    if cfg.device == "cuda":
        torch.cuda.set_device(device)
    if cfg.world_size > 1:
        dist.init_process_group(
            "nccl" if cfg.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{cfg.dist_port}",
            rank=rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=60),
        )
    set_tensor_parallel(rank, cfg.world_size)
    spec = load_spec(cfg.model_path, cfg.max_input_length)

    def say(text: str) -> None:
        if rank == 0:
            conn.send(("log", text))

    t0 = time.perf_counter()
    say(
        f"loading weights from {spec.path} ({cfg.dtype}, {cfg.device}, {cfg.world_size} rank(s), "
        f"{cfg.num_threads} thread(s) each)"
    )
    model = Embedder(spec, DTYPES[cfg.dtype], device).eval()
    say(f"weights loaded in {time.perf_counter() - t0:.1f}s; warming up")

    def run(ids, lengths, requests):
        batch = FlatBatch.from_lengths(torch.from_numpy(ids), lengths.tolist()).to(device)
        return model(batch, requests)

    import numpy as np

    everything = [OutputRequest(spec.outputs)] * 2  # warm every head the model has
    t1 = time.perf_counter()
    n = spec.max_input_length  # the longest shape once, then a short one
    run(np.ones(n * 2, dtype=np.int32), np.array([n, n], dtype=np.int32), everything)
    longest_s = time.perf_counter() - t1  # first use included: an upper bound for the shape
    run(np.ones(32, dtype=np.int32), np.array([16, 16], dtype=np.int32), everything)
    say(f"warm-up done in {time.perf_counter() - t1:.1f}s")
    conn.send(
        (
            "ready",
            {
                "rank": rank,
                "parameter_bytes": model.parameter_bytes(),
                "pid": os.getpid(),
                # Seconds per token of the longest inputs (the dearest per token): what the batch
                # deadline is derived from.
                "warmup_seconds_per_token": longest_s / (2 * spec.max_input_length),
            },
        )
    )

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, ids, lengths, requests = msg
        try:
            out = run(ids, lengths, requests)
        except Exception as exc:
            if cfg.world_size > 1:
                raise  # the ranks are out of step: let the group fail as a whole
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        if rank == 0:
            conn.send(("ok", out))
