"""Chunking's reach and its bound, on real servers: --chunk-long-inputs on a model without dense vectors
(a SPLADE model, against SparseEncoder), and the worst chunked request a client can send to a server with
the default limits (against the documented window formula over transformers' tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.models.test_splade import BERT, compare, reference, write_splade
from tests.server import ServerProcess, read_corpus


@pytest.fixture(scope="module")
def splade(tmp_path_factory, default_model_path) -> Iterator[tuple[Path, str]]:
    """A tiny SPLADE model (max length 64) served with --chunk-long-inputs."""
    path = write_splade(BERT, tmp_path_factory.mktemp("splade"), {"wordpiece": default_model_path})
    with ServerProcess("--model", str(path), "--dtype", "float32", "--chunk-long-inputs") as server:
        yield path, server.url


def test_the_chunking_flag_leaves_outputs_without_dense_vectors_as_they_are(splade):
    """--chunk-long-inputs chunks dense vectors only: a SPLADE model's sparse outputs, on /v1/embeddings and
    /embed_sparse, are SparseEncoder's, long texts truncated as it truncates them (was: every request a 400
    about chunking, `param: chunking`, a field the client never sent). A request that asks for chunking
    itself is still told that chunking averages dense vectors."""
    path, url = splade
    texts = read_corpus("queries.jsonl", 2) + ["\n\n".join(read_corpus("passages.jsonl", 3))]  # > 64 tokens
    ref = reference(path, texts)
    r = httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    rows = [dict(zip(d["sparse"]["indices"], d["sparse"]["values"])) for d in r.json()["data"]]
    compare(rows, ref)
    r = httpx.post(url + "/embed_sparse", json={"inputs": texts}, timeout=120)
    assert r.status_code == 200, r.text
    compare([{p["index"]: p["value"] for p in row} for row in r.json()], ref)
    r = httpx.post(url + "/v1/embeddings", json={"input": texts, "chunking": {}}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunking", r.text


def test_the_worst_chunked_request_is_refused_within_the_per_request_token_bound(
    exact_server, default_model_path
):
    """1015 texts of 8255 one-token characters with the largest overlap (8.4 MB, under the body limit, no
    server flag): 64 windows each, 16.6 M tokens, 31.7 times what an unchunked request may make (was: run,
    about 25 minutes of CPU). Refused with a 400 naming chunking and the figures, at the first text past
    --max-client-batch-size x max input length tokens, as documented; the server keeps serving."""
    from transformers import AutoTokenizer

    info = httpx.get(exact_server.url + "/info").json()
    budget = info["max_client_batch_size"] * info["max_input_length"]
    text = ("1." * 4200)[:8255]
    overlap = 127
    tok = AutoTokenizer.from_pretrained(str(default_model_path))
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    room = info["max_input_length"] - 2  # [CLS] and [SEP]
    windows = 1 + math.ceil((n - room) / (room - overlap))  # docs/api.md, long inputs
    per_input = n + 2 * windows + (windows - 1) * overlap  # every window with its special tokens
    assert windows == info["max_chunks_per_input"] and 1015 * per_input > 31 * budget
    first = budget // per_input + 1  # the text whose windows pass the budget
    body = {"input": [text] * 1015, "chunking": {"overlap": overlap}}
    r = httpx.post(exact_server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(
        f"with chunking, the first {first} inputs make {first * per_input} tokens in {first * windows} "
        f"windows, more than the {budget} tokens one request may make"
    ), message
    # One of those texts alone is served: its windows make the tokens counted above.
    body = {"input": text, "chunking": {"overlap": overlap}}
    r = httpx.post(exact_server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] == per_input
