"""The CPU kernel cache loads only the library this code built: a planted or tampered file with the
expected name is never loaded, and a cache directory others can write is refused (torch's kernels run)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from embed_service.ops import cpu_kernels

# A library that announces itself when loaded: its constructor runs at dlopen.
PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
int varlen_attention(void) { return 0; }
"""


@pytest.fixture
def compiler(tmp_path) -> str:
    """The system compiler behind a wrapper that counts its runs (the wrapper's path is the compiler the
    cache keys on, so the same wrapper finds the same library)."""
    real = cpu_kernels.find_compiler()
    if real is None:
        pytest.skip("no C compiler: the kernel is never built, so there is no cache to check")
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/cc-runs"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def cache(tmp_path, monkeypatch, compiler) -> Iterator[Path]:
    directory = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("EMBED_KERNEL_CACHE", str(directory))
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PLANTED_MARKER", str(tmp_path / "planted-ran"))
    monkeypatch.delenv("EMBED_CPU_KERNELS", raising=False)
    cpu_kernels.attention_kernel.cache_clear()
    yield directory
    cpu_kernels.attention_kernel.cache_clear()


def compiler_runs(tmp_path: Path) -> int:
    """How many times the kernel was built (a build compiles each source with -c, then links them)."""
    runs = tmp_path / "cc-runs"
    lines = runs.read_text().splitlines() if runs.exists() else []
    return sum(" -c " not in f" {line} " for line in lines)


def plant(directory: Path, compiler: str, tmp_path: Path) -> Path:
    """Someone else's library under the name the cache looks for."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    lib = directory / cpu_kernels.library_name(compiler)
    real = shutil.which("cc") or shutil.which("gcc") or "cc"  # not the counting wrapper
    subprocess.run([real, "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    lib.chmod(0o700)
    return lib


def load() -> cpu_kernels.AttentionKernel | None:
    cpu_kernels.attention_kernel.cache_clear()
    return cpu_kernels.attention_kernel()


def test_built_once_then_reused_from_a_private_directory(cache, tmp_path, compiler):
    start = time.perf_counter()
    assert load() is not None
    built_s = time.perf_counter() - start
    start = time.perf_counter()
    assert load() is not None
    reused_s = time.perf_counter() - start
    print(
        f"\nkernel: built and loaded in {built_s:.2f}s, verified and loaded again in {reused_s * 1000:.1f} ms"
    )
    assert compiler_runs(tmp_path) == 1  # the second load compiled nothing (the event; its time is printed)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    lib = cache / cpu_kernels.library_name(compiler)
    recorded = (cache / (lib.name + ".sha256")).read_text().strip()
    assert recorded == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert not stat.S_IMODE(lib.stat().st_mode) & 0o077


def test_a_planted_library_without_a_digest_is_never_loaded(cache, tmp_path, compiler):
    planted = plant(cache, compiler, tmp_path)
    planted_digest = hashlib.sha256(planted.read_bytes()).hexdigest()
    assert load() is not None  # rebuilt over it
    assert not (tmp_path / "planted-ran").exists()
    assert compiler_runs(tmp_path) == 1
    assert hashlib.sha256(planted.read_bytes()).hexdigest() != planted_digest


def test_a_library_that_does_not_match_its_digest_is_refused(cache, tmp_path, compiler, caplog):
    assert load() is not None  # a real build, with its digest
    plant(cache, compiler, tmp_path)  # then the library is swapped
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert load() is None
    assert not (tmp_path / "planted-ran").exists()
    assert "does not match the digest" in caplog.text and "torch's kernels" in caplog.text
    assert len(caplog.records) == 1


def test_a_group_writable_library_is_refused(cache, tmp_path, compiler, caplog):
    assert load() is not None
    lib = cache / cpu_kernels.library_name(compiler)
    lib.chmod(0o770)
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert load() is None
    assert "writable by group or others" in caplog.text


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_directory_others_can_write_is_refused(cache, tmp_path, caplog, mode):
    cache.mkdir(parents=True)
    cache.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert load() is None
    assert str(cache) in caplog.text and "writable by group or others" in caplog.text
    assert list(cache.iterdir()) == [] and compiler_runs(tmp_path) == 0  # nothing built there either


@pytest.mark.skipif(os.getuid() != 0, reason="only root can hand a directory to another user")
def test_a_cache_directory_owned_by_someone_else_is_refused(cache, tmp_path, caplog):
    cache.mkdir(parents=True, mode=0o700)
    os.chown(cache, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="embed_service.kernels"):
        assert load() is None
    assert "owned by uid 65534" in caplog.text
