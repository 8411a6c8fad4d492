"""Threads, replicas and the replica memory check from the container's cgroup, not the host's counts.

The cgroup files are laid out by the test (cgroup v2 and v1 as the kernel writes them), and the module's
two paths point at them: a real container is verified with an engine (docs/deployment.md says how).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from embed_service.config import Settings
from embed_service.engine.engine import Engine, small_enough_to_copy
from embed_service.models.spec import load_spec
from embed_service.workers import device

GIB = 1 << 30


def fake_cgroup(tmp_path: Path, monkeypatch, version: int, files: dict[str, str], own: str = "/") -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc-self-cgroup"
    if version == 2:
        (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / "cgroup.controllers").write_text("cpu memory pids\n")
        proc.write_text(f"0::{own}\n")
    else:
        for controller in ("cpu", "memory"):
            (root / controller / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
        proc.write_text(f"4:memory:{own}\n1:cpu,cpuacct:{own}\n0::/\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    monkeypatch.setattr(device, "CGROUP_ROOT", root)
    monkeypatch.setattr(device, "PROC_CGROUP", proc)
    # A 16-core host, whatever runs the test: only the quota may bring the count down.
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


@pytest.mark.parametrize(
    ("version", "files", "cores"),
    [
        (2, {"cpu.max": "max 100000"}, 16),
        (2, {"cpu.max": "250000 100000"}, 2),  # 2.5 CPUs: 2 threads, not 3 throttled ones
        (2, {"cpu.max": "50000 100000"}, 1),  # 500m: still one
        (2, {"kubepods/cpu.max": "400000 100000", "kubepods/pod1/cpu.max": "max 100000"}, 4),  # an ancestor's
        (1, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 16),
        (1, {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),
        (2, {}, 16),  # no cpu controller files at all
    ],
)
def test_cores_follow_the_cpu_quota(tmp_path, monkeypatch, version, files, cores):
    own = "/kubepods/pod1" if any(k.startswith("kubepods") for k in files) else "/"
    fake_cgroup(tmp_path, monkeypatch, version, files, own)
    assert device.available_cores() == cores


def test_v1_container_without_a_cgroup_namespace_reads_the_mount_root(tmp_path, monkeypatch):
    # /proc/self/cgroup names the host's path (/docker/abc), but the container sees its own cgroup as the root.
    fake_cgroup(
        tmp_path, monkeypatch, 1, {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}
    )
    (tmp_path / "proc-self-cgroup").write_text("1:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    assert device.available_cores() == 2


@pytest.mark.parametrize(
    ("version", "files", "limit"),
    [
        (2, {"memory.max": "max"}, None),
        (2, {"memory.max": str(2 * GIB)}, 2 * GIB),
        (1, {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),  # v1's "unlimited"
        (1, {"memory/memory.limit_in_bytes": str(GIB)}, GIB),
    ],
)
def test_memory_limit(tmp_path, monkeypatch, version, files, limit):
    fake_cgroup(tmp_path, monkeypatch, version, files)
    assert device.cgroup_memory_limit() == limit
    if limit is not None:
        assert device.available_memory() == limit


@pytest.fixture(scope="module")
def spec(default_model_path):
    return load_spec(default_model_path, None)


@pytest.mark.parametrize(
    ("cpu_max", "memory_max", "replicas", "threads"),
    [
        ("200000 100000", "max", 2, 1),  # 2 CPUs: two replicas of one thread each
        ("100000 100000", "max", 1, 1),  # 1 CPU: one replica, whatever the host has
        ("800000 100000", "max", 2, 4),
        # 1 GiB: two copies of the 87 MiB weights are more than an eighth of it, so one replica, all threads.
        ("800000 100000", str(GIB), 1, 8),
        ("800000 100000", str(2 * GIB), 2, 4),
    ],
)
def test_engine_defaults_follow_the_container(
    tmp_path, monkeypatch, spec, cpu_max, memory_max, replicas, threads
):
    fake_cgroup(tmp_path, monkeypatch, 2, {"cpu.max": cpu_max, "memory.max": memory_max})
    engine = Engine(Settings(device="cpu"), spec, ["sizing-test"])
    assert (engine.replicas, engine.num_threads) == (replicas, threads)
    assert small_enough_to_copy(spec) == (memory_max != str(GIB))
