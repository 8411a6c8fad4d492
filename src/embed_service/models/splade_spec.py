"""A sentence-transformers SparseEncoder (SPLADE) folder: its SpladePooling options and the checks that
the checkpoint is a masked LM whose head models/bert.py (or modernbert.py) builds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_service.models.files import read_json

# sentence-transformers' SparseEncoder (SPLADE): the architectures whose masked-LM head models/bert.py builds,
# and the SpladePooling options (sparse_encoder/modules/splade_pooling.py).
SPLADE_ARCHITECTURES = frozenset(
    {
        "BertForMaskedLM",
        "BertForPreTraining",
        "RobertaForMaskedLM",
        "XLMRobertaForMaskedLM",
        "ModernBertForMaskedLM",  # its head: models/modernbert.py
    }
)
_SPLADE_POOLING = ("max", "sum")
_SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeSpec:
    """A SpladePooling module over the MLM logits: per token log(1 + ReLU(logits)) (``log1p_relu``: log1p
    once more), then the maximum (``max``) or the sum (``sum``) over the tokens, per vocabulary entry."""

    pooling_strategy: str = "max"
    activation_function: str = "relu"


def splade_pooling(mpath: Path) -> SpladeSpec:
    """A SpladePooling module's options from its config.json, refusing values sentence-transformers refuses."""
    file = mpath / "config.json"
    cfg = read_json(file) if file.is_file() else {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    spec = SpladeSpec(cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu"))
    if spec.pooling_strategy not in _SPLADE_POOLING:
        raise ValueError(
            f"{file}: pooling_strategy {spec.pooling_strategy!r} is not one of {_SPLADE_POOLING}"
        )
    if spec.activation_function not in _SPLADE_ACTIVATIONS:
        raise ValueError(
            f"{file}: activation_function {spec.activation_function!r} is not one of {_SPLADE_ACTIVATIONS}"
        )
    return spec


def check_splade(path: Path, architecture: str, modules: list[dict[str, Any]]) -> None:
    """SpladePooling reads MLM logits: the checkpoint must be a masked LM whose head we build, and nothing
    but the transformer may stand before the pooling (a dense Pooling or Dense module beside it is refused)."""
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if kinds[-1:] != ["SpladePooling"] or any(k not in ("Transformer", "MLMTransformer") for k in kinds[:-1]):
        raise ValueError(
            f"{path / 'modules.json'}: a SPLADE model is a transformer then SpladePooling, found {kinds}"
        )
    if architecture not in SPLADE_ARCHITECTURES:
        raise ValueError(
            f"{path}: SpladePooling needs a masked-LM checkpoint with its head "
            f"({', '.join(sorted(SPLADE_ARCHITECTURES))}); config.json names {architecture}"
        )
