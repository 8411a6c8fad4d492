"""The resource plan: how many replicas each served model runs, how many CPU threads each worker gets, and
which GPUs each replica's ranks run on, decided once for the whole machine before any worker starts.

A pure function of what the models ask (device, tensor-parallel size, replicas, threads, checkpoint size)
and what the machine has (cores, GPUs, memory), so that it is tested for any machine without one:

- GPUs: the CUDA models' replicas take consecutive devices in the order the models are given, replica r of
  a model at tensor-parallel size tp on its own tp devices (one model alone: cuda:r*tp .. r*tp+tp-1). No
  device is shared by two replicas or two models; a plan that needs more devices than are visible is
  refused, naming what each model needs.
- CPU threads: every worker process of every model counts (a GPU worker too: its CPU-side work and kernel
  launches); the cores are divided between them as evenly as whole threads allow, the workers of the
  models given first taking the spare cores. A model's own --num-threads is kept and its threads are
  taken from the cores first.
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


class PlanError(ValueError):
    """The models cannot run on this machine as asked; the message says what each needs and what is there."""


@dataclass(frozen=True)
class Machine:
    """What the server may use: cores (affinity and cgroup quota), visible GPUs, memory (bytes, or None)."""

    cores: int
    gpus: int = 0
    memory: int | None = None


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

    @property
    def threads(self) -> int:
        return sum(m.workers * m.num_threads for m in self.models)

    @property
    def gpus_used(self) -> int:
        return sum(m.workers for m in self.models if m.device == "cuda")

    def lines(self) -> list[str]:
        """The plan as the server prints it at start-up."""
        m = self.machine
        memory = f", {m.memory / GIB:.1f} GiB" if m.memory else ""
        lines = [f"resource plan for {m.cores} cores, {m.gpus} GPUs{memory}:"]
        lines += ["  " + model.line() for model in self.models]
        workers = sum(model.workers for model in self.models)
        total = f"  in all: {workers} workers, {self.threads} threads on {m.cores} cores"
        if m.gpus or self.gpus_used:
            total += f", {self.gpus_used} of {m.gpus} GPUs"
        lines.append(total)
        if self.threads > m.cores:
            lines.append(
                f"  warning: {self.threads} threads on {m.cores} cores (--num-threads): they will contend"
            )
        return lines

    def info(self) -> dict[str, Any]:
        return {
            "cores": self.machine.cores,
            "gpus": self.machine.gpus,
            "memory_bytes": self.machine.memory,
            "threads": self.threads,
            "gpus_used": self.gpus_used,
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


def plan_resources(requests: Sequence[ModelRequest], machine: Machine) -> Plan:
    """The plan for these models on this machine, or PlanError when their GPUs are not there."""
    if not requests:
        raise PlanError("no model to plan for")
    n = len(requests)
    replicas = [r.replicas or _default_replicas(r, machine, n) for r in requests]
    workers = [r.tensor_parallel_size * k for r, k in zip(requests, replicas)]
    need = sum(w for r, w in zip(requests, workers) if r.device == "cuda")
    if need > machine.gpus:
        parts = ", ".join(
            f"{r.name} {k} replica{'s' if k > 1 else ''} x tensor-parallel {r.tensor_parallel_size} = {w}"
            for r, k, w in zip(requests, replicas, workers)
            if r.device == "cuda"
        )
        raise PlanError(
            f"the models need {need} GPUs ({parts}), {machine.gpus} visible: one GPU per tensor-parallel "
            "rank of every replica, never shared; lower --data-parallel-size or --tensor-parallel-size, "
            "or serve fewer models on CUDA"
        )
    threads = _threads(workers, [r.num_threads for r in requests], machine.cores)
    plans, next_gpu = [], 0
    for r, k, t in zip(requests, replicas, threads):
        tp = r.tensor_parallel_size
        if r.device == "cuda":
            devices = tuple(tuple(f"cuda:{next_gpu + i * tp + j}" for j in range(tp)) for i in range(k))
            next_gpu += k * tp
        else:
            devices = tuple(("cpu",) * tp for _ in range(k))
        plans.append(ModelPlan(r.name, r.device, tp, k, t, devices))
    return Plan(machine, tuple(plans))
