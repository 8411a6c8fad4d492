"""`embed_dtype` on /v1/embeddings, through a live server, against sentence-transformers' quantize_embeddings
(and numpy's float16, torch's bfloat16) applied to the same server's float32 vectors."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers.util.quantization import quantize_embeddings

from tests.server import read_corpus

TEXTS = read_corpus("queries.jsonl", 12) + read_corpus("passages.jsonl", 4)
STORAGE = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}
QUANTIZED = list(STORAGE)


def post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, **body}, timeout=120)


def embeddings(server, **body) -> list:
    r = post(server, **body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def floats(server, **body) -> np.ndarray:
    return np.array(embeddings(server, encoding_format="float", **body), dtype=np.float32)


def decoded(server, dtype, storage, **body) -> np.ndarray:
    rows = embeddings(server, encoding_format="base64", embed_dtype=dtype, **body)
    return np.stack([np.frombuffer(base64.b64decode(s), dtype=storage) for s in rows])


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("dimensions", [None, 128, 100])  # 100: bit types pad the last byte
def test_integer_and_bit_types_equal_quantize_embeddings(exact_server, dtype, dimensions):
    vectors = floats(exact_server, dimensions=dimensions)
    d = vectors.shape[1]
    ranges = np.array([[-1.0] * d, [1.0] * d], dtype=np.float32)  # the documented default
    reference = quantize_embeddings(vectors, dtype, ranges=ranges)
    as_json = np.array(
        embeddings(exact_server, encoding_format="float", embed_dtype=dtype, dimensions=dimensions)
    )
    assert as_json.dtype.kind == "i"  # JSON integers
    np.testing.assert_array_equal(as_json, reference)
    as_bytes = decoded(exact_server, dtype, STORAGE[dtype], dimensions=dimensions)
    np.testing.assert_array_equal(as_bytes, reference)
    if dtype.endswith("binary"):
        assert as_bytes.shape[1] == -(-d // 8)  # 128 dimensions -> 16 bytes, 100 -> 13


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_calibrated_ranges_equal_quantize_embeddings_with_calibration(exact_server, dtype):
    calibration = floats(exact_server)  # ranges from a calibration set, as sentence-transformers takes them
    lows, highs = calibration.min(axis=0), calibration.max(axis=0)
    texts = read_corpus("queries.jsonl", 40)[20:]
    r = httpx.post(exact_server.url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"})
    vectors = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    reference = quantize_embeddings(vectors, dtype, calibration_embeddings=calibration)
    body = {"input": texts, "encoding_format": "float", "embed_dtype": dtype}
    body["embed_ranges"] = [lows.tolist(), highs.tolist()]
    got = httpx.post(exact_server.url + "/v1/embeddings", json=body).json()["data"]
    np.testing.assert_array_equal(np.array([d["embedding"] for d in got]), reference)
    # One pair for every dimension is the same as that pair repeated.
    body["embed_ranges"] = [-0.25, 0.25]
    got = httpx.post(exact_server.url + "/v1/embeddings", json=body).json()["data"]
    d = vectors.shape[1]
    ranges = np.array([[-0.25] * d, [0.25] * d], dtype=np.float32)
    np.testing.assert_array_equal(
        np.array([g["embedding"] for g in got]), quantize_embeddings(vectors, dtype, ranges=ranges)
    )


def test_half_precision_types_round_the_float32_vectors(exact_server):
    vectors = floats(exact_server, dimensions=256)
    half = vectors.astype(np.float16)
    np.testing.assert_array_equal(
        np.array(
            embeddings(exact_server, encoding_format="float", embed_dtype="float16", dimensions=256),
            dtype=np.float16,
        ),
        half,
    )
    np.testing.assert_array_equal(decoded(exact_server, "float16", "<f2", dimensions=256), half)
    bf16 = torch.from_numpy(vectors).to(torch.bfloat16)
    as_json = torch.tensor(
        embeddings(exact_server, encoding_format="float", embed_dtype="bfloat16", dimensions=256),
        dtype=torch.float32,
    )
    assert torch.equal(as_json.to(torch.bfloat16), bf16) and torch.equal(
        as_json, bf16.float()
    )  # exact values
    bits = decoded(exact_server, "bfloat16", "<u2", dimensions=256)
    np.testing.assert_array_equal(bits, bf16.view(torch.int16).numpy().view(np.uint16))
    # float32 stays the default, and the same as asking for it.
    np.testing.assert_array_equal(floats(exact_server, dimensions=256, embed_dtype="float32"), vectors)


def test_openai_client_with_an_explicit_encoding_format(exact_server):
    client = openai.OpenAI(base_url=exact_server.url + "/v1", api_key="unused", max_retries=0)
    vectors = floats(exact_server, dimensions=128)
    reference = quantize_embeddings(vectors, "ubinary")
    kw = {
        "model": "all-MiniLM-L6-v2",
        "input": TEXTS,
        "dimensions": 128,
        "extra_body": {"embed_dtype": "ubinary"},
    }
    res = client.embeddings.create(encoding_format="base64", **kw)  # explicit: the client leaves it as sent
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype=np.uint8) for d in res.data])
    np.testing.assert_array_equal(got, reference)
    assert got.shape == (len(TEXTS), 16)
    res = client.embeddings.create(encoding_format="float", **kw)
    np.testing.assert_array_equal(np.array([d.embedding for d in res.data]), reference)
    # Left out, the client asks for base64 and reads the bytes as float32 whatever they are: 16 bytes come
    # back as 4 meaningless floats. docs/api.md says to pass encoding_format for any other embed_dtype.
    res = client.embeddings.create(**kw)
    assert [len(d.embedding) for d in res.data] == [4] * len(TEXTS)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"embed_dtype": "int4"}, "embed_dtype"),
        ({"embed_dtype": "binary", "embed_ranges": [-1, 1]}, "embed_ranges"),
        ({"embed_ranges": [-1, 1]}, "embed_ranges"),  # float32
        ({"embed_dtype": "int8", "embed_ranges": [1, -1]}, "embed_ranges"),
        ({"embed_dtype": "int8", "embed_ranges": [[-1] * 384, [1] * 383]}, "embed_ranges"),
        ({"embed_dtype": "int8", "embed_ranges": [[-1] * 384, [1] * 384], "dimensions": 128}, "embed_ranges"),
        ({"embed_dtype": "uint8", "embed_ranges": [-1, 1e39]}, "embed_ranges"),  # not a float32
        ({"embed_dtype": "uint8", "embed_ranges": [-1]}, "embed_ranges"),
    ],
)
def test_bad_combinations_are_400(exact_server, body, param):
    r = post(exact_server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
