"""Late chunking against the paper's algorithm, written here over transformers' last_hidden_state.

The reference (Günther et al. 2024, arXiv 2409.04701; their ``late_chunking``): the whole text through
transformers' BertModel once, in float32, with [CLS] and [SEP]; each chunk's vector is the mean of the
last hidden states of its tokens ([first, end) token positions from the tokenizer's offsets), then
normalized. The server's chunk vectors must match it to a cosine of 0.99999, alone and in a batch with
other documents.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import numpy as np
import pytest

from tests.engine import test_chunking
from tests.server import ServerProcess, read_corpus

MAX_LENGTH = 256  # the packaged MiniLM's max_seq_length
EXACT = 0.99999
hf = test_chunking.hf  # a fixture: MiniLM's tokenizer and BertModel in transformers, float32
QUANTIZED: tuple[tuple[Literal["int8", "ubinary"], int], ...] = (("int8", 1), ("ubinary", 0))  # dtype, steps


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--dtype", "float32") as s:
        yield s


@pytest.fixture(scope="module")
def document() -> str:
    """A passage of the suite's corpus that fits MiniLM's window (about 200 tokens)."""
    return " ".join(read_corpus("passages.jsonl", 4))[:900]


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the text's sentences (cut after each '. '), but one of whitespace only."""
    spans, start = [], 0
    for i, ch in enumerate(text):
        if ch == "." and (i + 1 == len(text) or text[i + 1] == " "):
            spans.append((start, i + 1))
            start = i + 1
    if start < len(text):
        spans.append((start, len(text)))
    return [(s, e) for s, e in spans if text[s:e].strip()]


def paper(hf, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[int]]:
    """The paper's late chunking: (S, D) chunk vectors (not normalized), and each chunk's token count.

    Token spans from the tokenizer's offsets: a chunk's tokens are those whose first character is in it."""
    import torch

    tok, model = hf
    enc = tok(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    special = set(tok.all_special_ids)
    ids = enc["input_ids"][0].tolist()
    token_spans = []
    for s, e in spans:
        inside = [t for t, (a, _) in enumerate(offsets) if ids[t] not in special and s <= a < e]
        token_spans.append((inside[0], inside[-1] + 1))
    with torch.no_grad():
        hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[0]
    pooled = np.stack([hidden[a:b].mean(0).numpy() for a, b in token_spans]).astype(np.float64)
    return pooled, [b - a for a, b in token_spans]


def post(server: ServerProcess, inputs, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"input": inputs, **kw}, timeout=300)


def chunk_vectors(item: dict) -> np.ndarray:
    return np.array([c["embedding"] for c in item["chunks"]], dtype=np.float64)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.min(np.sum(a * b, axis=1)))


def test_spans_match_the_papers_late_chunking(server, hf, document):
    spans = sentence_spans(document)
    assert len(spans) >= 4
    r = post(server, document, chunking={"mode": "late", "spans": [list(s) for s in spans]})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    ref, counts = paper(hf, document, spans)
    assert [(c["start"], c["end"], c["tokens"]) for c in item["chunks"]] == [
        (s, e, n) for (s, e), n in zip(spans, counts)
    ]
    assert min_cosine(chunk_vectors(item), ref) >= EXACT
    # The input's own vector is its plain one (one forward pass gives both), and usage counts its tokens.
    plain = post(server, document).json()
    assert min_cosine(np.array([item["embedding"]]), np.array([plain["data"][0]["embedding"]])) >= EXACT
    assert r.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # Context matters: a chunk embedded alone is another vector.
    alone = post(server, document[spans[1][0] : spans[1][1]]).json()["data"][0]["embedding"]
    assert min_cosine(np.array([alone]), ref[1:2]) < 0.99


def test_spans_answer_in_their_order(server, hf, document):
    spans = sentence_spans(document)[:3][::-1]
    r = post(server, document, chunking={"mode": "late", "spans": [list(s) for s in spans]})
    ref, _ = paper(hf, document, spans)
    assert [(c["start"], c["end"]) for c in r.json()["data"][0]["chunks"]] == spans
    assert min_cosine(chunk_vectors(r.json()["data"][0]), ref) >= EXACT


