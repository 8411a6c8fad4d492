"""The project's compiled CPU kernels: built once per machine with the system C compiler, loaded with ctypes.

Optional by design. Where no compiler is found, the build fails, or ``EMBED_CPU_KERNELS=0`` is set,
``attention_kernel()`` returns None and callers use torch's own kernels; the results are the same to
float32 rounding. The shared library lands in ``$EMBED_KERNEL_CACHE`` (default
``~/.cache/embed-service/kernels``), named by a hash of the source, the flags and the CPU, so a changed
source or another machine builds afresh; concurrent builders (one per worker) serialize on a file lock.

Whoever can write that directory chooses the code the workers run, so only what this code built is
loaded: the directory is created 0700, and it and its files must belong to this user and be writable by
no one else; the build records the library's sha256 beside it, and the library is loaded only through a
descriptor whose contents match that digest. A library without a digest is rebuilt in place; anything
else (a foreign or group/world-writable directory or file, a digest that does not match) is refused with
one warning, and attention runs on torch's kernels.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
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


class UntrustedCacheError(RuntimeError):
    """The kernel cache, or a file in it, could have been written by someone else: nothing is loaded."""


def _check_private(st: os.stat_result, what: str) -> None:
    """Owned by this user and writable by no one else, else UntrustedCacheError."""
    if st.st_uid != os.getuid():
        raise UntrustedCacheError(f"{what} is owned by uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCacheError(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        )


def _private_dir() -> Path:
    """The cache directory, created 0700; an existing one must be this user's and not writable by others."""
    out_dir = _cache_dir()
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = out_dir.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedCacheError(f"{out_dir} is not a directory")
    _check_private(st, str(out_dir))
    return out_dir


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()


def _open_verified(lib: Path) -> int | None:
    """An open descriptor on `lib` once it matches the digest recorded when it was built; None when there
    is nothing to load (no library, or no digest: not built by this code). UntrustedCacheError when either
    file is not private to this user or the digest differs: a tampered or damaged library is never loaded.
    The descriptor, not the name, is what gets loaded, so the file cannot change between check and load.
    """
    digest_file = lib.with_name(lib.name + ".sha256")
    try:
        fd = os.open(lib, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            with open(digest_file, encoding="ascii", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
                _check_private(os.fstat(f.fileno()), str(digest_file))
                recorded = f.read().strip()
        except FileNotFoundError:
            os.close(fd)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedCacheError(f"{lib} is not a regular file")
        _check_private(st, str(lib))
        if _sha256(fd) != recorded:
            raise UntrustedCacheError(f"{lib} does not match the digest recorded when it was built")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _build(compiler: str, lib: Path) -> None:
    """Compile into a temporary file beside `lib`, record its digest, then move both into place."""
    out_dir = lib.parent
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    digest_tmp = tmp + ".sha256"
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.chmod(tmp, 0o700)  # whatever the umask: the check on loading wants it private
        with open(tmp, "rb") as f:
            digest = _sha256(f.fileno())
        with open(os.open(digest_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(digest + "\n")
        # The digest first: a library in place always has its digest beside it.
        os.replace(digest_tmp, lib.with_name(lib.name + ".sha256"))
        os.replace(tmp, lib)
    finally:
        for leftover in (tmp, digest_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)


def library_name(compiler: str) -> str:
    """The library's file name: a hash of the source, the compiler and its flags, and the CPU."""
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode() + _cpu_identity().encode()
    ).hexdigest()
    return f"varlen_attention-{key[:16]}.so"


def _kernel_fd(compiler: str) -> tuple[int, Path]:
    """An open, verified descriptor on the kernel library and its path, built first when there is none."""
    out_dir = _private_dir()
    lib = out_dir / library_name(compiler)
    # Concurrent workers serialize here: one builds, the others then verify what it built.
    with open(os.open(out_dir / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fd = _open_verified(lib)
        if fd is None:
            _build(compiler, lib)
            fd = _open_verified(lib)
        if fd is None:
            raise UntrustedCacheError(f"{lib} vanished after it was built")
        return fd, lib


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


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def attention_kernel() -> AttentionKernel | None:
    """The compiled kernel, or None (logged once) where it cannot be had."""
    if os.environ.get("EMBED_CPU_KERNELS", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found: attention runs on torch's kernels")
        return None
    try:
        fd, lib = _kernel_fd(compiler)
        try:
            # Through /proc (Linux), the very file that was verified; elsewhere by its name, in a directory
            # no one else can write. dlopen keeps its own mapping, so the descriptor can close after.
            proc = Path(f"/proc/self/fd/{fd}")
            return AttentionKernel(proc if proc.exists() else lib)
        finally:
            os.close(fd)
    except UntrustedCacheError as exc:
        log.warning("CPU attention kernel not loaded: %s; using torch's kernels", exc)
    except subprocess.CalledProcessError as exc:
        log.warning("building the CPU attention kernel failed; using torch's kernels:\n%s", exc.stderr)
    except Exception as exc:  # no cache dir, a loader error: never fatal
        log.warning("CPU attention kernel unavailable (%s); using torch's kernels", exc)
    return None
