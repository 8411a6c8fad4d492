"""Maps ``architectures`` in config.json to an implementation and its default pooling.

Only import paths live here, so the HTTP process can detect a model without importing torch model code.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """An implementation: where its class lives, whether attention is causal, and its default pooling.

    ``causal`` is the architecture's own attention; a config may still ask a decoder for bidirectional
    attention (see ModelSpec.causal).
    """

    module: str
    cls: str
    causal: bool
    default_pooling: str
    default_normalize: bool
    positions_after_padding: bool = False
    """RoBERTa style: position 0 sits at padding index + 1 in the position table."""
    fixed_position_offset: int | None = None
    """Where position 0 sits whatever the config says (MPNet: after its padding index 1, hard-coded)."""
    config_aliases: tuple[tuple[str, str], ...] = ()
    """(standard key, this family's key) pairs: configs that name their sizes their own way (DistilBERT's
    ``dim``, ``n_heads``) are read under the standard names everywhere else."""
    towers: bool = False
    """A text tower and a vision tower in one vector space (CLIP, SigLIP: models/towers.py); the text
    tower's settings stand in for the model's everywhere a text model's are read."""

    def standard_config(self, config: dict) -> dict:
        """The config with the standard keys filled in from this family's own names, where absent."""
        if self.towers:
            from embed_service.models.towers import tower

            config = {**tower(config, self.cls, "text_config"), **config}
        out = dict(config)
        for standard, own in self.config_aliases:
            if standard not in out and own in out:
                out[standard] = out[own]
        return out

    def position_offset(self, config: dict) -> int:
        if self.fixed_position_offset is not None:
            return self.fixed_position_offset
        if not self.positions_after_padding:
            return 0
        pad = config.get("pad_token_id", 1)  # RoBERTa's default
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(
                f"config.json: pad_token_id is {json.dumps(pad)}; {self.cls} places position 0 after the padding "
                "index, so it must be a token id"
            )
        return pad + 1

    def load_class(self) -> type:
        return getattr(importlib.import_module(f"embed_service.models.{self.module}"), self.cls)


_BERT = Family("bert", "BertModel", causal=False, default_pooling="cls", default_normalize=False)
_ROBERTA = Family(
    "bert",
    "RobertaModel",
    causal=False,
    default_pooling="cls",
    default_normalize=False,
    positions_after_padding=True,
)
_MODERNBERT = Family(
    "modernbert", "ModernBertModel", causal=False, default_pooling="cls", default_normalize=False
)


def _decoder(cls: str) -> Family:
    # Causal LMs used as embedders: the last token has seen the whole input.
    return Family("decoder", cls, causal=True, default_pooling="last", default_normalize=True)


_LLAMA, _MISTRAL = _decoder("LlamaModel"), _decoder("MistralModel")
_QWEN2, _QWEN3 = _decoder("Qwen2Model"), _decoder("Qwen3Model")
_DISTILBERT = Family(
    "distilbert",
    "DistilBertModel",
    causal=False,
    default_pooling="cls",
    default_normalize=False,
    config_aliases=(
        ("hidden_size", "dim"),
        ("num_attention_heads", "n_heads"),
        ("num_hidden_layers", "n_layers"),
        ("intermediate_size", "hidden_dim"),
    ),
)
# transformers' MPNet numbers positions from its padding index (1, not read from the config) + 1.
_MPNET = Family(
    "mpnet",
    "MPNetModel",
    causal=False,
    default_pooling="cls",
    default_normalize=False,
    fixed_position_offset=2,
)
_GEMMA2 = Family("gemma", "Gemma2Model", causal=True, default_pooling="last", default_normalize=True)
_GEMMA3 = Family("gemma", "Gemma3TextModel", causal=True, default_pooling="last", default_normalize=True)

# Two towers: CLIP pools the end-of-text token, SigLIP the last one (models/clip.py, siglip.py); the
# vectors are the projections', not normalized, as get_text_features / get_image_features give them.
_CLIP = Family("clip", "CLIPModel", causal=True, default_pooling="eos", default_normalize=False, towers=True)
_SIGLIP = Family(
    "siglip", "SiglipModel", causal=False, default_pooling="last", default_normalize=False, towers=True
)

ARCHITECTURES: dict[str, Family] = {
    "BertModel": _BERT,
    "BertForMaskedLM": _BERT,
    "BertForPreTraining": _BERT,
    "RobertaModel": _ROBERTA,
    "RobertaForMaskedLM": _ROBERTA,
    "XLMRobertaModel": _ROBERTA,
    "XLMRobertaForMaskedLM": _ROBERTA,
    "ModernBertModel": _MODERNBERT,
    "ModernBertForMaskedLM": _MODERNBERT,
    "LlamaModel": _LLAMA,
    "LlamaForCausalLM": _LLAMA,
    "MistralModel": _MISTRAL,
    "MistralForCausalLM": _MISTRAL,
    "Qwen2Model": _QWEN2,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3Model": _QWEN3,
    "Qwen3ForCausalLM": _QWEN3,
    # Cross-encoders and sequence classifiers: the same backbones, and a scoring head (models/scoring.py).
    "BertForSequenceClassification": _BERT,
    "RobertaForSequenceClassification": _ROBERTA,
    "XLMRobertaForSequenceClassification": _ROBERTA,
    "ModernBertForSequenceClassification": _MODERNBERT,
    # RoBERTa under other names: the same layers and checkpoint layout (prefix "roberta.").
    "CamembertModel": _ROBERTA,
    "CamembertForMaskedLM": _ROBERTA,
    "DistilBertModel": _DISTILBERT,
    "DistilBertForMaskedLM": _DISTILBERT,
    "MPNetModel": _MPNET,
    "MPNetForMaskedLM": _MPNET,
    "Gemma2Model": _GEMMA2,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3TextModel": _GEMMA3,
    "Gemma3ForCausalLM": _GEMMA3,
    "CLIPModel": _CLIP,
    "SiglipModel": _SIGLIP,
}

# The scoring head of each family's *ForSequenceClassification checkpoints (models/scoring.py SCORERS).
SCORING_HEADS = {"BertModel": "bert", "RobertaModel": "roberta", "ModernBertModel": "modernbert"}

# For configs without an `architectures` list.
MODEL_TYPES: dict[str, Family] = {
    "bert": _BERT,
    "roberta": _ROBERTA,
    "xlm-roberta": _ROBERTA,
    "modernbert": _MODERNBERT,
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "camembert": _ROBERTA,
    "distilbert": _DISTILBERT,
    "mpnet": _MPNET,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "clip": _CLIP,
    "siglip": _SIGLIP,
}


class UnsupportedModelError(ValueError):
    pass


def resolve_family(config: dict) -> tuple[str, Family]:
    """(architecture name, family) for a config.json; unknown architectures fail with the supported list."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    if not archs and config.get("model_type") in MODEL_TYPES:
        return config["model_type"], MODEL_TYPES[config["model_type"]]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or config.get('model_type')!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )
