"""The one place that knows this process's tensor-parallel rank and world size.

Layers ask here for their shard; a worker sets it once, before the model is built. With no process group
(one rank) every layer holds the whole tensor and the collectives are no-ops: one code path for any size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def set_tensor_parallel(rank: int, world_size: int) -> None:
    global _rank, _world_size
    _rank, _world_size = rank, world_size


def check_shardable(config: dict[str, Any], world_size: int) -> None:
    """Refuse, naming the numbers, a model whose split dimensions do not divide by the world size.

    Reads the Hugging Face config only (no weights, no torch model code), so a server checks before it
    starts any worker. Query heads, key/value heads and the MLP's intermediate size are split across
    ranks; the vocabulary is padded instead, so it need not divide.
    """
    if world_size == 1:
        return
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads")
    checks = [
        ("query heads", heads),
        ("key/value heads", kv_heads if kv_heads != heads else None),  # unset: as many as query heads
        ("intermediate size", config.get("intermediate_size")),
    ]
    vision = config.get("vision_config")  # a two-tower model (CLIP, SigLIP): its vision tower splits too
    if isinstance(vision, dict):
        checks += [
            ("vision query heads", vision.get("num_attention_heads")),
            ("vision intermediate size", vision.get("intermediate_size")),
        ]
    problems = [f"{what} ({n})" for what, n in checks if isinstance(n, int) and n % world_size]
    if problems:
        raise ValueError(
            f"cannot split the model over --tensor-parallel-size {world_size}: "
            f"{' and '.join(problems)} must divide by {world_size}"
        )


def tp_rank() -> int:
    return _rank


def tp_world_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum a partial result across ranks, in place."""
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension."""
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
