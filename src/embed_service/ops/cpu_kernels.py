"""The project's compiled CPU kernels, loaded with ctypes: prebuilt per x86-64 level, or built on the machine.

Optional by design. Where neither a prebuilt kernel fits nor a compiler builds one, or with
``EMBED_CPU_KERNELS=0``, ``attention_kernel()`` returns None and callers use torch's own kernels; the
results are the same to float32 rounding.

Prebuilt (the container image): ``python -m embed_service.ops.cpu_kernels prebuild`` compiles one library
per instruction-set level (``VARIANTS``: x86-64-v3, x86-64-v4, x86-64-v4 with AVX512-BF16, x86-64-v4 with the
AMX tiles) into ``$EMBED_PREBUILT_KERNELS`` (default: ``prebuilt/`` beside this file) with a manifest of their
digests, and at run time the best level the CPU's flags allow is loaded from there: no compiler and no
writable, executable cache needed. x86-64-v4 runs as fast as ``-march=native`` on AVX-512 CPUs.

Built on the machine (a checkout or a venv install, when no prebuilt one fits): with the system C compiler
and ``-march=native``, into ``$EMBED_KERNEL_CACHE`` (default ``~/.cache/embed-service/kernels``), named by
a hash of the source, the flags and the CPU, so a changed source or another machine builds afresh;
concurrent builders (one per worker) serialize on a file lock. A cache on a filesystem mounted
``noexec`` (Docker's ``--tmpfs`` is, unless given ``exec``) cannot load what it holds: that is said in one
warning and nothing is built there.

Whoever can write that directory chooses the code the workers run, so only what this code built is
loaded: the directory is created 0700, and it and its files must belong to this user and be writable by
no one else; the build records the library's sha256 beside it, and the library is loaded only through a
descriptor whose contents match that digest. A library without a digest is rebuilt in place; anything
else (a foreign or group/world-writable directory or file, a digest that does not match) is refused with
one warning, and attention runs on torch's kernels. The prebuilt libraries are trusted on the same terms,
except that root may own them (an image's files are root's): not writable by group or others, and
matching the digests of their manifest, which must name the digest of this very source.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("embed_service.kernels")

CSRC = Path(__file__).parent / "csrc"
# One library: attention and linear layers, a decoder's elementwise ops, and the bf16 conversions both include.
SOURCES, HEADERS = (CSRC / "varlen_attention.c", CSRC / "decoder_ops.c"), (CSRC / "bf16.h",)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC"]
COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked apart from the compile, without -ffast-math: linking a shared library with it (gcc before 13) adds
# crtfastmath.o, whose constructor sets flush-to-zero and denormals-are-zero for the whole process that
# loads the kernel, so every other float op there (torch's, numpy's) would lose its subnormals.
LINK_FLAGS = ["-shared", "-fopenmp"]

# /proc/cpuinfo's names for the x86-64 psABI levels (v3: AVX2, FMA, BMI, F16C, LZCNT, MOVBE, XSAVE).
X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
X86_64_V4 = (*X86_64_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# The prebuilt set, best first: (name, compiler flags, CPU flags it needs). The AMX variant names its
# extensions one by one, not -march=sapphirerapids, so that it uses nothing else a CPU with AMX may lack.
VARIANTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "x86-64-v4-amx",
        ("-march=x86-64-v4", "-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-mprefer-vector-width=512"),
        (*X86_64_V4, "amx_tile", "amx_bf16", "avx512_bf16"),
    ),
    (  # AVX512-BF16 without AMX: AMD Zen 4 and later, Intel Cooper Lake (bf16 attention as dot products)
        "x86-64-v4-bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"),
        (*X86_64_V4, "avx512_bf16"),
    ),
    ("x86-64-v4", ("-march=x86-64-v4", "-mprefer-vector-width=512"), X86_64_V4),
    ("x86-64-v3", ("-march=x86-64-v3",), X86_64_V3),
)
MANIFEST = "manifest.json"


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def prebuilt_dir() -> Path:
    env = os.environ.get("EMBED_PREBUILT_KERNELS")
    return Path(env) if env else Path(__file__).parent / "prebuilt"


def _cache_dir() -> Path:
    env = os.environ.get("EMBED_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embed-service" / "kernels"


class UntrustedCacheError(RuntimeError):
    """The kernel cache, or a file in it, could have been written by someone else: nothing is loaded."""


def _check_private(st: os.stat_result, what: str, root_too: bool = False) -> None:
    """Owned by this user (or root, with `root_too`) and writable by no one else, else UntrustedCacheError."""
    if st.st_uid != os.getuid() and not (root_too and st.st_uid == 0):
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


def noexec_mount(path: Path) -> bool:
    """Whether `path` (or, before it exists, its nearest existing parent) is on a filesystem mounted noexec:
    a shared library there cannot be mapped ("failed to map segment from shared object")."""
    for candidate in (path, *path.parents):
        try:
            return bool(os.statvfs(candidate).f_flag & os.ST_NOEXEC)
        except FileNotFoundError:
            continue
    return False


def source_digest() -> str:
    """Of every source and header, each with its name."""
    return hashlib.sha256(
        b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in (*SOURCES, *HEADERS))
    ).hexdigest()


def prebuild(out_dir: Path, compiler: str) -> dict[str, dict[str, str]]:
    """Compile every variant into `out_dir` and write the manifest (their digests and the source's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict[str, str]] = {}
    for name, flags, _needs in VARIANTS:
        lib = out_dir / f"varlen_attention-{name}.so"
        compile_library(compiler, [*flags, *COMMON_FLAGS], lib, timeout=300)
        os.chmod(lib, 0o755)
        with open(lib, "rb") as f:
            manifest[name] = {"file": lib.name, "sha256": _sha256(f.fileno()), "flags": " ".join(flags)}
    text = json.dumps({"source_sha256": source_digest(), "variants": manifest}, indent=1) + "\n"
    (out_dir / MANIFEST).write_text(text)
    return manifest


def _prebuilt_fd() -> tuple[int, str, Path] | None:
    """An open, verified descriptor on the best prebuilt variant this CPU runs, its name and path; None when there
    is no prebuilt set (or none this CPU runs). UntrustedCacheError as for the cache."""
    directory = prebuilt_dir()
    try:
        with open(directory / MANIFEST, opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
            _check_private(os.stat(directory), str(directory), root_too=True)
            _check_private(os.fstat(f.fileno()), f"{directory / MANIFEST}", root_too=True)
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    if manifest.get("source_sha256") != source_digest():
        raise UntrustedCacheError(f"the prebuilt kernels in {directory} were built from another source")
    flags = cpu_flags()
    for name, _flags, needs in VARIANTS:
        entry = manifest["variants"].get(name)
        if entry is None or not set(needs) <= flags:
            continue
        lib = directory / Path(entry["file"]).name
        fd = os.open(lib, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UntrustedCacheError(f"{lib} is not a regular file")
            _check_private(st, str(lib), root_too=True)
            if _sha256(fd) != entry["sha256"]:
                raise UntrustedCacheError(f"{lib} does not match the digest in {MANIFEST}")
        except BaseException:
            os.close(fd)
            raise
        return fd, name, lib
    return None


def compile_library(compiler: str, flags: list[str], lib: Path, timeout: float) -> None:
    """SOURCES compiled with `flags` to objects beside `lib`, then linked into `lib` with LINK_FLAGS."""
    objs = [lib.with_name(f"{lib.name}.{i}.o") for i in range(len(SOURCES))]
    cmds = [[compiler, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
    try:
        for cmd in [*cmds, [compiler, *LINK_FLAGS, *map(str, objs), "-o", str(lib), "-lm"]]:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
    finally:
        for obj in objs:
            obj.unlink(missing_ok=True)


def _build(compiler: str, lib: Path) -> None:
    """Compile into a temporary file beside `lib`, record its digest, then move both into place."""
    out_dir = lib.parent
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    digest_tmp = tmp + ".sha256"
    try:
        compile_library(compiler, FLAGS, Path(tmp), timeout=120)
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
        source_digest().encode()
        + " ".join([compiler, *FLAGS, *LINK_FLAGS]).encode()
        + _cpu_identity().encode()
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
        linear = self.lib.small_linear
        linear.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32]
        linear.restype = i32
        self.lib.small_linear_rows.restype = i32
        self._small_linear = linear
        self._path = self.lib.attention_path
        self._path.argtypes = [i32, i32]
        self._path.restype = i32

    PATHS = {2: "amx", 1: "avx512-bf16", 0: "float32"}

    def path(self, dtype: torch.dtype, head_size: int) -> str:
        """The products' path for this dtype and head size: "amx" (tiles), "avx512-bf16" (vdpbf16ps) or
        "float32" (FMAs; every float32 call, and bf16 where neither runs)."""
        return self.PATHS[self._path(int(dtype == torch.bfloat16), head_size)]

    def small_linear_rows(self) -> int:
        """The most rows `small_linear` takes here: 16 on the AMX tiles (built with AMX, the tiles permitted,
        EMBED_CPU_AMX not 0), else 4,096 as AVX512-BF16 dot products (built with them, EMBED_CPU_BF16_DOT not
        0), else 0: it does not run."""
        return int(self.lib.small_linear_rows())

    def small_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, gelu: bool
    ) -> torch.Tensor | None:
        """x (M <= small_linear_rows(), K) bf16 contiguous @ W.T + bias, then exact GELU with `gelu`, on the
        tile unit or as dot products, W packed by layers.linear.pack_small_linear; bf16 out. None where the
        kernel declines (then the caller's path runs)."""
        rows, k = x.shape
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        rc = self._small_linear(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            int(gelu),
            rows,
            k,
            out_features,
            torch.get_num_threads(),
        )
        return out if rc == 0 else None

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


def _load(fd: int, lib: Path) -> AttentionKernel:
    try:
        # Through /proc (Linux), the very file that was verified; elsewhere by its name, in a directory
        # no one else can write. dlopen keeps its own mapping, so the descriptor can close after.
        proc = Path(f"/proc/self/fd/{fd}")
        return AttentionKernel(proc if proc.exists() else lib)
    finally:
        os.close(fd)


def _prebuilt_kernel() -> AttentionKernel | None:
    try:
        found = _prebuilt_fd()
        if found is None:
            return None
        fd, name, lib = found
        kernel = _load(fd, lib)
    except Exception as exc:  # refused, or a loader error: the machine's own build may still do
        log.warning("prebuilt CPU attention kernel not loaded: %s", exc)
        return None
    log.info("CPU attention kernel: prebuilt %s (%s)", name, prebuilt_dir())
    return kernel


@cache
def attention_kernel() -> AttentionKernel | None:
    """The compiled kernel, or None (logged once) where it cannot be had: prebuilt for this CPU's level
    when there is a prebuilt set, else built here."""
    if os.environ.get("EMBED_CPU_KERNELS", "1") == "0":
        return None
    prebuilt = _prebuilt_kernel()
    if prebuilt is not None:
        return prebuilt
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found and no prebuilt kernel for this CPU: attention runs on torch's kernels")
        return None
    if noexec_mount(_cache_dir()):
        log.warning(
            "CPU attention kernel not built: the kernel cache %s is on a filesystem mounted noexec, where no "
            "library can be loaded; mount it with exec (docker run --tmpfs %s:exec,...) or point "
            "EMBED_KERNEL_CACHE elsewhere; using torch's kernels",
            _cache_dir(),
            _cache_dir().parent,
        )
        return None
    try:
        fd, lib = _kernel_fd(compiler)
        kernel = _load(fd, lib)
        log.info("CPU attention kernel: built for this CPU (-march=native) in %s", lib.parent)
        return kernel
    except UntrustedCacheError as exc:
        log.warning("CPU attention kernel not loaded: %s; using torch's kernels", exc)
    except subprocess.CalledProcessError as exc:
        log.warning("building the CPU attention kernel failed; using torch's kernels:\n%s", exc.stderr)
    except Exception as exc:  # no cache dir, a loader error: never fatal
        log.warning("CPU attention kernel unavailable (%s); using torch's kernels", exc)
    return None


def main(argv: list[str]) -> int:
    """``python -m embed_service.ops.cpu_kernels prebuild [DIR]``: the image build's step."""
    if len(argv) not in (1, 2) or argv[0] != "prebuild":
        print("usage: python -m embed_service.ops.cpu_kernels prebuild [DIR]", file=sys.stderr)
        return 2
    compiler = find_compiler()
    if compiler is None:
        print("no C compiler (cc, gcc or $CC)", file=sys.stderr)
        return 1
    out_dir = Path(argv[1]) if len(argv) == 2 else prebuilt_dir()
    for name, entry in prebuild(out_dir, compiler).items():
        print(f"{out_dir / entry['file']}  {name}  {entry['flags']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
