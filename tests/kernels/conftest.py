"""The kernels under test: Triton's interpreter on a CPU (tests/triton_interpreter.py), compiled on CUDA when
TRITON_INTERPRET=0 and a GPU is there (benchmarks/gpu_check.sh)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from embed_service.ops import fused
from tests import triton_interpreter


def kernel_device() -> str | None:
    if triton_interpreter.ENABLED:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.fixture(scope="session")
def device() -> str:
    where = kernel_device()
    if where is None:
        pytest.skip("the kernels need triton's interpreter (pip install triton) or a CUDA device")
    return where


@pytest.fixture(scope="session")
def K(device: str) -> ModuleType:
    try:
        import embed_service.kernels as kernels
    except ImportError as exc:
        pytest.skip(f"triton is not installed ({exc}): pip install -e '.[dev]'")
    return kernels


@pytest.fixture
def kernels_on(K: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The layers call the kernels for this test, as a worker that chose them does."""
    monkeypatch.setattr(fused, "_kernels", K)
    yield K
