"""Activations by the names configs use."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [gate | up] projection: (T, 2I) -> (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
