"""The resource plan: how many replicas each served model runs, how many CPU threads each worker gets, and
which GPUs each replica's ranks run on, decided once for the whole machine before any worker starts.

A pure function of what the models ask (device, tensor-parallel size, replicas, threads, checkpoint size)
and what the machine has (cores, GPUs, memory), so that it is tested for any machine without one:

- GPUs: the CUDA models' replicas take consecutive devices in the order the models are given, replica r of
  a model at tensor-parallel size tp on its own tp devices (one model alone: cuda:r*tp .. r*tp+tp-1), while
  there are enough devices for one each. With fewer, replicas at tensor-parallel size 1 share devices
  when the GPU memory is known and their checkpoints fit in half of each one's memory
  (GPU_WEIGHT_SHARE: the rest for each process's CUDA context, activations and CUDA graphs): an embedder
  beside a reranker on one GPU. They are placed first-fit in order, never two replicas of one model on a
  GPU, tensor-parallel replicas keeping devices of their own. A plan that fits neither way is refused,
  naming what each model needs.
- CPU threads: every worker process of every model counts (a GPU worker too: its CPU-side work and kernel
  launches); the cores are divided between them as evenly as whole threads allow, the workers of the
  models given first taking the spare cores. A model's own --num-threads is kept and its threads are
  taken from the cores first. With --http-processes N > 1 one core per front end is kept out of the
  workers' share where the cores allow it (each front end does HTTP and tokenizes on its own threads);
  the tokenization threads (TOKENIZE_THREADS per model in every process that tokenizes) are counted and
  shown, not given cores: they run between batches, when the workers wait.
- Replicas by default: 1, or 2 on a CPU at tensor-parallel size 1 when the model's share of the cores
  (cores / models) is at least 2 and two copies of its weights fit in an eighth of its share of the
  memory. On a CPU two single-purpose workers beat one with twice the threads: an OpenMP team stalls at
  every barrier while one of its threads waits for a core the event loop or the client holds (measured on
  2 busy cores: 26 vs 5 passages/s), and a second replica lets a short request run beside a long batch
  instead of behind it. Only where a second copy is cheap: a 7B checkpoint must not be loaded twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
GPU_WEIGHT_SHARE = 0.5  # of a shared GPU's memory, for the checkpoints of the replicas on it
TOKENIZE_THREADS = 2  # per model, in each process that tokenizes (engine/text.py's TextSide)


class PlanError(ValueError):
    """The models cannot run on this machine as asked; the message says what each needs and what is there."""


@dataclass(frozen=True)
class Machine:
    """What the server may use: cores (affinity and cgroup quota), visible GPUs, memory (bytes, or None),
    and the smallest visible GPU's memory (bytes, or None: unknown, and then no GPU is shared)."""

    cores: int
    gpus: int = 0
    memory: int | None = None
    gpu_memory: int | None = None


@dataclass(frozen=True)
class ModelRequest:
    """What one model asks for; None: the plan decides."""

    name: str
    device: str  # "cpu" or "cuda", resolved
    tensor_parallel_size: int = 1
    replicas: int | None = None
    num_threads: int | None = None
    weight_bytes: int = 0  # the checkpoint's size on disk: whether a second copy is cheap


@dataclass(frozen=True)
class ModelPlan:
    """One model's share of the machine: replicas, threads per worker, and each replica's devices (one per
    tensor-parallel rank: "cpu", or "cuda:N")."""

    name: str
    device: str
    tensor_parallel_size: int
    replicas: int
    num_threads: int
    devices: tuple[tuple[str, ...], ...]

    @property
    def workers(self) -> int:
        return self.tensor_parallel_size * self.replicas

    def line(self) -> str:
        tp = self.tensor_parallel_size
        shape = (
            f"{self.replicas} replica{'s' if self.replicas > 1 else ''} x {tp} rank{'s' if tp > 1 else ''}"
        )
        where = "; ".join(f"replica {r} on {','.join(d)}" for r, d in enumerate(self.devices))
        threads = f"{self.num_threads} thread{'s' if self.num_threads > 1 else ''} per worker"
        return f"{self.name}: {self.device}, {shape}, {threads}: {where}"

    def info(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "device": self.device,
            "tensor_parallel_size": self.tensor_parallel_size,
            "replicas": self.replicas,
            "num_threads": self.num_threads,
            "devices": [list(d) for d in self.devices],
        }


