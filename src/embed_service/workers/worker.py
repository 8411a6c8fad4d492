"""The body of one worker process: build this rank's shard of the model, warm up, then run batches.

Messages in: ("run", ids (T,) int32, lengths (B,) int32, requests: B OutputRequests, which carry each
sequence's token types too) or ("stop",). Messages
out: ("log", text) and ("ready", info) while starting; then, from rank 0 only, ("ok", B SequenceOutputs, in
batch order, each with the kinds its sequence asked for) or ("error", text) per batch (outputs.py). A parent that goes away closes the pipe, and the worker exits.

With `priority_lane` (a CPU replica of one rank) a second pipe carries the same messages for the priority
lane, answered by a thread of its own on the same weights, while the main thread runs bulk batches `nice`
levels lower: a short request then never waits for a bulk forward, and the kernel gives its thread the core
(docs/performance.md, "Interactive traffic under bulk load").

A heartbeat thread writes the monotonic clock into a shared double every HEARTBEAT_INTERVAL_S: the group's
watcher reads it to tell a stopped or frozen worker (SIGSTOP, a frozen cgroup) from a busy one, which keeps
beating while its compute threads run (torch releases the GIL inside its ops).
"""

from __future__ import annotations

import contextlib
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
    dtype: str  # "auto" on CUDA: each worker decides from its GPU (workers/device.cuda_dtype_for)
    device: str
    num_threads: int
    world_size: int
    dist_port: int
    llm_reranker: bool = False  # Settings.llm_reranker: the spec is read with it
    max_batch_tokens: int = 0  # the largest batch serving forms; 0: 2 x max_input_length
    quantization: str = "none"  # --quantization (layers/quantize.py)
    fidelity_min_cosine: float = 0.999  # the resolved threshold (workers/fidelity.py); 0: not checked
    check_ids: tuple[tuple[int, ...], ...] = ()  # fidelity.CHECK_TEXTS as the engine tokenizes them, or none
    fidelity_warn_only: bool = False  # --fidelity-warn-only
    devices: tuple[str, ...] = ()  # one per rank, from the resource plan (plan.py); empty: cuda:rank or cpu
    cuda_graphs: bool = False  # --cuda-graphs (workers/graphs.py)
    nice: int = 0  # added to the niceness of the thread that runs bulk batches (engine.py)
    # A second pipe and thread for the priority lane (engine.py): CPU, one rank. The main thread then
    # runs at `nice` once the lane's thread has started at the process's own niceness.
    priority_lane: bool = False


# An error after which the device cannot be trusted: a CUDA device-side assert or an illegal memory access
# leaves the context poisoned (every later call fails the same way), so the worker exits and its replica
# is restarted (engine/replicas.py) instead of answering errors forever.
FATAL_MARKERS = (
    "device-side assert",
    "illegal memory access",
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "NCCL error",
    "unspecified launch failure",
)


def is_fatal(exc: BaseException) -> bool:
    """Whether this process's device is unusable after `exc` (an out-of-memory is not: see run_splitting)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in FATAL_MARKERS)


class BatchOutOfMemory(RuntimeError):
    """A batch (after splitting down to one sequence) did not fit in the device's memory."""


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


