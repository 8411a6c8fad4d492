"""The project's compiled CPU kernels: built once per machine with the system C compiler, loaded with ctypes.

Optional by design. Where no compiler is found, the build fails, or ``EMBED_CPU_KERNELS=0`` is set,
``attention_kernel()`` returns None and callers use torch's own kernels; the results are the same to
float32 rounding. The shared library lands in ``$EMBED_KERNEL_CACHE`` (default
``~/.cache/embed-service/kernels``), named by a hash of the source, the flags and the CPU, so a changed
source or another machine builds afresh; concurrent builders (one per worker) serialize on a file lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("embed_service.kernels")

SOURCE = Path(__file__).parent / "csrc" / "varlen_attention.c"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _cache_dir() -> Path:
    env = os.environ.get("EMBED_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embed-service" / "kernels"


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join([compiler, *FLAGS]).encode() + _cpu_identity().encode()
    ).hexdigest()
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"varlen_attention-{key[:16]}.so"
    if lib.exists():
        return lib
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another worker built it while this one waited
            return lib
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


class AttentionKernel:
    """ctypes front of ``varlen_attention`` in csrc/varlen_attention.c."""

    DTYPES = {torch.float32: 0, torch.bfloat16: 1}

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        fn = self.lib.varlen_attention
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i32, i32, i32, i32, i32]
        fn.argtypes += [i64] * 8 + [ctypes.c_float, i32, i32, i32]
        fn.restype = i32
        self.fn = fn

    def supports(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return (
            q.device.type == "cpu"
            and q.dtype in self.DTYPES
            and k.dtype == q.dtype == v.dtype
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        causal: bool,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) with unit stride in D -> (T, Hq, D) contiguous."""
        out = torch.empty(q.shape, dtype=q.dtype)
        cu = (
            cu_seqlens if cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() else cu_seqlens.int()
        )
        rc = self.fn(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            self.DTYPES[q.dtype],
            cu.data_ptr(),
            cu.numel() - 1,
            max_len,
            q.shape[1],
            k.shape[1],
            q.shape[2],
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            scale,
            int(causal),
            -1 if window is None else window,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("varlen_attention: no memory for its scratch space")
        return out


@cache
def attention_kernel() -> AttentionKernel | None:
    """The compiled kernel, or None (logged once) where it cannot be had."""
    if os.environ.get("EMBED_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: attention runs on torch's kernels")
        return None
    try:
        return AttentionKernel(_build(compiler))
    except subprocess.CalledProcessError as exc:
        log.warning("building the CPU attention kernel failed; using torch's kernels:\n%s", exc.stderr)
    except Exception as exc:  # no cache dir, a loader error: never fatal
        log.warning("CPU attention kernel unavailable (%s); using torch's kernels", exc)
    return None
