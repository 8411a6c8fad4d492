"""The start-up fidelity check's parts: its reference pass restores the very parameters the fast path had."""

from __future__ import annotations

import numpy as np
import torch

from embed_service.workers import fidelity


def test_float32_parameters_restore_the_same_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in model.parameters()]
    with fidelity.float32_parameters(model):
        assert all(p.dtype == torch.float32 for p in model.parameters())
    for p, (ptr, dtype, values) in zip(model.parameters(), before):
        assert p.data_ptr() == ptr and p.dtype == dtype and torch.equal(p, values)


def test_measure_compares_the_fast_path_with_the_float32_pass():
    """A bfloat16 model: close to its float32 pass, unless the fast path breaks (odd features zeroed)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    broken = False

    def run(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        x = torch.nn.functional.one_hot(torch.from_numpy(ids[: len(lengths)]).long() % 16, 16)
        with torch.no_grad():
            out = model(x.to(model.weight.dtype)).float()
        if broken and model.weight.dtype == torch.bfloat16:  # the fast path only
            out[:, 1::2] = 0
        return out.numpy()

    result = fidelity.measure(model, run, 1000, 128, 0.999, fast_is_reference=False)
    assert result.inputs == 3 and 0.999 < result.min_cosine <= 1.0 and result.passed
    assert model.weight.dtype == torch.bfloat16
    broken = True
    refused = fidelity.measure(model, run, 1000, 128, 0.999, fast_is_reference=False)
    assert refused.min_cosine < 0.9 and not refused.passed
    assert fidelity.measure(model, run, 1000, 128, 0.0, False).skipped == "--fidelity-min-cosine 0"


def test_check_inputs_are_fixed_and_fit_the_model():
    ids, lengths = fidelity.check_inputs(30522, 64)
    again, _ = fidelity.check_inputs(30522, 64)
    assert np.array_equal(ids, again) and lengths.tolist() == [3, 17, 64]
    assert ids.min() >= 1000 and ids.max() < 30522 and ids.size == lengths.sum()
