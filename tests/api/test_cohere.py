"""The official cohere client, unchanged, against /v2/embed and /v1/embed on a live server: the same
vectors as the server's own /v1/embeddings, the same codes as sentence-transformers' quantize_embeddings.

The model: the packaged all-MiniLM-L6-v2's files, with a config_sentence_transformers.json that names a
query, a document and a clustering prompt (and no default), so input_type has prompts to select.
"""

from __future__ import annotations

import base64
import json

import cohere
import httpx
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from tests.server import ServerProcess, read_corpus

PROMPTS = {"query": "query: ", "document": "passage: ", "clustering": "cluster: "}
KEY = "cohere-test-key"
TEXTS = read_corpus("queries.jsonl", 6) + read_corpus("passages.jsonl", 2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("minilm-prompts") / "minilm-prompts"
    path.mkdir()
    for item in default_model_path.iterdir():
        if item.name != "config_sentence_transformers.json":
            (path / item.name).symlink_to(item)
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    with ServerProcess(
        "--model",
        str(path),
        "--served-model-name",
        "minilm",
        "--dtype",
        "float32",
        "--max-client-batch-size",
        "16",
        env={"EMBED_API_KEY": KEY},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=120)


def openai_floats(server, texts, **body) -> np.ndarray:
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": texts, "encoding_format": "float", **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


@pytest.mark.parametrize(
    "input_type, prompt_name",
    [("search_query", "query"), ("search_document", "document"), ("clustering", "clustering")],
)
def test_input_type_selects_the_models_prompt(client, server, input_type, prompt_name):
    res = client.embed(model="minilm", texts=TEXTS, input_type=input_type, embedding_types=["float"])
    got = np.array(res.embeddings.float_, dtype=np.float32)
    np.testing.assert_array_equal(got, openai_floats(server, TEXTS, prompt_name=prompt_name))
    assert not np.allclose(got, openai_floats(server, TEXTS))  # the prompt made a difference
    assert res.texts == TEXTS and res.id
    tokens = httpx.post(
        server.url + "/tokenize",
        json={"input": TEXTS, "prompt_name": prompt_name},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["data"]
    assert res.meta.billed_units.input_tokens == sum(t["count"] for t in tokens)


def test_no_matching_prompt_embeds_without_one(client, server):
    res = client.embed(model="minilm", texts=TEXTS, input_type="classification")
    np.testing.assert_array_equal(
        np.array(res.embeddings.float_, dtype=np.float32), openai_floats(server, TEXTS)
    )


def test_every_embedding_type_at_once_with_output_dimension(client, server):
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    res = client.embed(
        model="minilm", texts=TEXTS, input_type="search_document", embedding_types=types, output_dimension=128
    )
    floats = openai_floats(server, TEXTS, prompt_name="document", dimensions=128)
    e = res.embeddings
    np.testing.assert_array_equal(np.array(e.float_, dtype=np.float32), floats)
    d = floats.shape[1]
    ranges = np.array([[-1.0] * d, [1.0] * d], dtype=np.float32)
    for name in ("int8", "uint8"):
        np.testing.assert_array_equal(
            np.array(getattr(e, name)), quantize_embeddings(floats, name, ranges=ranges)
        )
    for name in ("binary", "ubinary"):
        got = np.array(getattr(e, name))
        np.testing.assert_array_equal(got, quantize_embeddings(floats, name))
        assert got.shape == (len(TEXTS), 16)
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64])
    np.testing.assert_array_equal(decoded, floats)