def test_size_cut_chunks_match_the_paper_and_a_batch_changes_nothing(server, hf, document):
    tok, _ = hf
    size, overlap = 48, 8
    enc = tok(document, add_special_tokens=False, return_offsets_mapping=True)
    n, offsets = len(enc["input_ids"]), enc["offset_mapping"]
    bounds = size_bounds(n, size, overlap)
    spans = [(offsets[a][0], offsets[b - 1][1]) for a, b in bounds]
    options = {"mode": "late", "size": size, "overlap": overlap}
    alone = post(server, document, chunking=options)
    assert alone.status_code == 200, alone.text
    item = alone.json()["data"][0]
    assert [(c["start"], c["end"], c["tokens"]) for c in item["chunks"]] == [
        (a, b, t - s) for (a, b), (s, t) in zip(spans, bounds)
    ]
    # The reference: token spans [1 + a, 1 + b) of the sequence ([CLS] first); chunks may share tokens.
    import torch

    x = tok(document, return_tensors="pt")
    with torch.no_grad():
        hidden = hf[1](**x).last_hidden_state[0]
    ref = np.stack([hidden[1 + a : 1 + b].mean(0).numpy() for a, b in bounds])
    assert min_cosine(chunk_vectors(item), ref) >= EXACT
    # Batch invariance: with other documents in the request, and beside concurrent requests.
    others = [p[:600] for p in read_corpus("passages.jsonl", 12)[5:9]]
    batched = post(server, [others[0], document, *others[1:]], chunking=options)
    assert batched.status_code == 200, batched.text
    assert min_cosine(chunk_vectors(batched.json()["data"][1]), chunk_vectors(item)) >= EXACT
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda t: post(server, t, chunking=options), [document, *others[:3]] * 2))
    for a in answers[::4]:
        assert min_cosine(chunk_vectors(a.json()["data"][0]), chunk_vectors(item)) >= EXACT


