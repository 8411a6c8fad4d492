"""The CPU attention kernel prebuilt per x86-64 level (what the container image ships): the best level the
CPU runs is loaded without a compiler and without a writable, executable cache; each level computes the
reference attention; a tampered or stale set is refused; a kernel cache on a noexec mount is said so."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embed_service.ops import cpu_kernels
from embed_service.ops.attention import varlen_attention_reference
from tests.ops.test_attention import make

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64",
    reason="the prebuilt set is x86-64 levels; elsewhere the kernel builds natively",
)


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the prebuilt set with (the image build has one)")
    out = tmp_path_factory.mktemp("prebuilt")
    cpu_kernels.prebuild(out, compiler)
    return out


@pytest.fixture
def no_compiler(monkeypatch, tmp_path) -> Iterator[None]:
    """As in the image: no cc, gcc or $CC, and a kernel cache nobody could build into."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("EMBED_CPU_KERNELS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("EMBED_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.attention_kernel.cache_clear()
    yield
    cpu_kernels.attention_kernel.cache_clear()


def runs_here(needs: tuple[str, ...]) -> bool:
    flags = (Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0]).split()
    return set(needs) <= set(flags)


def check_against_reference(kernel: cpu_kernels.AttentionKernel) -> None:
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        q, k, v, batch = make([5, 17, 1, 33, 64], 6, 2, 64, dtype)
        got = kernel(q, k, v, batch.cu_seqlens, batch.max_seqlen, False, 64**-0.5, None)
        want = varlen_attention_reference(q.float(), k.float(), v.float(), batch.cu_seqlens, causal=False)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", cpu_kernels.VARIANTS, ids=[v[0] for v in cpu_kernels.VARIANTS])
def test_each_level_computes_the_reference_attention(prebuilt, variant):
    name, _flags, needs = variant
    if not runs_here(needs):
        pytest.skip(f"this CPU lacks {sorted(set(needs) - set(cpu_kernels.cpu_flags()))} for {name}")
    check_against_reference(cpu_kernels.AttentionKernel(prebuilt / f"varlen_attention-{name}.so"))


def test_the_best_level_loads_without_a_compiler(prebuilt, no_compiler, monkeypatch, caplog):
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(prebuilt))
    assert cpu_kernels.find_compiler() is None
    with caplog.at_level(logging.INFO, logger="embed_service.kernels"):
        kernel = cpu_kernels.attention_kernel()
    assert kernel is not None
    best = next(name for name, _f, needs in cpu_kernels.VARIANTS if runs_here(needs))
    assert f"prebuilt {best}" in caplog.text
    check_against_reference(kernel)


def test_a_tampered_prebuilt_library_is_refused(prebuilt, no_compiler, tmp_path, monkeypatch, caplog):
    copy = tmp_path / "tampered"
    shutil.copytree(prebuilt, copy)
    for lib in copy.glob("*.so"):
        data = bytearray(lib.read_bytes())
        data[-1] ^= 1
        lib.write_bytes(bytes(data))
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(copy))
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert cpu_kernels.attention_kernel() is None
    assert "does not match the digest" in caplog.text


def test_a_set_built_from_another_source_is_refused(prebuilt, no_compiler, tmp_path, monkeypatch, caplog):
    copy = tmp_path / "stale"
    shutil.copytree(prebuilt, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source_sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(copy))
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert cpu_kernels.attention_kernel() is None
    assert "built from another source" in caplog.text


def test_a_group_writable_prebuilt_directory_is_refused(prebuilt, no_compiler, tmp_path, monkeypatch, caplog):
    copy = tmp_path / "writable-by-all"
    shutil.copytree(prebuilt, copy)
    copy.chmod(0o777)
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(copy))
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert cpu_kernels.attention_kernel() is None
    assert "writable by group or others" in caplog.text


@pytest.fixture
def noexec_dir(tmp_path) -> Iterator[Path]:
    """A tmpfs mounted noexec, as Docker mounts --tmpfs without `exec`."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a noexec tmpfs needs root")
    where = tmp_path / "noexec"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=16m", "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"this container may not mount a tmpfs: {r.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_noexec_kernel_cache_is_said_so_and_nothing_is_built(noexec_dir, tmp_path, monkeypatch, caplog):
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler: nothing would be built anywhere")
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{tmp_path}/cc-runs"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("EMBED_KERNEL_CACHE", str(noexec_dir / "kernels"))
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(tmp_path / "no-prebuilt-set"))
    monkeypatch.delenv("EMBED_CPU_KERNELS", raising=False)
    cpu_kernels.attention_kernel.cache_clear()
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert cpu_kernels.attention_kernel() is None
    cpu_kernels.attention_kernel.cache_clear()
    assert not (tmp_path / "cc-runs").exists()
    assert "noexec" in caplog.text and ":exec" in caplog.text and str(noexec_dir / "kernels") in caplog.text
    assert len(caplog.records) == 1


def test_with_the_prebuilt_set_a_noexec_cache_does_not_matter(prebuilt, noexec_dir, no_compiler, monkeypatch):
    monkeypatch.setenv("EMBED_KERNEL_CACHE", str(noexec_dir / "kernels"))
    monkeypatch.setenv("EMBED_PREBUILT_KERNELS", str(prebuilt))
    assert cpu_kernels.attention_kernel() is not None
