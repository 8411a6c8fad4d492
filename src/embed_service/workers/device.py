"""Resolve ``--device`` and ``--dtype`` to what the hardware offers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from embed_service.plan import Machine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmul in hardware."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is visible")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """--dtype for the workers. On CUDA ``auto`` stays ``auto``: each worker decides from its own GPU
    (cuda_dtype_for), and the server process creates no CUDA context."""
    if dtype != "auto" or device == "cuda":
        return dtype
    return "bfloat16" if cpu_has_bf16() else "float32"


def cuda_dtype_for(capability: tuple[int, int]) -> str:
    """``--dtype auto`` on a GPU of this compute capability: bfloat16 from Ampere (8.0) on, float16 before.

    Not torch.cuda.is_bf16_supported(): it says True on Volta and Turing (V100, T4), which emulate bfloat16
    at a fraction of their float16 speed.
    """
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


# --- what the container grants ---------------------------------------------------------------------------
# A container sees the host's cores and memory in os.cpu_count() and /proc/meminfo; what it may use is its
# cgroup's quota. cgroup v2 (one hierarchy, cpu.max / memory.max) and v1 (cpu/cpu.cfs_quota_us,
# memory/memory.limit_in_bytes). A limit can sit on the process's cgroup or any ancestor: the smallest counts.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_V1 = 1 << 62  # v1 writes "no limit" as the largest page-aligned int64


def _cgroup_dirs(controller: str) -> list[Path]:
    """The process's cgroup folder for a controller and its ancestors up to the mount (innermost first)."""
    v2 = (CGROUP_ROOT / "cgroup.controllers").is_file()
    mount = CGROUP_ROOT if v2 else CGROUP_ROOT / controller
    if not mount.is_dir():
        return []
    relative = "/"
    try:
        for line in PROC_CGROUP.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (v2 and controllers == "") or (not v2 and controller in controllers.split(",")):
                relative = path
    except (OSError, ValueError):
        pass
    here = mount / relative.lstrip("/")
    if not here.is_dir():  # a v1 container without a cgroup namespace: its own cgroup is mounted as the root
        here = mount
    dirs = [here, *here.parents]
    return [d for d in dirs if d == mount or mount in d.parents]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit() -> float | None:
    """CPUs the cgroup quota allows (``cpu.max`` 150000 100000 -> 1.5), or None without a quota."""
    limits = []
    for d in _cgroup_dirs("cpu"):
        if (v2 := _read(d / "cpu.max")) is not None:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
        elif (quota_v1 := _read(d / "cpu.cfs_quota_us")) is not None and int(quota_v1) > 0:
            period_v1 = _read(d / "cpu.cfs_period_us")
            if period_v1:
                limits.append(int(quota_v1) / int(period_v1))
    return min(limits, default=None)


def cgroup_memory_limit() -> int | None:
    """Bytes the cgroup may use (``memory.max``), or None without a limit."""
    limits = []
    for d in _cgroup_dirs("memory"):
        value = _read(d / "memory.max")
        if value is None:
            value = _read(d / "memory.limit_in_bytes")
        if value and value != "max" and int(value) < UNLIMITED_V1:
            limits.append(int(value))
    return min(limits, default=None)


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup CPU quota (whole CPUs, at least 1).

    Rounded down: threads past the quota only get the process throttled for the rest of each period.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def available_memory() -> int | None:
    """Bytes of memory this process may use: the machine's, capped by the cgroup memory limit."""
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    limit = cgroup_memory_limit()
    if limit is not None:
        memory = limit if memory is None else min(memory, limit)
    return memory


# --- the resource plan's devices (plan.py) ---------------------------------------------------------------


def rank_device(device: str, devices: tuple[str, ...], rank: int) -> torch.device:
    """The device a worker of `rank` runs on: its replica's from the resource plan (plan.py), else (no plan)
    ``cuda:rank`` on CUDA and the CPU elsewhere."""
    if devices:
        return torch.device(devices[rank])
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def this_machine(cuda: bool) -> Machine:
    """The cores, memory and (when a model runs on CUDA) the visible GPUs, for the resource plan."""
    return Machine(available_cores(), torch.cuda.device_count() if cuda else 0, available_memory())
