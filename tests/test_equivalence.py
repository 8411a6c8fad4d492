"""The default model, served in float32, against SentenceTransformer.encode: the reference users compare with."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.server import read_corpus

# Hand-picked cases beside the corpora: emoji, CJK, whitespace-heavy, one token, far past the max length.
EDGE_TEXTS = [
    "🙂🚀 emoji 👩‍👩‍👧 mixed with text ✨",
    "向量检索服务的嵌入模型",
    "日本語のテキスト埋め込み",
    "   lots\t\tof \n\n whitespace    between\u3000words   ",
    "a",
    " ".join(["token"] * 2000),
    "Ünïcödé àçcénts ß œ ø",
]


@pytest.fixture(scope="module")
def reference(default_model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_path), device="cpu")


def embed(url: str, inputs, **kw) -> tuple[np.ndarray, dict]:
    r = httpx.post(
        url + "/v1/embeddings", json={"input": inputs, "encoding_format": "float", **kw}, timeout=300
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32), body


def embed_many(url: str, texts: list[str], per_request: int = 100) -> np.ndarray:
    return np.concatenate(
        [embed(url, texts[i : i + per_request])[0] for i in range(0, len(texts), per_request)]
    )


# The whole of each file (tests/data/make_corpus.py): what varies the code path is the token count, and
# these cover every padding step from 3 to 256 tokens and a third of the passages past it (truncated).
@pytest.mark.parametrize("corpus, n", [("queries.jsonl", 300), ("passages.jsonl", 150)])
def test_matches_sentence_transformers_on_corpus(exact_server, reference, corpus, n):
    texts = read_corpus(corpus, n) + EDGE_TEXTS
    ours = embed_many(exact_server.url, texts)
    ref = reference.encode(texts, batch_size=64, convert_to_numpy=True)
    assert ours.shape == ref.shape == (len(texts), 384)
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    worst = int(cos.argmin())
    print(f"\n{corpus}: min cosine vs sentence-transformers over {len(texts)} texts = {cos.min():.8f}")
    assert cos.min() >= 0.99999, f"text {worst} ({texts[worst][:80]!r}) has cosine {cos[worst]}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_usage_counts_the_reference_tokens(exact_server, reference):
    texts = read_corpus("passages.jsonl", 40) + EDGE_TEXTS
    _, body = embed(exact_server.url, texts)
    ids = reference.tokenizer(texts, truncation=True, max_length=reference.max_seq_length)["input_ids"]
    expected = sum(len(x) for x in ids)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_a_text_alone_equals_the_same_text_in_a_large_mixed_batch(exact_server):
    mixed = read_corpus("passages.jsonl", 150) + read_corpus("queries.jsonl", 150) + EDGE_TEXTS
    together = embed(exact_server.url, mixed)[0]
    for i in (0, 3, 160, len(mixed) - 2, len(mixed) - 1):
        alone = embed(exact_server.url, mixed[i])[0][0]
        np.testing.assert_allclose(alone, together[i], atol=1e-5, err_msg=f"text {i}")


def test_base64_decodes_to_the_float_result(exact_server):
    texts = read_corpus("queries.jsonl", 20)
    floats = embed(exact_server.url, texts)[0]
    r = httpx.post(exact_server.url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    assert r.status_code == 200
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    )
    np.testing.assert_array_equal(decoded, floats)


def test_token_ids_give_the_same_vectors_as_their_text(exact_server):
    texts = read_corpus("passages.jsonl", 5) + ["short one"]
    r = httpx.post(exact_server.url + "/tokenize", json={"input": texts})
    assert r.status_code == 200
    token_lists = [d["tokens"] for d in r.json()["data"]]
    from_text, text_body = embed(exact_server.url, texts)
    from_ids, ids_body = embed(exact_server.url, token_lists)
    np.testing.assert_allclose(from_ids, from_text, atol=1e-6)
    assert ids_body["usage"] == text_body["usage"]
    single, _ = embed(exact_server.url, token_lists[-1])  # a flat list of ids is one input
    np.testing.assert_allclose(single[0], from_text[-1], atol=1e-6)


def test_tokenize_returns_the_reference_ids_with_truncation(exact_server, reference):
    long_text = read_corpus("passages.jsonl", 150)[-1] * 20
    texts = ["hello world", long_text]
    r = httpx.post(exact_server.url + "/tokenize", json={"input": texts})
    assert r.status_code == 200
    expected = reference.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
    assert [d["tokens"] for d in r.json()["data"]] == expected
    assert [d["count"] for d in r.json()["data"]] == [len(x) for x in expected]


def test_left_truncation_keeps_the_end_of_the_text_and_the_special_tokens(exact_server, default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path), truncation_side="left")
    text = " ".join(f"word{i}" for i in range(600))
    r = httpx.post(exact_server.url + "/tokenize", json={"input": text, "truncation_direction": "left"})
    assert r.status_code == 200
    assert r.json()["data"][0]["tokens"] == tok(text, truncation=True, max_length=256)["input_ids"]
    left = embed(exact_server.url, text, truncation_direction="left")[0][0]
    right = embed(exact_server.url, text)[0][0]
    assert float(left @ right) < 0.999  # different halves of the text were embedded


def test_dimensions_returns_the_renormalized_prefix(exact_server):
    texts = ["matryoshka dimensions", "second text"]
    full = embed(exact_server.url, texts)[0]
    short, _ = embed(exact_server.url, texts, dimensions=64)
    assert short.shape == (2, 64)
    prefix = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short, prefix, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-6)


def test_normalize_false_returns_the_raw_pooled_vector(exact_server, reference):
    text = "an unnormalized mean-pooled vector"
    raw, _ = embed(exact_server.url, text, normalize=False)
    # The reference pipeline without its Normalize module: Transformer + Pooling.
    from sentence_transformers import SentenceTransformer

    unnormalized = SentenceTransformer(modules=[reference[0], reference[1]], device="cpu")
    ref = unnormalized.encode([text], convert_to_numpy=True)
    np.testing.assert_allclose(raw, ref, atol=1e-5)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3


def test_model_name_is_echoed_and_default_is_canonical(exact_server):
    _, body = embed(exact_server.url, "x", model="all-MiniLM-L6-v2")
    assert body["model"] == "all-MiniLM-L6-v2"
    _, body = embed(exact_server.url, "x")
    assert body["model"] == "all-MiniLM-L6-v2"
