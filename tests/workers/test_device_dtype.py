"""--dtype auto on CUDA: decided per worker from its GPU's compute capability, never in the server process."""

from __future__ import annotations

import pytest

from embed_service.workers.device import cuda_dtype_for, resolve_dtype
from embed_service.workers.worker import warmup_shape


@pytest.mark.parametrize(
    ("capability", "dtype"),
    [
        ((7, 0), "float16"),  # V100: bfloat16 only emulated
        ((7, 5), "float16"),  # T4
        ((8, 0), "bfloat16"),  # A100
        ((8, 6), "bfloat16"),  # A10, RTX 30xx
        ((8, 9), "bfloat16"),  # L4, L40
        ((9, 0), "bfloat16"),  # H100, H200
        ((10, 0), "bfloat16"),  # B200
    ],
)
def test_cuda_dtype_from_compute_capability(capability, dtype):
    assert cuda_dtype_for(capability) == dtype


def test_the_server_process_leaves_cuda_auto_to_the_workers():
    assert resolve_dtype("auto", "cuda") == "auto"
    assert resolve_dtype("float16", "cuda") == "float16"
    assert resolve_dtype("float32", "cpu") == "float32"


@pytest.mark.parametrize(
    ("max_len", "budget", "device", "lengths"),
    [
        (512, 16384, "cuda", [512] * 32),  # the whole --max-batch-tokens on a GPU
        (32768, 32768, "cuda", [32768]),  # a 32k decoder: one 32k input, not two
        (512, 5000, "cuda", [512] * 9 + [392]),
        (256, 4096, "cpu", [256, 256]),  # a CPU: two of the longest inputs
        (256, 300, "cpu", [256, 44]),  # never more than a batch holds
    ],
)
def test_warm_up_is_the_largest_batch_serving_forms(max_len, budget, device, lengths):
    ids, got = warmup_shape(max_len, budget, device)
    assert got.tolist() == lengths and ids.size == sum(lengths) <= budget