@dataclass(frozen=True)
class Plan:
    """Every model's share, and what it adds up to."""

    machine: Machine
    models: tuple[ModelPlan, ...]
    frontends: int = 0  # HTTP front-end processes (--http-processes N > 1), besides the engine process
    frontend_cores: int = 0  # cores kept out of the workers' share for them

    @property
    def threads(self) -> int:
        return sum(m.workers * m.num_threads for m in self.models)

    @property
    def gpus_used(self) -> int:
        return len({d for m in self.models if m.device == "cuda" for r in m.devices for d in r})

    @property
    def tokenizer_threads(self) -> int:
        return TOKENIZE_THREADS * len(self.models) * (1 + self.frontends)

    def shared_gpus(self) -> dict[str, list[str]]:
        """Each GPU that more than one replica runs on, and the models of those replicas (with repeats)."""
        on: dict[str, list[str]] = {}
        for m in self.models:
            if m.device == "cuda":
                for replica in m.devices:
                    for d in replica:
                        on.setdefault(d, []).append(m.name)
        return {d: names for d, names in on.items() if len(names) > 1}

    def lines(self) -> list[str]:
        """The plan as the server prints it at start-up."""
        m = self.machine
        memory = f", {m.memory / GIB:.1f} GiB" if m.memory else ""
        lines = [f"resource plan for {m.cores} cores, {m.gpus} GPUs{memory}:"]
        lines += ["  " + model.line() for model in self.models]
        lines += [f"  {d} shared by {', '.join(names)}" for d, names in self.shared_gpus().items()]
        workers = sum(model.workers for model in self.models)
        total = f"  in all: {workers} workers, {self.threads} threads on {m.cores} cores"
        if m.gpus or self.gpus_used:
            total += f", {self.gpus_used} of {m.gpus} GPUs"
        if self.frontends:
            total += f"; {self.frontends} HTTP processes ({self.frontend_cores} cores kept for them)"
        total += f"; {self.tokenizer_threads} tokenization threads"
        lines.append(total)
        busy = self.threads + self.frontends
        if busy > m.cores:
            what = f"{self.threads} threads" + (
                f" and {self.frontends} HTTP processes" if self.frontends else ""
            )
            lines.append(
                f"  warning: {what} on {m.cores} cores (--num-threads, --http-processes): they will contend"
            )
        return lines

    def info(self) -> dict[str, Any]:
        return {
            "cores": self.machine.cores,
            "gpus": self.machine.gpus,
            "memory_bytes": self.machine.memory,
            "gpu_memory_bytes": self.machine.gpu_memory,
            "threads": self.threads,
            "gpus_used": self.gpus_used,
            "http_processes": self.frontends,
            "frontend_cores": self.frontend_cores,
            "tokenizer_threads": self.tokenizer_threads,
            "models": [m.info() for m in self.models],
            "lines": self.lines(),
        }


def copies_fit(weight_bytes: int, memory: int | None, models: int = 1) -> bool:
    """Two copies of a checkpoint fit in an eighth of the memory, shared by `models` models."""
    return memory is not None and 2 * weight_bytes <= memory // 8 // max(1, models)


def _default_replicas(r: ModelRequest, machine: Machine, models: int) -> int:
    if r.device != "cpu" or r.tensor_parallel_size != 1:
        return 1
    share = machine.cores // models
    return 2 if share >= 2 and copies_fit(r.weight_bytes, machine.memory, models) else 1


