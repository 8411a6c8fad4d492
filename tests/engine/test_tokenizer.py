"""Truncation keeps the special tokens and matches the reference tokenizer's own truncation."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from embed_service.engine.tokenizer import InputTooLongError, Tokenizer, Truncation
from embed_service.models.spec import load_spec


@pytest.fixture(scope="module")
def tok(default_model_path):
    return Tokenizer(load_spec(default_model_path))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [3, 8, 50])
def test_truncation_matches_hf(tok, default_model_path, side, max_length):
    hf = AutoTokenizer.from_pretrained(str(default_model_path), truncation_side=side)
    texts = ["one two three four five six seven eight nine ten eleven twelve " * 5, "short"]
    ours = tok.truncate(tok.encode(texts), Truncation(True, max_length, side))
    assert ours == hf(texts, truncation=True, max_length=max_length)["input_ids"]


def test_template_is_detected(tok):
    assert (tok.prefix_len, tok.suffix_len) == (1, 1)


def test_refuses_when_truncation_is_off(tok):
    with pytest.raises(InputTooLongError):
        tok.truncate([[101] + [7] * 20 + [102]], Truncation(False, 10))
    assert tok.truncate([[101, 7, 102]], Truncation(False, 10)) == [[101, 7, 102]]
