"""Tiny random scoring models written the way real ones are: transformers' save_pretrained, then
sentence-transformers' CrossEncoder.save (its config_sentence_transformers.json names the activation).

Random heads too: the pooler, the classifier and RoBERTa's classification head are drawn like the rest
(tests/models/tiny.py `randomize`), so a head left out or loaded wrong moves every score.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as T

from tests.models.tiny import load_tokenizer, randomize

ENCODER = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2)


def bert_config(**kw: Any) -> T.BertConfig:
    # type_vocab_size 2 (the default): the second text of a pair is segment 1.
    return T.BertConfig(**ENCODER, vocab_size=30522, max_position_embeddings=128, **kw)


def xlmr_config(**kw: Any) -> T.XLMRobertaConfig:
    return T.XLMRobertaConfig(
        **ENCODER, vocab_size=49152, pad_token_id=3, max_position_embeddings=100, type_vocab_size=1, **kw
    )


def build(
    model_class: str,
    config: Any,
    tokenizer: str,
    path: Path,
    sources: dict[str, Path],
    activation: torch.nn.Module | None = None,
    cross_encoder: bool = True,
    max_length: int | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a tiny scoring model to `path`; with `cross_encoder`, re-saved by CrossEncoder (with
    `activation`, else its default). The tokenizer keeps no chat template but `chat_template`."""
    torch.manual_seed(0)
    model = getattr(T, model_class)(config).eval()
    randomize(model, seed=1)
    model.save_pretrained(str(path))
    tok = load_tokenizer(tokenizer, sources)
    tok.chat_template = chat_template
    if max_length is not None:
        tok.model_max_length = max_length
    pad = model.config.pad_token_id
    if pad is not None:
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    tok.save_pretrained(str(path))
    if cross_encoder:
        from sentence_transformers import CrossEncoder

        CrossEncoder(str(path), device="cpu", activation_fn=activation, max_length=max_length).save(str(path))
    return path