def name_thread(name: bytes) -> None:
    """The calling thread's name in the kernel (Linux, at most 15 bytes); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_NAME = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]))


def beat(heartbeat: Any) -> None:
    """Write the clock into `heartbeat` (a shared c_double) for as long as the process runs."""

    def loop() -> None:
        while True:
            heartbeat.value = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=loop, name="heartbeat", daemon=True).start()


def worker_main(
    rank: int, cfg: WorkerConfig, conn: Connection, heartbeat: Any = None, lane: Connection | None = None
) -> None:
    # The server decides when its workers stop ("stop", or its pipe closing). A signal sent to the whole
    # process group (Ctrl-C in a terminal, systemd stopping a unit's control group) must start the
    # server's drain, not kill the workers under the requests it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    if cfg.nice and lane is None:
        lower_priority(cfg.nice)  # the threads started from here on inherit it
    if heartbeat is not None:
        beat(heartbeat)
    try:
        _serve(rank, cfg, conn, lane)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except Exception:
        try:
            conn.send(("fatal", traceback.format_exc()))
        except Exception:
            pass
        # At once, without the interpreter's shutdown: tearing down a process group whose peers sit in a
        # collective, or a poisoned CUDA context, can block, and the group learns of the failure from the
        # exit (workers/group.py names the worker that exited).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def lower_priority(levels: int) -> None:
    """Raise the calling thread's niceness (on Linux a thread's own; raising needs no privilege)."""
    with contextlib.suppress(OSError):
        os.nice(levels)


def _serve(rank: int, cfg: WorkerConfig, conn: Connection, lane: Connection | None = None) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from embed_service.layers.linear import mark_int8, packed_bytes
    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.ops import attention, fused
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import DENSE, OutputRequest
    from embed_service.parallel import set_tensor_parallel
    from embed_service.workers import fidelity, null_model
    from embed_service.workers.device import DTYPES, cuda_dtype_for, rank_device

    torch.set_num_threads(cfg.num_threads)
    device = rank_device(cfg.device, cfg.devices, rank)
    if cfg.device == "cuda":
        torch.cuda.set_device(device)
    dtype = cfg.dtype
    if dtype == "auto":  # only on CUDA (resolve_dtype decides the CPU's in the server)
        dtype = cuda_dtype_for(torch.cuda.get_device_capability(device))
    status_group = None
    if cfg.world_size > 1:
        dist.init_process_group(
            "nccl" if cfg.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{cfg.dist_port}",
            rank=rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=60),
        )
        # The ranks agree on each batch's outcome over a CPU group with a short timeout: a rank that ran
        # out of memory alone leaves the others in a collective it never joins, and then times out here
        # and exits (the replica restarts) instead of the group hanging until the batch deadline.
        status_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=STATUS_TIMEOUT_S))
    set_tensor_parallel(rank, cfg.world_size)
    spec = load_spec(cfg.model_path, cfg.max_input_length, cfg.llm_reranker)
    kernels = fused.configure(device.type)  # before the model is built: one choice for this worker
    attention_backend = attention.backend_name(device.type, DTYPES[dtype])

    def say(text: str) -> None:
        if rank == 0:
            conn.send(("log", text))

    t0 = time.perf_counter()
    say(
        f"loading weights from {spec.path} ({dtype}, {cfg.device}, {cfg.world_size} rank(s), "
        f"{cfg.num_threads} thread(s) each; kernels: {kernels}, attention: {attention_backend})"
    )
    if null_model.wanted():  # benchmarks only: no weights, constant outputs (workers/null_model.py)
        model: Any = null_model.NullModel(spec.dimension)
    else:
        model = EmbeddingModel(spec, DTYPES[dtype], device).eval()
        if cfg.quantization == "int8":
            say(f"int8: {mark_int8(model)} linear layers quantized per output channel on first use")
    say(f"weights loaded in {time.perf_counter() - t0:.1f}s; warming up")

    runner: Any = None  # workers/graphs.GraphRunner once captured (before the warm-up and the check)

    def run(ids, lengths, requests, replay=True):
        segments = [r.second_segment for r in requests]  # token types travel with the requests
        batch = FlatBatch.from_lengths(torch.from_numpy(ids), lengths.tolist(), segments)
        out = runner.forward(model, batch, requests) if runner is not None and replay else None
        return out if out is not None else model(batch.to(device), requests)

    def agree(failed: bool) -> bool:
        """Whether any rank failed this step (all ranks call it once per attempt)."""
        if status_group is None:
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=status_group)
        return bool(flag.item())

    def attempt(ids, lengths, requests):
        try:
            out, failed = run(ids, lengths, requests), False
        except torch.OutOfMemoryError:
            out, failed = None, True
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if agree(failed):
            raise BatchOutOfMemory(f"out of memory on a batch of {int(ids.size)} tokens")
        return out

    def run_splitting(ids, lengths, requests):
        """A batch that runs out of device memory is run again in halves (every rank the same halves),
        down to one sequence; what still does not fit fails alone."""
        try:
            return attempt(ids, lengths, requests)
        except BatchOutOfMemory:
            if len(lengths) == 1:
                raise
        half = len(lengths) // 2
        cut = int(lengths[:half].sum())
        return run_splitting(ids[:cut], lengths[:half], requests[:half]) + run_splitting(
            ids[cut:], lengths[half:], requests[half:]
        )

    ids, lengths = warmup_shape(spec.max_input_length, cfg.max_batch_tokens, cfg.device)
    # The graphs first: their memory pool exists before the warm-up's largest batch shows whether the
    # budget fits beside it, and the fidelity check below runs through the replays that will serve.
    runner, cuda_graphs = _capture(model, spec, cfg, device, attention_backend, int(ids.size), say)

    everything = [OutputRequest(spec.outputs)]  # warm every head the model has
    t1 = time.perf_counter()
    run(ids, lengths, everything * len(lengths))  # the largest batch serving forms: an OOM shows now
    longest_s = time.perf_counter() - t1  # first use included: an upper bound for the shape
    run(np.ones(32, dtype=np.int32), np.array([16, 16], dtype=np.int32), everything * 2)
    if spec.image_processor is not None:  # a CLIP or SigLIP model: its vision tower's first use too
        n = spec.tokens_per_image
        blank = np.zeros((3, *spec.image_processor.output_size), np.float32).tobytes()
        run(np.zeros(n, dtype=np.int32), np.array([n], dtype=np.int32), [OutputRequest(pixels=blank)])
    say(f"warm-up done in {time.perf_counter() - t1:.1f}s ({int(ids.size)} tokens)")

    dense = OutputRequest(frozenset({DENSE}))

    def vectors(replay: bool):
        return lambda i, n: np.stack([o.dense for o in run(i, n, [dense] * len(n), replay)])

    check = fidelity.measure(
        model,
        vectors(True),
        int(spec.config.get("vocab_size") or 1000),
        spec.max_input_length,
        cfg.fidelity_min_cosine if DENSE in spec.outputs and not null_model.wanted() else 0.0,
        fast_is_reference=dtype == "float32"
        and kernels.startswith("torch")
        and runner is None
        and cfg.quantization == "none",
        reference_run=vectors(False),  # the float32 pass swaps the parameters: a replay would not follow
        image_run=None if spec.image_processor is None else image_vector(spec, run),
        text_ids=cfg.check_ids,
    )
    if not check.passed:
        reason = (
            f"fidelity check failed: the served vectors of {check.inputs} fixed inputs "
            f"({check.images} synthetic image(s)) reach a cosine of "
            f"only {check.min_cosine:.6f} to a float32 reference pass of the same weights (needs "
            f"{check.threshold}; dtype {dtype}, quantization {cfg.quantization}, kernels {kernels}, attention {attention_backend}, "
            f"{cfg.world_size} rank(s), CUDA graphs {'on' if runner is not None else 'off'})"
        )
        if not cfg.fidelity_warn_only:
            raise fidelity.FidelityError(reason + "; --fidelity-warn-only serves anyway")
        say("WARNING: " + reason + "; serving anyway (--fidelity-warn-only)")
    elif check.min_cosine is not None:
        say(f"fidelity check: cosine {check.min_cosine:.6f} to the float32 reference (>= {check.threshold})")
    if lane is not None:  # started, named and the bulk thread niced before "ready" says so
        lane_started = threading.Event()
        threading.Thread(
            target=_lane_loop,
            args=(lane, run_splitting, cfg.num_threads, lane_started),
            name="priority-lane",
            daemon=True,
        ).start()
        lane_started.wait()
        lower_priority(cfg.nice)  # this (bulk) thread only: the lane was created with the process's niceness
    conn.send(
        (
            "ready",
            {
                "rank": rank,
                "parameter_bytes": model.parameter_bytes(),
                "packed_weight_bytes": packed_bytes(),  # the warm-up packed them (layers/linear.py)
                "pid": os.getpid(),
                # Seconds per token of the warm-up's largest batch (of the longest inputs, the dearest per
                # token): what the batch deadline is derived from.
                "warmup_seconds_per_token": longest_s / int(ids.size),
                "dtype": dtype,
                "quantization": cfg.quantization,
                "kernels": kernels,
                "attention": attention_backend,
                "fidelity": check.info(),
                "cuda_graphs": cuda_graphs.info(),
            },
        )
    )

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        answer = _answer(msg, run_splitting, cfg.world_size)
        if rank == 0:  # it answers for every rank
            conn.send(answer)


def _answer(msg: tuple, run_splitting: Any, world_size: int) -> tuple:
    """A "run" message's answer: ("ok", outputs), ("oom", text) or ("error", text); raises what is fatal."""
    _, ids, lengths, requests = msg
    try:
        return ("ok", run_splitting(ids, lengths, requests))
    except BatchOutOfMemory as exc:  # the batch fails; the worker (and every rank) serves on
        return ("oom", f"{exc}: the device has no memory for it, even one sequence at a time")
    except Exception as exc:
        if world_size > 1 or is_fatal(exc):
            # Several ranks: they are out of step. A poisoned device: every later batch would fail.
            # Exit; the replica is restarted.
            raise
        return ("error", f"{type(exc).__name__}: {exc}")


