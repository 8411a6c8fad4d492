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
