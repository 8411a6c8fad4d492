"""The sentence-transformers modules of an embedding folder: Pooling, Dense, the prompts and the max
sequence length (modules.json, 1_Pooling/config.json, 2_Dense/config.json, config_sentence_transformers.json,
sentence_bert_config.json). Plain JSON reading: no torch, no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_service.models.files import positive_int, read_json

# sentence-transformers' pooling modes, by their names in the current `pooling_mode` key -> ours.
_POOLING_MODES = {
    "cls": "cls",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "lasttoken": "last",
}
# The boolean keys older files carry instead, in sentence-transformers' order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Tanh": "tanh",
    "torch.nn.Identity": "identity",
}


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module after pooling."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


def dense_module(mpath: Path) -> DenseSpec:
    """A sentence-transformers Dense module from its config.json."""
    file = mpath / "config.json"
    dcfg = read_json(file)
    if not isinstance(dcfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    act = dcfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act not in _ST_ACTIVATIONS:
        raise ValueError(f"{mpath}: unsupported Dense activation {act}")
    bias = dcfg.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError(f"{file}: bias is {bias!r}, not true or false")
    return DenseSpec(
        mpath,
        positive_int(dcfg, "in_features", file),
        positive_int(dcfg, "out_features", file),
        bias,
        _ST_ACTIVATIONS[act],
    )


def st_modules(path: Path) -> list[dict[str, Any]]:
    modules = path / "modules.json"
    return read_json(modules) if modules.is_file() else []


def pooling_mode(mpath: Path) -> str:
    """The one pooling mode of a sentence-transformers Pooling module, in either config format."""
    pcfg = read_json(mpath / "config.json")
    mode = pcfg.get("pooling_mode")
    if mode is None:  # as sentence-transformers: the legacy keys set, else mean
        mode = [name for key, name in _LEGACY_POOLING_KEYS.items() if pcfg.get(key)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise ValueError(
            f"{mpath}: exactly one of the pooling modes {sorted(_POOLING_MODES)} is supported, found {modes}"
        )
    chosen = _POOLING_MODES[modes[0]]
    if pcfg.get("include_prompt", True) is False and chosen != "last":
        # The prompt would have to be left out of the pooled tokens; the pooled token of last-token
        # pooling is never part of the prompt, so only that mode is unaffected.
        raise ValueError(
            f"{mpath}: include_prompt=false (pooling that leaves the prompt tokens out) is not supported "
            f"with {chosen} pooling"
        )
    return chosen


def prompts_of(path: Path) -> tuple[dict[str, str], str | None]:
    """``prompts`` and ``default_prompt_name`` from config_sentence_transformers.json."""
    file = path / "config_sentence_transformers.json"
    if not file.is_file():
        return {}, None
    cfg = read_json(file)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ValueError(f"{file}: `prompts` must map names to strings")
    default = cfg.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ValueError(
            f"{file}: default_prompt_name {default!r} is not one of the prompts {sorted(prompts)}"
        )
    return prompts, default


def default_max_length(path: Path, position_limit: int) -> int:
    """sentence-transformers' max_seq_length, else a sane tokenizer model_max_length, else the positions."""
    st = path / "sentence_bert_config.json"
    if st.is_file():
        v = read_json(st).get("max_seq_length")
        if v:
            return min(int(v), position_limit)
    tk = path / "tokenizer_config.json"
    if tk.is_file():
        v = read_json(tk).get("model_max_length")
        if isinstance(v, (int, float)) and 0 < v < 1_000_000:
            return min(int(v), position_limit)
    return position_limit