def _threads(workers: list[int], given: list[int | None], cores: int) -> list[int]:
    """Threads per worker for each model: a given count as it is; the cores left divided between the other
    models' workers, at least 1 each, the spare cores to the first models' workers (a model's workers all
    get the same count)."""
    free = cores - sum(w * g for w, g in zip(workers, given) if g is not None)
    auto = sum(w for w, g in zip(workers, given) if g is None)
    base = max(1, free // auto) if auto else 0
    spare = free - base * auto
    out = []
    for w, g in zip(workers, given):
        if g is not None:
            out.append(g)
        elif spare >= w:
            out.append(base + 1)
            spare -= w
        else:
            out.append(base)
    return out


def _gpus(requests: Sequence[ModelRequest], replicas: list[int], machine: Machine) -> list[tuple]:
    """Each model's replicas' devices: consecutive ones while there are enough for one each, else tensor-
    parallel replicas on their own and the others first-fit on shared GPUs; PlanError when neither fits."""
    cuda = [(r, k) for r, k in zip(requests, replicas) if r.device == "cuda"]
    need = sum(r.tensor_parallel_size * k for r, k in cuda)
    if need <= machine.gpus:
        out, next_gpu = [], 0
        for r, k in zip(requests, replicas):
            tp = r.tensor_parallel_size
            if r.device == "cuda":
                out.append(tuple(tuple(f"cuda:{next_gpu + i * tp + j}" for j in range(tp)) for i in range(k)))
                next_gpu += k * tp
            else:
                out.append(tuple(("cpu",) * tp for _ in range(k)))
        return out
    parts = ", ".join(
        f"{r.name} {k} replica{'s' if k > 1 else ''} x tensor-parallel {r.tensor_parallel_size} = "
        f"{r.tensor_parallel_size * k}"
        for r, k in cuda
    )
    why = (
        f"the models need {need} GPUs ({parts}), {machine.gpus} visible: one GPU per tensor-parallel rank, "
        "or models at tensor-parallel size 1 sharing a GPU where their checkpoints fit in "
        f"{GPU_WEIGHT_SHARE:.0%} of its memory"
    )
    if machine.gpu_memory is None:
        raise PlanError(
            f"{why} (the GPUs' memory is unknown); lower --data-parallel-size or "
            "--tensor-parallel-size, or serve fewer models on CUDA"
        )
    # Tensor-parallel replicas first, on devices of their own; then the rest, first-fit in order.
    budget = int(machine.gpu_memory * GPU_WEIGHT_SHARE)
    dedicated = sum(r.tensor_parallel_size * k for r, k in cuda if r.tensor_parallel_size > 1)
    if dedicated > machine.gpus:
        raise PlanError(
            f"{why}: the tensor-parallel replicas alone need {dedicated}; lower --data-parallel-size or "
            "--tensor-parallel-size, or serve fewer models on CUDA"
        )
    free = {g: budget for g in range(dedicated, machine.gpus)}
    placed: dict[int, list[tuple[str, ...]]] = {}
    next_gpu = 0
    for i, (r, k) in enumerate(zip(requests, replicas)):
        tp = r.tensor_parallel_size
        if r.device == "cuda" and tp > 1:
            placed[i] = [tuple(f"cuda:{next_gpu + j * tp + q}" for q in range(tp)) for j in range(k)]
            next_gpu += k * tp
    for i, (r, k) in enumerate(zip(requests, replicas)):
        if r.device != "cuda" or r.tensor_parallel_size > 1:
            continue
        placed[i] = []
        mine: set[int] = set()
        for _ in range(k):  # a GPU of its own replicas' is never taken: two copies of one model gain nothing
            gpu = next((g for g, left in free.items() if g not in mine and r.weight_bytes <= left), None)
            if gpu is None:
                raise PlanError(
                    f"{why}: {r.name}'s replica {len(mine)} ({r.weight_bytes / GIB:.1f} GiB checkpoint) does "
                    f"not fit on any GPU without another of its replicas ({budget / GIB:.1f} GiB of checkpoints "
                    f"a GPU of {machine.gpu_memory / GIB:.1f} GiB); lower "
                    "--data-parallel-size or --tensor-parallel-size, or serve fewer models on CUDA"
                )
            free[gpu] -= r.weight_bytes
            mine.add(gpu)
            placed[i].append((f"cuda:{gpu}",))
    return [
        tuple(placed[i]) if r.device == "cuda" else tuple(("cpu",) * r.tensor_parallel_size for _ in range(k))
        for i, (r, k) in enumerate(zip(requests, replicas))
    ]


def plan_resources(requests: Sequence[ModelRequest], machine: Machine, frontends: int = 0) -> Plan:
    """The plan for these models on this machine, beside `frontends` HTTP front-end processes (0: the
    engine process does HTTP itself), or PlanError when their GPUs are not there."""
    if not requests:
        raise PlanError("no model to plan for")
    n = len(requests)
    replicas = [r.replicas or _default_replicas(r, machine, n) for r in requests]
    workers = [r.tensor_parallel_size * k for r, k in zip(requests, replicas)]
    devices = _gpus(requests, replicas, machine)
    # One core per front end, where the workers can still have one each.
    kept = min(frontends, max(0, machine.cores - sum(workers)))
    threads = _threads(workers, [r.num_threads for r in requests], machine.cores - kept)
    plans = [
        ModelPlan(r.name, r.device, r.tensor_parallel_size, k, t, d)
        for r, k, t, d in zip(requests, replicas, threads, devices)
    ]
    return Plan(machine, tuple(plans), frontends, kept)
