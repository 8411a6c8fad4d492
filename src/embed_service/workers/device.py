"""Resolve ``--device`` and ``--dtype`` to what the hardware offers."""

from __future__ import annotations

import os

import torch

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


def check_world_size(device: str, world_size: int) -> None:
    """One GPU per rank on CUDA; on the CPU the ranks share the cores (see --num-threads)."""
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel-size {world_size} needs {world_size} GPUs, "
            f"{torch.cuda.device_count()} visible"
        )


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
