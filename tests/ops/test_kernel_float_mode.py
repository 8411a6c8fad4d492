"""Loading the CPU attention kernel leaves the process's floating-point mode alone.

The kernel is compiled with -ffast-math. Linked with it too, gcc (before 13) adds crtfastmath.o, whose
constructor turns on flush-to-zero and denormals-are-zero for the whole process at dlopen: every other float
op of a worker (torch's, numpy's) then loses its subnormals, and a test process that loaded the kernel saw
Hypothesis refuse to generate floats ("can't represent subnormal floats"). Each check runs in a fresh
interpreter, since the mode, once set, stays.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from embed_service.ops import cpu_kernels

CHECK = r"""
import sys
import numpy as np, torch
from embed_service.ops import cpu_kernels
tiny = np.float32(1e-40)  # subnormal in float32
assert tiny * np.float32(1.0) != 0, "subnormals flushed before the kernel was loaded"
kernel = {load}
assert kernel is not None, "no kernel loaded"
assert tiny * np.float32(1.0) != 0, "numpy flushes subnormals once the kernel is loaded"
assert float(torch.tensor([1e-40], dtype=torch.float32).mul(1.0)) != 0, "torch flushes subnormals"
print("ok", kernel.lib._name)
"""


def run(load: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", CHECK.replace("{load}", load)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def compiler() -> str:
    found = cpu_kernels.find_compiler()
    if found is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    return found


def test_the_kernel_built_for_this_cpu_keeps_subnormals(compiler, tmp_path):
    cache = tmp_path / "cache"
    r = run(
        "cpu_kernels.attention_kernel()", {"EMBED_KERNEL_CACHE": str(cache), "EMBED_PREBUILT_KERNELS": "0"}
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_the_prebuilt_kernels_keep_subnormals(compiler, tmp_path):
    out = tmp_path / "prebuilt"
    cpu_kernels.prebuild(out, compiler)
    flags = cpu_kernels.cpu_flags()
    runnable = [name for name, _, needs in cpu_kernels.VARIANTS if set(needs) <= flags]
    if not runnable:
        pytest.skip("this CPU runs none of the prebuilt levels")
    for name in runnable:
        lib = out / f"varlen_attention-{name}.so"
        r = run(
            f"cpu_kernels._load(__import__('os').open({str(lib)!r}, 0), __import__('pathlib').Path({str(lib)!r}))"
        )
        assert r.returncode == 0 and r.stdout.startswith("ok"), (name, r.stdout + r.stderr)