def test_truncate_start_end_and_none(client, server):
    long = " ".join(read_corpus("passages.jsonl", 40))  # far past 256 tokens
    end = client.embed(model="minilm", texts=[long], input_type="search_query", truncate="END")
    start = client.embed(model="minilm", texts=[long], input_type="search_query", truncate="START")
    right = openai_floats(server, [long], prompt_name="query", truncate=True, truncation_direction="right")
    left = openai_floats(server, [long], prompt_name="query", truncate=True, truncation_direction="left")
    np.testing.assert_array_equal(np.array(end.embeddings.float_, dtype=np.float32), right)
    np.testing.assert_array_equal(np.array(start.embeddings.float_, dtype=np.float32), left)
    assert not np.allclose(right, left)
    with pytest.raises(cohere.BadRequestError) as e:
        client.embed(model="minilm", texts=[long], input_type="search_query", truncate="NONE")
    assert "tokens" in e.value.body["error"]["message"]


def test_inputs_of_text_parts(client):
    parts = [{"content": [{"type": "text", "text": t}]} for t in TEXTS[:3]]
    by_inputs = client.embed(
        model="minilm", inputs=parts, input_type="search_query", embedding_types=["float"]
    )
    by_texts = client.embed(
        model="minilm", texts=TEXTS[:3], input_type="search_query", embedding_types=["float"]
    )
    assert by_inputs.embeddings.float_ == by_texts.embeddings.float_


def test_v1_client(server):
    v1 = cohere.Client(base_url=server.url, api_key=KEY, timeout=120)
    res = v1.embed(model="minilm", texts=TEXTS, input_type="search_query")
    assert res.response_type == "embeddings_floats"
    np.testing.assert_array_equal(
        np.array(res.embeddings, dtype=np.float32), openai_floats(server, TEXTS, prompt_name="query")
    )
    res = v1.embed(model="minilm", texts=TEXTS, input_type="search_query", embedding_types=["ubinary"])
    assert res.response_type == "embeddings_by_type"
    np.testing.assert_array_equal(
        np.array(res.embeddings.ubinary),
        quantize_embeddings(openai_floats(server, TEXTS, prompt_name="query"), "ubinary"),
    )


def test_errors_raise_the_clients_exceptions(client, server):
    with pytest.raises(cohere.NotFoundError):
        client.embed(model="no-such-model", texts=["x"], input_type="search_query")
    with pytest.raises(cohere.UnauthorizedError):
        cohere.ClientV2(base_url=server.url, api_key="wrong").embed(
            model="minilm", texts=["x"], input_type="search_query"
        )
    bad = [
        ({"output_dimension": 1000}, "output_dimension"),
        ({"input_type": "image"}, "input_type"),
        ({"embedding_types": ["float"], "max_tokens": 8}, "max_tokens"),
        ({"embedding_types": ["int4"]}, "embedding_types"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
    ]
    for kw, param in bad:
        with pytest.raises(cohere.BadRequestError) as e:
            client.embed(model="minilm", texts=["x"], **{"input_type": "search_query", **kw})
        assert e.value.body["error"]["param"] == param, (kw, e.value.body)
    for body, param in [
        ({"texts": ["x"], "inputs": [{"content": [{"type": "text", "text": "x"}]}]}, "texts"),
        ({}, "texts"),
        ({"inputs": [{"content": [{"type": "image_url"}]}]}, "inputs"),
        ({"texts": ["x"], "embedding_types": ["float"], "embed_ranges": [-1, 1]}, "embed_ranges"),
        ({"texts": ["x"], "embedding_types": ["int8"], "embed_ranges": [[-1], [1]]}, "embed_ranges"),
    ]:
        r = httpx.post(server.url + "/v2/embed", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_the_same_admission_as_v1_embeddings(client, server):
    too_many = ["x"] * 17  # past --max-client-batch-size 16
    with pytest.raises(cohere.BadRequestError) as e:
        client.embed(model="minilm", texts=too_many, input_type="search_query")
    r = httpx.post(
        server.url + "/v1/embeddings", json={"input": too_many}, headers={"Authorization": f"Bearer {KEY}"}
    )
    # The same refusal, its param naming each route's own field.
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert e.value.body == {"error": {**r.json()["error"], "param": "texts"}}
