"""What a model directory is: architecture, pooling, normalization, dimension, max input length.

Read from config.json and the sentence-transformers files (modules.json, 1_Pooling/config.json, Normalize,
Dense, sentence_bert_config.json). Plain JSON reading: no torch, no weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embed_service.models.registry import Family, resolve_family

_POOLING_KEYS = [
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_lasttoken", "last"),
]

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


@dataclass
class ModelSpec:
    path: Path
    config: dict[str, Any]
    architecture: str
    family: Family
    pooling: str
    normalize: bool
    dense: list[DenseSpec] = field(default_factory=list)
    max_input_length: int = 512
    position_limit: int = 512
    """The longest sequence the position table allows."""

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def position_offset(self) -> int:
        return self.family.position_offset(self.config)

    @property
    def dimension(self) -> int:
        return self.dense[-1].out_features if self.dense else self.hidden_size

    @property
    def causal(self) -> bool:
        return self.family.causal


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _st_modules(path: Path) -> list[dict[str, Any]]:
    modules = path / "modules.json"
    return _read_json(modules) if modules.is_file() else []


def load_spec(path: str | Path, max_input_length: int | None = None) -> ModelSpec:
    path = Path(path).resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = _read_json(path / "config.json")
    architecture, family = resolve_family(config)
    pooling, normalize = family.default_pooling, family.default_normalize
    dense: list[DenseSpec] = []
    modules = _st_modules(path)
    if modules:
        normalize = False  # with sentence-transformers files, Normalize is on only when listed
        for m in modules:
            kind = m.get("type", "").rsplit(".", 1)[-1]
            mpath = path / m.get("path", "")
            if kind == "Pooling":
                pcfg = _read_json(mpath / "config.json")
                chosen = [name for key, name in _POOLING_KEYS if pcfg.get(key)]
                if pcfg.get("pooling_mode") in {n for _, n in _POOLING_KEYS}:
                    chosen = [pcfg["pooling_mode"]]
                if len(chosen) != 1:
                    raise ValueError(
                        f"{mpath}: exactly one pooling mode is supported, found {chosen or 'none'}"
                    )
                pooling = chosen[0]
            elif kind == "Normalize":
                normalize = True
            elif kind == "Dense":
                dcfg = _read_json(mpath / "config.json")
                act = dcfg.get("activation_function", "torch.nn.modules.activation.Tanh")
                if act not in _ST_ACTIVATIONS:
                    raise ValueError(f"{mpath}: unsupported Dense activation {act}")
                dense.append(
                    DenseSpec(
                        mpath,
                        dcfg["in_features"],
                        dcfg["out_features"],
                        dcfg.get("bias", True),
                        _ST_ACTIVATIONS[act],
                    )
                )
            elif kind not in ("Transformer", "Pooling"):
                raise ValueError(f"unsupported sentence-transformers module {m.get('type')}")
    position_limit = int(config.get("max_position_embeddings", 1 << 20)) - family.position_offset(config)
    spec = ModelSpec(
        path, config, architecture, family, pooling, normalize, dense, position_limit=position_limit
    )
    spec.max_input_length = max_input_length or default_max_length(path, position_limit)
    if spec.max_input_length > position_limit:
        raise ValueError(
            f"max input length {spec.max_input_length} exceeds the model's {position_limit} positions"
        )
    return spec


def default_max_length(path: Path, position_limit: int) -> int:
    """sentence-transformers' max_seq_length, else a sane tokenizer model_max_length, else the positions."""
    st = path / "sentence_bert_config.json"
    if st.is_file():
        v = _read_json(st).get("max_seq_length")
        if v:
            return min(int(v), position_limit)
    tk = path / "tokenizer_config.json"
    if tk.is_file():
        v = _read_json(tk).get("model_max_length")
        if isinstance(v, (int, float)) and 0 < v < 1_000_000:
            return min(int(v), position_limit)
    return position_limit
