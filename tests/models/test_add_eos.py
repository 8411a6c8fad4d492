"""A decoder whose tokenizer_config asks for `add_eos_token: true` (e5-mistral, gte-Qwen2 style).

The model authors' documented usage tokenizes to max_length - 1, appends the EOS id, and pools the last
token. transformers 5 ignores the key, and sentence-transformers on top of it does too, so neither is the
reference here: the transformers model run on the tokenizer's ids plus EOS is.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import transformers as T

from tests.models.tiny import Tiny, build, cosines, embed, hf_reference, set_tokenizer_config, texts
from tests.server import ServerProcess

MAX_POSITIONS = 128
E5_STYLE = Tiny(
    "mistral-eos",
    "MistralForCausalLM",
    lambda: T.MistralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        num_hidden_layers=3,
        vocab_size=49152,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
        eos_token_id=2,
        rope_theta=25000.0,
        sliding_window=20,  # causal window: long texts cross it
    ),
    tokenizer="bpe",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_sources):
    path = build(E5_STYLE, tmp_path_factory.mktemp("mistral-eos"), tokenizer_sources)
    set_tokenizer_config(path, add_eos_token=True)
    with ServerProcess("--model", str(path), "--dtype", "float32") as server:
        yield path, server


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model[0]))


def test_transformers_does_not_append_eos_itself(tokenizer):
    """The premise: without the server's handling, the EOS would be missing."""
    assert tokenizer.eos_token_id == 2
    assert tokenizer("hello world").input_ids[-1] != tokenizer.eos_token_id


def test_vectors_equal_reference_with_eos_and_differ_without(model, tokenizer):
    path, server = model
    inputs = texts()
    ours, body = embed(server.url, inputs)
    eos = tokenizer.eos_token_id
    # The documented usage: truncate to max_length - 1, then append EOS (so truncation keeps it).
    with_eos = [tokenizer(t, truncation=True, max_length=MAX_POSITIONS - 1).input_ids + [eos] for t in inputs]
    without = [tokenizer(t, truncation=True, max_length=MAX_POSITIONS).input_ids for t in inputs]
    ref = hf_reference(path, with_eos, "last", normalize=True)
    cos = cosines(ours, ref)
    print(
        f"\nmistral add_eos_token: min cosine vs reference with EOS over {len(cos)} texts = {cos.min():.8f}"
    )
    assert cos.min() >= 0.99999
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in with_eos)
    # The EOS matters: the same ids without it give clearly different vectors, for every text.
    cos_without = cosines(ours, hf_reference(path, without, "last", normalize=True))
    print(f"mistral add_eos_token: max cosine vs reference without EOS = {cos_without.max():.6f}")
    assert cos_without.max() < 0.999


def test_tokenize_shows_eos_and_truncation_keeps_it(model, tokenizer):
    _, server = model
    long_text = " ".join(["word"] * 500)
    r = httpx.post(server.url + "/tokenize", json={"input": ["hello world", long_text]})
    assert r.status_code == 200, r.text
    short, long = (d["tokens"] for d in r.json()["data"])
    assert short == tokenizer("hello world").input_ids + [tokenizer.eos_token_id]
    assert len(long) == MAX_POSITIONS and long[-1] == tokenizer.eos_token_id


def test_token_ids_stay_verbatim(model, tokenizer):
    """Token-id input is embedded as sent: no EOS is appended to it."""
    path, server = model
    ids = tokenizer("hello world").input_ids
    ours, body = embed(server.url, [ids, ids + [tokenizer.eos_token_id]])
    assert body["usage"]["prompt_tokens"] == 2 * len(ids) + 1
    ref = hf_reference(path, [ids, ids + [tokenizer.eos_token_id]], "last", normalize=True)
    assert cosines(ours, ref).min() >= 0.99999
    text_vector, _ = embed(server.url, "hello world")
    np.testing.assert_allclose(text_vector[0], ours[1], atol=1e-5)
