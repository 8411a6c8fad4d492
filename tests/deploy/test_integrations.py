"""LangChain's OpenAIEmbeddings against a live server, configured as docs/deployment.md says."""

from __future__ import annotations

import httpx
import numpy as np

from tests.server import ServerProcess

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["LangChain sends the texts themselves", "with the context-length check off", "a third one"]


def reference(server: ServerProcess, texts: list[str]) -> np.ndarray:
    body = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=60).json()
    return np.array([d["embedding"] for d in body["data"]])


def test_langchain_with_the_context_length_check_off(live_server):
    server = live_server
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    docs = np.array(embeddings.embed_documents(TEXTS))
    query = np.array(embeddings.embed_query(TEXTS[0]))
    ref = reference(server, TEXTS)
    assert docs.shape == ref.shape
    assert np.allclose(docs, ref, atol=1e-5)
    assert np.allclose(query, ref[0], atol=1e-5)


def test_langchain_with_the_check_on_sends_tiktoken_ids_that_embed_as_other_text(live_server, monkeypatch):
    """Why docs/deployment.md says to turn the check off: LangChain then sends tiktoken's token ids, which
    the server (rightly) takes as its own vocabulary's ids, and answers 200 with embeddings of other text.
    tiktoken's real encodings are downloaded on first use (no network here): a byte-level encoding stands
    in, its ids (0..255) inside this model's vocabulary like most of cl100k's would be."""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    ranks = {bytes([i]): i for i in range(256)}
    tiny = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: tiny)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny)
    embeddings = OpenAIEmbeddings(model=MODEL, base_url=live_server.url + "/v1", api_key="unused")
    sent_ids = np.array(embeddings.embed_documents(TEXTS))
    ref = reference(live_server, TEXTS)
    cosines = (sent_ids * ref).sum(axis=1)  # both unit length
    assert sent_ids.shape == ref.shape
    assert (cosines < 0.9).all(), cosines
