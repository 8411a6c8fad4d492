"""Faults injected into a server's worker processes, for tests/workers/test_faults.py.

A server started with this folder first on PYTHONPATH runs this at every interpreter start, its spawned
workers included. EMBED_TEST_FAULTS names the faults, comma-separated:

- ``break-kernel``: the worker "chooses" kernels whose norms zero every odd feature (the silent wrong
  vectors the start-up fidelity check is for); the reference pass is untouched.
- ``break-vision``: a two-tower model's image vectors have every odd feature zeroed in the fast path only
  (outside ops/fused.reference_only); its texts are untouched.
- ``oom-above:N``: a batch of more than N tokens holding token id OOM_TOKEN raises torch.OutOfMemoryError,
  on every rank.
- ``oom-rank0-above:N``: the same on rank 0 only (the other ranks go on into a collective rank 0 never joins).
- ``fatal-token``: a batch holding token id FATAL_TOKEN raises the error a CUDA device-side assert gives.

Nothing here is imported by the service itself; the hooks wrap ops/fused.configure, which every worker
calls once before it builds its model.
"""

from __future__ import annotations

import os

OOM_TOKEN = 4243
FATAL_TOKEN = 4242

FAULTS = [f for f in os.environ.get("EMBED_TEST_FAULTS", "").split(",") if f]


def _broken_kernels():
    from types import SimpleNamespace

    import torch.nn.functional as F

    from embed_service.layers.activation import act_and_mul_reference
    from embed_service.layers.rotary import apply_rotary_reference
    from embed_service.ops import fused
    from embed_service.ops.pooling import pool

    def zero_odd(out):
        out[..., 1::2] = 0
        return out

    def add_layer_norm(x, residual, weight, bias, eps):
        s = x if residual is None else x + residual
        b = None if bias is None else bias.float()
        out = F.layer_norm(s.float(), s.shape[-1:], weight.float(), b, eps).to(x.dtype)
        return zero_odd(out), (None if residual is None else s)

    def add_rms_norm(x, residual, weight, eps):
        s = x if residual is None else x + residual
        sf = s.float()
        out = weight * (sf * (sf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(x.dtype)
        return zero_odd(out), (None if residual is None else s)

    def rotary_(x, cos, sin):
        return x.copy_(apply_rotary_reference(x, cos, sin))

    def pool_normalize(hidden, cu, mode, dimensions=None, normalize=False):
        with fused.reference_only():
            return pool(hidden, cu, mode, dimensions, normalize)

    names = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
    return SimpleNamespace(
        add_layer_norm=add_layer_norm,
        add_rms_norm=add_rms_norm,
        rotary_=rotary_,
        act_and_mul=lambda x, name: act_and_mul_reference(x, names[name]),
        pool_normalize=pool_normalize,
    )


def _install() -> None:
    from embed_service.ops import fused

    configure = fused.configure

    def faulty_configure(device_type: str) -> str:
        choice = configure(device_type)
        if "break-kernel" in FAULTS:
            fused._kernels, fused._reason = _broken_kernels(), "broken (test fault)"
            choice = fused._reason
        if "break-vision" in FAULTS:
            from embed_service.models import siglip  # noqa: F401  (its classes among the subclasses)
            from embed_service.models.clip import TwoTowerModel

            def broken(image_features):
                def broken_image_features(self, pixels):
                    out = image_features(self, pixels)
                    if not fused._suspended:
                        out[..., 1::2] = 0
                    return out

                return broken_image_features

            for cls in (TwoTowerModel, *TwoTowerModel.__subclasses__()):
                if "image_features" in vars(cls):
                    cls.image_features = broken(vars(cls)["image_features"])
            fused._reason = choice = "broken vision (test fault)"
        oom = [int(f.split(":", 1)[1]) for f in FAULTS if f.startswith(("oom-above:", "oom-rank0-above:"))]
        rank0_only = any(f.startswith("oom-rank0-above:") for f in FAULTS)
        if oom or "fatal-token" in FAULTS:
            import torch

            from embed_service.models.loader import EmbeddingModel

            forward = EmbeddingModel.forward

            def faulty_forward(self, batch, requests):
                ids = batch.input_ids
                if "fatal-token" in FAULTS and bool((ids == FATAL_TOKEN).any()):
                    raise RuntimeError("CUDA error: device-side assert triggered (test fault)")
                from embed_service.parallel import tp_rank

                hit = oom and int(batch.cu_seqlens[-1]) > oom[0] and bool((ids == OOM_TOKEN).any())
                if hit and (not rank0_only or tp_rank() == 0):
                    raise torch.OutOfMemoryError(
                        "CUDA out of memory. Tried to allocate 2.00 GiB (test fault)"
                    )
                return forward(self, batch, requests)

            EmbeddingModel.forward = faulty_forward
        return choice

    fused.configure = faulty_configure


if FAULTS:
    _install()