def _lane_loop(lane: Connection, run_splitting: Any, num_threads: int, started: threading.Event) -> None:
    """The priority lane's thread: its batches on the same weights, beside the main thread's."""
    import torch

    try:
        torch.set_num_threads(num_threads)  # a thread's OpenMP settings are its own
        name_thread(b"embed-lane")  # as `top -H` and /proc/PID/task/*/comm show it
    finally:
        started.set()  # the main thread waits for this before it says "ready"
    try:
        while True:
            msg = lane.recv()
            if msg[0] == "stop":
                return
            lane.send(_answer(msg, run_splitting, 1))
    except (EOFError, OSError):  # the server went away: the main thread sees it too
        return
    except Exception:  # a poisoned device (not on a CPU) or a bug: the whole worker goes, as on the main one
        with contextlib.suppress(Exception):
            lane.send(("fatal", traceback.format_exc()))
        os._exit(1)


def _capture(model: Any, spec: Any, cfg: WorkerConfig, device: Any, backend: str, batch_tokens: int, say):
    """(GraphRunner or None, GraphSteps): the plan's graphs captured, then every step replayed against the
    eager body (graphs.replay_check). A failed capture or a replay below --fidelity-min-cosine (0.999 when
    the check is off) leaves the worker eager, with the reason in the plan (/info) and the log."""
    from embed_service.workers import graphs, null_model

    cuda_graphs = graphs.choose_steps(
        cfg.cuda_graphs, device.type, backend, spec.family.module, cfg.world_size, batch_tokens
    )
    if null_model.wanted():
        cuda_graphs = graphs.GraphSteps((), 0, "no model (the null model)")
    if not cuda_graphs.steps:
        return None, cuda_graphs
    t0, steps = time.perf_counter(), len(cuda_graphs.steps)
    vocab = int(spec.config.get("vocab_size") or 1000)
    need = cfg.fidelity_min_cosine or 0.999
    try:
        runner, cuda_graphs, note = graphs.capture_checked(
            model.model, cuda_graphs, spec.max_input_length, vocab, device, need
        )
    except Exception as exc:
        if is_fatal(exc):
            raise
        off = f"capture failed: {type(exc).__name__}: {exc}"
        say(f"WARNING: CUDA graphs off, {off}")
        return None, graphs.GraphSteps((), 0, off)
    say(f"{note} ({steps} CUDA graphs captured and replayed in {time.perf_counter() - t0:.1f}s)")
    return runner, cuda_graphs