def test_dimensions_normalization_and_dtypes_apply_to_chunk_vectors(server, hf, document):
    cut = sentence_spans(document)[:3]
    ref, _ = paper(hf, document, cut)
    options = {"mode": "late", "spans": [list(s) for s in cut]}
    r = post(server, document, chunking=options, dimensions=64, normalize=False).json()["data"][0]
    got = chunk_vectors(r)
    assert got.shape == (3, 64)
    assert min_cosine(got, ref[:, :64]) >= EXACT
    np.testing.assert_allclose(got, ref[:, :64], atol=1e-5)  # the first 64 features, not normalized
    # The compact encodings as sentence-transformers quantizes the reference (int8: to one bucket).
    from sentence_transformers.util.quantization import quantize_embeddings

    ranges = np.array([[-1.0] * 384, [1.0] * 384])
    for dtype, tolerance in QUANTIZED:
        b64 = post(server, document, chunking=options, encoding_format="base64", embed_dtype=dtype).json()
        kind = np.int8 if dtype == "int8" else np.uint8
        rows = [np.frombuffer(base64.b64decode(c["embedding"]), kind) for c in b64["data"][0]["chunks"]]
        unit = (ref / np.linalg.norm(ref, axis=1, keepdims=True)).astype(np.float32)
        want = np.asarray(quantize_embeddings(unit, dtype, ranges=ranges), np.int16)
        assert np.abs(np.array(rows, dtype=np.int16) - want).max() <= tolerance, dtype


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[0, 10_000]], "chunking.spans[0] = [0, 10000] is out of range"),
        ([[5, 5]], "chunking.spans[0] = [5, 5] is empty"),
        ([[0, 40], [30, 60]], "chunking.spans[0] = [0, 40] and chunking.spans[1] = [30, 60] overlap"),
        ([[8, 4]], "chunking.spans[0] = [8, 4] is out of range"),
    ],
)
def test_a_bad_span_is_a_400_naming_it(server, document, spans, message):
    r = post(server, document, chunking={"mode": "late", "spans": spans})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chunking.spans" and message in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ["a b", "c d"], "chunking": {"mode": "late", "spans": [[0, 1]]}}, "chunking.spans"),
        ({"input": ["a b"], "chunking": {"mode": "late"}}, "chunking"),
        ({"input": ["a b"], "chunking": {"mode": "late", "size": 4, "overlap": 4}}, "chunking.overlap"),
        ({"input": ["a b"], "chunking": {"spans": [[0, 1]]}}, "chunking.mode"),
        # A malformed span fails the schema: the message names it (the param is the top-level field).
        ({"input": ["a b"], "chunking": {"mode": "late", "spans": [[0, 1.5]]}}, "chunking"),
        ({"input": ["a b"], "chunking": {"mode": "late", "spans": [[0, -1]]}}, "chunking"),
    ],
)
def test_a_bad_late_chunking_request_is_a_400(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert "chunking" in r.json()["error"]["message"], r.json()


def size_bounds(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[first, end) text tokens of each size-cut chunk: `size` tokens, `size - overlap` apart."""
    bounds, s = [], 0
    while True:
        bounds.append((s, min(s + size, n)))
        if s + size >= n:
            return bounds
        s += size - overlap


@pytest.mark.parametrize("context", [0, 32])
def test_a_document_past_the_window_matches_the_papers_long_late_chunking(server, hf, context):
    """The paper's code (`_embed_with_overlap`): the whole sequence, [CLS] and [SEP] at its ends only, cut
    into windows of 256 tokens `256 - context` apart; the token vectors of the first window, then of each
    next one without its first `context` tokens, concatenated; each chunk the mean of its tokens'."""
    import torch

    tok, model = hf
    long = " ".join(read_corpus("passages.jsonl", 12))[:3000]
    x = tok(long, return_tensors="pt")["input_ids"]
    n = x.shape[1]
    assert n > 2 * MAX_LENGTH
    pieces = []
    with torch.no_grad():
        for start in range(0, n, MAX_LENGTH - context):
            w = x[:, start : start + MAX_LENGTH]
            hidden = model(input_ids=w, attention_mask=torch.ones_like(w)).last_hidden_state[0]
            pieces.append(hidden if start == 0 else hidden[context:])
    tokens = torch.cat(pieces)
    assert tokens.shape[0] == n
    bounds = size_bounds(n - 2, 64, 0)
    ref = np.stack([tokens[1 + a : 1 + b].mean(0).numpy() for a, b in bounds])
    r = post(server, long, chunking={"mode": "late", "size": 64, "context_overlap": context})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    assert len(item["chunks"]) == len(bounds)
    assert min_cosine(chunk_vectors(item), ref) >= EXACT
    # The input's own vector: the mean of all its token vectors.
    assert min_cosine(np.array([item["embedding"]]), tokens.mean(0).numpy()[None]) >= EXACT
    # Usage: every window's tokens (the windows the paper's loop runs that own a token).
    starts = range(0, n - context, MAX_LENGTH - context)
    assert r.json()["usage"]["prompt_tokens"] == sum(min(MAX_LENGTH, n - s) for s in starts)


def test_a_context_overlap_past_half_a_window_is_a_400(server):
    long = " ".join(read_corpus("passages.jsonl", 12))[:3000]
    r = post(server, long, chunking={"mode": "late", "size": 64, "context_overlap": 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunking.context_overlap", r.text
    assert post(server, long[:300], chunking={"mode": "late", "size": 32}).status_code == 200


def test_jinas_late_chunking_shape_answers_one_vector_per_input(server, hf, document):
    """``late_chunking: true``: the inputs are one document's consecutive chunks (joined as they are)."""
    spans = sentence_spans(document)
    chunks = [document[s:e] for s, e in spans]
    r = post(server, chunks, late_chunking=True)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(chunks)))
    ref, _ = paper(hf, document, spans)
    got = np.array([d["embedding"] for d in data], dtype=np.float64)
    assert min_cosine(got, ref) >= EXACT
    assert r.json()["usage"]["prompt_tokens"] == post(server, document).json()["usage"]["prompt_tokens"]
    both = post(server, chunks, late_chunking=True, chunking={"mode": "late", "size": 8})
    assert both.status_code == 400 and both.json()["error"]["param"] == "chunking"


def test_the_python_api_gives_the_servers_chunk_vectors(server, hf, document):
    from embed_service import Embedder

    spans = sentence_spans(document)
    ref, counts = paper(hf, document, spans)
    with Embedder(dtype="float32") as e:
        got = e.encode(document, chunking={"mode": "late", "spans": [list(s) for s in spans]})
        assert got.spans == [(s, t, n) for (s, t), n in zip(spans, counts)]
        assert min_cosine(got.vectors.astype(np.float64), ref) >= EXACT
        sized = e.encode([document, document[:300]], chunking={"mode": "late", "size": 40})
        http = post(server, [document, document[:300]], chunking={"mode": "late", "size": 40}).json()
        for mine, item in zip(sized, http["data"]):
            assert mine.spans == [(c["start"], c["end"], c["tokens"]) for c in item["chunks"]]
            assert min_cosine(mine.vectors.astype(np.float64), chunk_vectors(item)) >= EXACT
        jina = e.encode([document[s:t] for s, t in spans], late_chunking=True)
        assert jina.shape == (len(spans), 384)
        assert min_cosine(jina.astype(np.float64), ref) >= EXACT
        # Token-level outputs: every token's last hidden state, as transformers gives it.
        import torch

        with torch.no_grad():
            hidden = hf[1](**hf[0](document, return_tensors="pt")).last_hidden_state[0].numpy()
        tokens = e.encode(document, outputs=["tokens"])["tokens"]
        assert tokens.shape == hidden.shape
        assert min_cosine(tokens.astype(np.float64), hidden.astype(np.float64)) >= EXACT


def test_a_prompt_leads_the_sequence_and_the_spans_stay_in_the_text(server, hf, document):
    """With a prompt the sequence is [CLS] prompt text [SEP] (the prompt's tokens on their own); the spans
    are characters of the text, and its chunks pool the text's tokens only."""
    import torch

    tok, model = hf
    prompt, spans = "query: ", sentence_spans(document)[:3]
    head = [tok.cls_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]
    enc = tok(document, add_special_tokens=False, return_offsets_mapping=True)
    x = torch.tensor([head + enc["input_ids"] + [tok.sep_token_id]])
    with torch.no_grad():
        hidden = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0]
    starts = [a for a, _ in enc["offset_mapping"]]
    ref = []
    for s, e in spans:
        inside = [t for t, a in enumerate(starts) if s <= a < e]
        ref.append(hidden[len(head) + inside[0] : len(head) + inside[-1] + 1].mean(0).numpy())
    r = post(server, document, prompt=prompt, chunking={"mode": "late", "spans": [list(s) for s in spans]})
    assert r.status_code == 200, r.text
    assert min_cosine(chunk_vectors(r.json()["data"][0]), np.array(ref, dtype=np.float64)) >= EXACT


def test_jinas_shape_names_the_input_that_holds_no_token(server):
    r = post(server, ["Berlin is a city.", "   ", "It grew."], late_chunking=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input"
    assert "input 1 holds no token" in r.json()["error"]["message"]


def test_late_chunking_passes_through_front_end_processes(hf, document):
    """With --http-processes 2 the front ends hand late chunking to the engine process, unchanged."""
    spans = sentence_spans(document)
    ref, _ = paper(hf, document, spans)
    with ServerProcess("--dtype", "float32", "--http-processes", "2") as s:
        for _ in range(2):  # either front end
            r = post(s, document, chunking={"mode": "late", "spans": [list(x) for x in spans]})
            assert r.status_code == 200, r.text
            assert min_cosine(chunk_vectors(r.json()["data"][0]), ref) >= EXACT
            jina = post(s, [document[a:b] for a, b in spans], late_chunking=True)
            got = np.array([d["embedding"] for d in jina.json()["data"]], dtype=np.float64)
            assert min_cosine(got, ref) >= EXACT


@pytest.fixture(scope="module")
def modernbert_dense(tmp_path_factory, default_model_path):
    """A tiny random ModernBERT (local and global attention layers, a 512-token window) with CLS pooling
    and a Dense layer after it: its folder, transformers' tokenizer and model (float32), and
    sentence-transformers' Dense module."""
    from dataclasses import replace

    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from tests.models.test_families import CASES
    from tests.models.tiny import build

    modernbert = next(c for c in CASES if c.name == "modernbert")
    tiny = replace(modernbert, max_seq_length=512, pooling="cls", normalize=False, dense=((24, True),))
    path = build(tiny, tmp_path_factory.mktemp("late-modernbert"), {"wordpiece": default_model_path})
    reference = (
        AutoTokenizer.from_pretrained(str(path)),
        AutoModel.from_pretrained(str(path), dtype=torch.float32),
    )
    return path, reference, SentenceTransformer(str(path), device="cpu")[2]


def dense_head(dense, means: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        x = torch.tensor(means, dtype=torch.float32)
        return dense({"sentence_embedding": x})["sentence_embedding"].numpy().astype(np.float64)


def chunk_windows(rows: list[tuple[int, int]], n: int, window: int, context: int) -> list[tuple[int, int]]:
    """docs/api.md's long late chunking for a model with Dense layers: in the order of the chunks' first
    tokens, a window opens for each chunk that no window holds yet, `context` tokens before it (from 0 when
    that reaches [CLS]; at most `window` tokens before the sequence's end), `window` tokens long."""
    bounds: list[tuple[int, int]] = []
    for a, b in sorted(rows):
        if any(s <= a and b <= e for s, e in bounds):
            continue
        start = 0 if a - context <= 1 else a - context
        start = max(b - window, min(start, n - window))
        bounds.append((start, min(n, start + window)))
    return bounds


def test_a_tiny_random_modernbert_with_a_long_window_cls_pooling_and_a_dense_layer(modernbert_dense):
    """Spans of a ~400-token text pool by the mean (the paper's), then the Dense layer, as
    sentence-transformers' Dense module applies it."""
    path, reference, dense = modernbert_dense
    text = " ".join(read_corpus("passages.jsonl", 12))[:1600]
    n = len(reference[0](text)["input_ids"])
    assert MAX_LENGTH < n <= 512
    spans = sentence_spans(text)
    means, counts = paper(reference, text, spans)
    ref = dense_head(dense, means)
    with ServerProcess("--model", str(path), "--dtype", "float32") as s:
        r = post(s, text, chunking={"mode": "late", "spans": [list(x) for x in spans]})
        assert r.status_code == 200, r.text
        item = r.json()["data"][0]
        assert [c["tokens"] for c in item["chunks"]] == counts
        got = chunk_vectors(item)
        assert got.shape == (len(spans), 24)
        assert min_cosine(got, ref) >= EXACT


@pytest.mark.parametrize("context", [0, 48])
def test_long_late_chunking_with_a_dense_layer_pools_each_chunk_from_one_window(modernbert_dense, context):
    """A text past the 512-token window: each chunk the mean of its tokens' last hidden states in one
    window of the whole sequence (transformers, windows as docs/api.md lays them out), then the Dense
    layer; the input's own vector the windows' vectors (the mean of the tokens each adds, then the Dense
    layer) weighted by those tokens."""
    import torch

    path, (tok, model), dense = modernbert_dense
    text = " ".join(read_corpus("passages.jsonl", 12))[:5000]
    x = tok(text, return_tensors="pt")["input_ids"]
    n = x.shape[1]
    assert n > 2 * 512
    size = 100
    rows = [(1 + a, 1 + b) for a, b in size_bounds(n - 2, size, 10)]  # [CLS] first
    bounds = chunk_windows(rows, n, 512, context)
    with torch.no_grad():
        hidden = [
            model(input_ids=x[:, s:e], attention_mask=torch.ones_like(x[:, s:e])).last_hidden_state[0]
            for s, e in bounds
        ]
    means = []
    for a, b in rows:
        j = next(j for j, (s, e) in enumerate(bounds) if s <= a and b <= e)
        means.append(hidden[j][a - bounds[j][0] : b - bounds[j][0]].mean(0).numpy())
    ref = dense_head(dense, np.stack(means))
    adds = [(max(s, bounds[j - 1][1]) if j else s, e) for j, (s, e) in enumerate(bounds)]
    windows = np.stack(
        [h[lo - s : hi - s].mean(0).numpy() for h, (s, _), (lo, hi) in zip(hidden, bounds, adds)]
    )
    weights = np.array([hi - lo for lo, hi in adds], dtype=np.float64)
    own = (weights / weights.sum()) @ dense_head(dense, windows)
    with ServerProcess("--model", str(path), "--dtype", "float32") as s:
        options = {"mode": "late", "size": size, "overlap": 10, "context_overlap": context}
        r = post(s, text, chunking=options)
        assert r.status_code == 200, r.text
        item = r.json()["data"][0]
        assert [c["tokens"] for c in item["chunks"]] == [b - a for a, b in rows]
        assert min_cosine(chunk_vectors(item), ref) >= EXACT
        assert min_cosine(np.array([item["embedding"]]), own[None]) >= EXACT
        assert r.json()["usage"]["prompt_tokens"] == sum(e - s for s, e in bounds)
        # A chunk longer than the window is refused, naming the size.
        big = post(s, text, chunking={"mode": "late", "size": 600})
        assert big.status_code == 400 and big.json()["error"]["param"] == "chunking.size", big.text


def test_a_null_model_server_answers_late_chunking(hf, document):
    """EMBED_NULL_MODEL (benchmarks' measuring tool) answers late chunking as the model would shape it: a
    unit vector per chunk with the chunks' spans and tokens, short and long documents alike."""
    spans = sentence_spans(document)
    _, counts = paper(hf, document, spans)
    long = " ".join(read_corpus("passages.jsonl", 12))[:3000]
    with ServerProcess("--dtype", "float32", env={"EMBED_NULL_MODEL": "1"}) as s:
        r = post(s, document, chunking={"mode": "late", "spans": [list(x) for x in spans]})
        assert r.status_code == 200, r.text
        item = r.json()["data"][0]
        assert [(c["start"], c["end"], c["tokens"]) for c in item["chunks"]] == [
            (a, b, k) for (a, b), k in zip(spans, counts)
        ]
        np.testing.assert_allclose(np.linalg.norm(chunk_vectors(item), axis=1), 1.0, rtol=1e-6)
        r = post(s, long, chunking={"mode": "late", "size": 64, "context_overlap": 32})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["chunks"]) == len(
            size_bounds(len(hf[0](long)["input_ids"]) - 2, 64, 0)
        )
        jina = post(s, [document[a:b] for a, b in spans], late_chunking=True)
        assert jina.status_code == 200 and len(jina.json()["data"]) == len(spans), jina.text


def test_cohere_v2_embed_takes_late_chunking(server, hf, document):
    """The cohere client's /v2/embed with the same ``chunking`` object (sent as an additional body
    parameter) answers each text's chunks (``chunks``: start, end, tokens and the vector per embedding
    type), and with ``late_chunking: true`` one vector per text, each equal to the paper's."""
    import cohere

    spans = sentence_spans(document)
    ref, counts = paper(hf, document, spans)
    client = cohere.ClientV2(base_url=server.url, api_key="unused", timeout=120)
    options = {"mode": "late", "spans": [list(s) for s in spans]}
    r = client.embed(
        texts=[document],
        model="all-MiniLM-L6-v2",
        input_type="classification",  # the packaged model has no prompt for it: the plain sequence
        embedding_types=["float", "int8"],
        request_options={"additional_body_parameters": {"chunking": options}},
    )
    assert r.embeddings.float_ is not None
    plain = post(server, document).json()["data"][0]["embedding"]
    assert min_cosine(np.array(r.embeddings.float_), np.array([plain])) >= EXACT
    chunks = r.chunks[0]  # type: ignore[attr-defined]  (an extension: the client keeps unknown fields)
    assert [(c["start"], c["end"], c["tokens"]) for c in chunks] == [
        (s, e, n) for (s, e), n in zip(spans, counts)
    ]
    assert min_cosine(np.array([c["embeddings"]["float"] for c in chunks], dtype=np.float64), ref) >= EXACT
    from sentence_transformers.util.quantization import quantize_embeddings

    unit = (ref / np.linalg.norm(ref, axis=1, keepdims=True)).astype(np.float32)
    want = np.asarray(
        quantize_embeddings(unit, "int8", ranges=np.array([[-1.0] * 384, [1.0] * 384])), np.int16
    )
    got = np.array([c["embeddings"]["int8"] for c in chunks], dtype=np.int16)
    assert np.abs(got - want).max() <= 1
    jina = client.embed(
        texts=[document[s:e] for s, e in spans],
        model="all-MiniLM-L6-v2",
        input_type="classification",
        embedding_types=["float"],
        request_options={"additional_body_parameters": {"late_chunking": True}},
    )
    assert min_cosine(np.array(jina.embeddings.float_, dtype=np.float64), ref) >= EXACT
    with pytest.raises(cohere.BadRequestError, match="chunking.spans"):
        client.embed(
            texts=[document],
            model="all-MiniLM-L6-v2",
            input_type="classification",
            embedding_types=["float"],
            request_options={
                "additional_body_parameters": {"chunking": {"mode": "late", "spans": [[0, 10**6]]}}
            },
        )


def test_token_outputs_are_transformers_last_hidden_state(server, hf, document):
    """``outputs: ["tokens"]`` on /v1/embeddings and TEI's /embed_all answer every token's last hidden
    state (special tokens included), as transformers gives it, beside the dense vector when asked."""
    import torch

    tok, model = hf
    texts = [document, "Berlin is a city."]
    refs = []
    with torch.no_grad():
        for t in texts:
            refs.append(model(**tok(t, return_tensors="pt")).last_hidden_state[0].numpy().astype(np.float64))
    r = post(server, texts, outputs=["dense", "tokens"])
    assert r.status_code == 200, r.text
    plain = post(server, texts).json()["data"]
    for item, ref, p in zip(r.json()["data"], refs, plain):
        got = np.array(item["tokens"], dtype=np.float64)
        assert got.shape == ref.shape
        assert min_cosine(got, ref) >= EXACT
        assert min_cosine(np.array([item["embedding"]]), np.array([p["embedding"]])) >= EXACT
    b64 = post(server, texts[1], outputs=["tokens"], encoding_format="base64").json()["data"][0]
    rows = np.stack([np.frombuffer(base64.b64decode(x), "<f4") for x in b64["tokens"]])
    assert min_cosine(rows.astype(np.float64), refs[1]) >= EXACT
    tei = httpx.post(server.url + "/embed_all", json={"inputs": texts}, timeout=120)
    assert tei.status_code == 200, tei.text
    for got, ref in zip(tei.json(), refs):
        assert min_cosine(np.array(got, dtype=np.float64), ref) >= EXACT
    one = httpx.post(server.url + "/embed_all", json={"inputs": texts[1]}, timeout=120).json()
    assert len(one) == 1 and len(one[0]) == len(refs[1])
    # The token vectors are float32 as they are: a compact embed_dtype is a 400, as for ColBERT vectors.
    bad = post(server, texts, outputs=["tokens"], embed_dtype="int8")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "embed_dtype", bad.text
