"""The official openai Python client, unchanged, against a live server on loopback."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.server import read_corpus


@pytest.fixture(scope="module")
def client(exact_server):
    return openai.OpenAI(base_url=exact_server.url + "/v1", api_key="unused", max_retries=0)


def float_path(url: str, texts: list[str], **kw) -> np.ndarray:
    r = httpx.post(url + "/v1/embeddings", json={"input": texts, "encoding_format": "float", **kw})
    assert r.status_code == 200
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_default_base64_path_decodes_to_the_float_path(client, exact_server):
    texts = read_corpus("queries.jsonl", 16)
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    np.testing.assert_array_equal(got, float_path(exact_server.url, texts))
    assert res.model == "all-MiniLM-L6-v2"
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0


def test_explicit_float_single_string_and_dimensions(client, exact_server):
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input="one string", encoding_format="float")
    assert len(res.data) == 1 and len(res.data[0].embedding) == 384
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a", "b"], dimensions=32)
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    np.testing.assert_allclose(got, float_path(exact_server.url, ["a", "b"], dimensions=32), atol=1e-7)


def test_token_id_input(client, exact_server):
    ids = httpx.post(exact_server.url + "/tokenize", json={"input": "token ids"}).json()["data"][0]["tokens"]
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids], encoding_format="float")
    np.testing.assert_allclose(
        res.data[0].embedding, float_path(exact_server.url, ["token ids"])[0], atol=1e-6
    )


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["all-MiniLM-L6-v2"]


def test_errors_surface_as_the_clients_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="no-such-model", input="x")
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=1000)
    assert e.value.body["param"] == "dimensions"
