"""A whole model with the kernels chosen against the same model on its references, and the interpreter's
switch kept out of the servers' environment."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from embed_service.models.loader import EmbeddingModel
from embed_service.models.spec import load_spec
from embed_service.ops import fused
from embed_service.ops.batch import FlatBatch
from embed_service.outputs import DENSE_ONLY


def test_minilm_with_kernels_matches_its_references(kernels_on, device, default_model_path):
    """all-MiniLM-L6-v2 (fused residual + LayerNorm in every block, mean pooling) in float32."""
    spec = load_spec(default_model_path, 64)
    model = EmbeddingModel(spec, torch.float32, torch.device(device)).eval()
    lengths = [1, 9, 23]
    ids = torch.randint(1000, 20000, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    batch = FlatBatch.from_lengths(ids, lengths).to(device)
    fast = [o.dense for o in model(batch, [DENSE_ONLY] * 3)]
    with fused.reference_only():
        ref = [o.dense for o in model(batch, [DENSE_ONLY] * 3)]
    for a, b in zip(fast, ref):
        cosine = float(a @ b / ((a @ a) ** 0.5 * (b @ b) ** 0.5))
        assert cosine > 0.99999, cosine
        assert abs(a - b).max() < 1e-4


def test_the_interpreter_switch_does_not_reach_subprocesses():
    assert "TRITON_INTERPRET" not in os.environ or os.environ["TRITON_INTERPRET"] == "0"
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() in ("None", "0")
