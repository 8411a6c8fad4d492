"""Where scripts/install.sh (make serve, make test, the image) takes torch from.

PyPI's Linux torch is the CUDA build: 15 nvidia-* wheels and triton besides torch, several GB a CPU never
uses. Without a GPU the script takes the CPU build: from pip's configured find-links when they hold it
(offline), else from PyTorch's CPU index; TORCH_INDEX_URL overrides. `torch-plan` prints the choice and
installs nothing; the real pip decides whether the configured sources hold a CPU build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.tools import ROOT

SCRIPT = ROOT / "scripts" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def plan(tmp_path: Path, path: str = "/usr/bin:/bin", **env: str) -> str:
    """The script's choice, with pip configured by `env` alone (no pip.conf of this machine)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_"))}
    run_env = {**base, "PATH": path, "PIP_CONFIG_FILE": os.devnull, "PYTHON": sys.executable, **env}
    r = subprocess.run(
        ["sh", str(SCRIPT), str(tmp_path / "no-venv"), "torch-plan"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "no-venv").exists(), "torch-plan installs nothing"
    return r.stdout


def wheelhouse(tmp_path: Path, version: str) -> Path:
    """A folder with a (metadata-only) torch wheel of `version`, as a configured find-links folder holds."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")
    return folder


def test_without_a_gpu_the_cpu_index_is_named(tmp_path):
    out = plan(tmp_path)
    assert f"index: {CPU_INDEX} " in out and "no GPU" in out


def test_a_configured_wheelhouse_with_the_cpu_build_is_used_offline(tmp_path):
    out = plan(tmp_path, PIP_FIND_LINKS=str(wheelhouse(tmp_path, "2.13.0+cpu")), PIP_NO_INDEX="1")
    assert "index: pip-config " in out and "find-links hold the CPU build" in out


def test_a_wheelhouse_with_only_the_cuda_build_does_not_count(tmp_path):
    out = plan(tmp_path, PIP_FIND_LINKS=str(wheelhouse(tmp_path, "2.13.0")), PIP_NO_INDEX="1")
    assert f"index: {CPU_INDEX} " in out


def test_with_a_gpu_pips_own_index_gives_the_cuda_build(tmp_path):
    """nvidia-smi cannot run here (no driver): a stand-in prints what `nvidia-smi -L` prints on a GPU host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d)"\n')
    smi.chmod(0o755)
    out = plan(tmp_path, path=f"{bin_dir}:/usr/bin:/bin")
    assert "index: pip-config " in out and "a GPU" in out
    smi.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n"
    )  # a host without a driver
    assert f"index: {CPU_INDEX} " in plan(tmp_path, path=f"{bin_dir}:/usr/bin:/bin")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("https://download.pytorch.org/whl/cu128", "https://download.pytorch.org/whl/cu128"),
        ("none", "pip-config"),
    ],
)
def test_torch_index_url_overrides_the_choice(tmp_path, setting, expected):
    assert f"index: {expected} " in plan(tmp_path, TORCH_INDEX_URL=setting)
