"""Prompts from config_sentence_transformers.json: the default one, `prompt_name`, a raw `prompt`.

A tiny BERT with sentence-transformers files and prompts, served in float32, against
SentenceTransformer.encode with the same prompt; token counts and /tokenize include the prompt.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import transformers as T

from tests.models.tiny import Tiny, build, cosines, embed, st_reference, texts
from tests.server import ServerProcess

PROMPTS = {"query": "query: ", "passage": "passage: "}
MAX_LENGTH = 64
PROMPTED = Tiny(
    "bert-prompts",
    "BertModel",
    lambda: T.BertConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=30522,
        max_position_embeddings=128,
    ),
    tokenizer="wordpiece",
    pooling="max",  # the other poolings are exercised by the architecture tests
    normalize=True,
    max_seq_length=MAX_LENGTH,
    prompts=PROMPTS,
    default_prompt_name="query",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_path):
    path = build(PROMPTED, tmp_path_factory.mktemp("bert-prompts"), {"wordpiece": default_model_path})
    with ServerProcess("--model", str(path), "--dtype", "float32") as server:
        yield path, server


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model[0]))


def post(server: ServerProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def test_default_prompt_is_applied(model):
    path, server = model
    inputs = texts()
    ours, _ = embed(server.url, inputs)
    cos = cosines(ours, st_reference(path, inputs))  # sentence-transformers applies the default prompt too
    print(f"\ndefault prompt: min cosine vs sentence-transformers = {cos.min():.8f}")
    assert cos.min() >= 0.99999
    # ... and it matters: without it the short texts embed differently.
    without = st_reference(path, inputs[:20], prompt="")
    assert cosines(ours[:20], without).min() < 0.999


@pytest.mark.parametrize("choice", [{"prompt_name": "passage"}, {"prompt": "Represent this sentence: "}])
def test_named_and_raw_prompts_match_reference(model, choice):
    path, server = model
    inputs = texts()
    ours, _ = embed(server.url, inputs, **choice)
    cos = cosines(ours, st_reference(path, inputs, **choice))
    print(f"\n{choice}: min cosine vs sentence-transformers = {cos.min():.8f}")
    assert cos.min() >= 0.99999


def test_usage_and_tokenize_include_the_prompt(model, tokenizer):
    _, server = model
    inputs = ["what is a vector?", "embeddings map text to points"]
    _, body = embed(server.url, inputs)
    expected = [tokenizer(PROMPTS["query"] + t).input_ids for t in inputs]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in expected)
    r = post(server, "/tokenize", {"input": inputs})
    assert [d["tokens"] for d in r.json()["data"]] == expected
    r = post(server, "/tokenize", {"input": inputs, "prompt_name": "passage"})
    assert [d["tokens"] for d in r.json()["data"]] == [
        tokenizer(PROMPTS["passage"] + t).input_ids for t in inputs
    ]
    info = httpx.get(server.url + "/info").json()
    assert info["default_prompt_name"] == "query" and set(PROMPTS) <= set(info["prompts"])


def test_token_ids_get_no_prompt(model, tokenizer):
    """Token ids are embedded verbatim: the default prompt is not added to them."""
    _, server = model
    ids = tokenizer("plain text").input_ids
    from_ids, body = embed(server.url, ids)
    assert body["usage"]["prompt_tokens"] == len(ids)
    from_text, _ = embed(server.url, "plain text", prompt="")
    np.testing.assert_allclose(from_ids, from_text, atol=1e-5)


def test_left_truncation_keeps_the_prompt(model, tokenizer):
    _, server = model
    long_text = " ".join(f"w{i}" for i in range(300))
    r = post(server, "/tokenize", {"input": long_text, "truncation_direction": "left"})
    tokens = r.json()["data"][0]["tokens"]
    full = tokenizer(PROMPTS["query"] + long_text).input_ids
    head = 1 + len(tokenizer(PROMPTS["query"], add_special_tokens=False).input_ids)  # [CLS] + prompt
    assert len(tokens) == MAX_LENGTH
    assert tokens[:head] == full[:head] and tokens[head:] == full[len(full) - (MAX_LENGTH - head) :]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "prompt_name": "nope"}, "prompt_name"),
        ({"input": "x", "prompt_name": "query", "prompt": "raw: "}, "prompt"),
        ({"input": [101, 2000, 102], "prompt_name": "query"}, "prompt_name"),
        ({"input": [[101, 102]], "prompt": "raw: "}, "prompt"),
        ({"input": "x", "prompt_name": 3}, "prompt_name"),
        ({"input": "x", "prompt": ["a"]}, "prompt"),
    ],
)
def test_bad_prompts_are_400(model, body, param):
    _, server = model
    for route in ("/v1/embeddings", "/tokenize"):
        if route == "/tokenize" and not isinstance(body["input"], str):
            continue  # /tokenize takes text only
        r = post(server, route, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        if body.get("prompt_name") == "nope":
            assert "query" in error["message"] and "passage" in error["message"]
    assert post(server, "/v1/embeddings", {"input": "still serving"}).status_code == 200