# Seconds the ranks wait for each other to agree on a batch's outcome (see agree() in _serve).
STATUS_TIMEOUT_S = 20.0


def warmup_shape(max_len: int, max_batch_tokens: int, device: str):
    """(T,) ids and (B,) lengths of the warm-up batch: the longest inputs, as many as a batch holds.

    On CUDA the whole --max-batch-tokens budget, so that a batch too large for the device's memory fails at
    start-up, not under traffic. On a CPU two of the longest inputs (memory there is the host's; a full
    budget would only make every start slower), never more than a batch holds.
    """
    import numpy as np

    budget = max_batch_tokens or 2 * max_len
    if device != "cuda":
        budget = min(budget, 2 * max_len)
    lengths = [max_len] * max(1, budget // max_len)
    if budget > sum(lengths):
        lengths.append(budget - sum(lengths))
    return np.ones(sum(lengths), dtype=np.int32), np.array(lengths, dtype=np.int32)


def image_vector(spec: Any, run: Any):
    """The fidelity check's image pass for a model that embeds images: (replay) -> (1, D), the dense
    vector of workers/fidelity.check_image, preprocessed by the model's own image processor."""
    import numpy as np

    from embed_service.outputs import DENSE, OutputRequest
    from embed_service.workers import fidelity

    pixels = spec.image_processor(fidelity.check_image(spec.image_processor.output_size)).tobytes()
    n = spec.tokens_per_image
    request = OutputRequest(frozenset({DENSE}), pixels=pixels)
    return lambda replay: np.stack(
        [o.dense for o in run(np.zeros(n, dtype=np.int32), np.array([n], dtype=np.int32), [request], replay)]
    )
