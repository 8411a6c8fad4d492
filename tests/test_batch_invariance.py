"""Batch invariance: a sequence's outputs are the same bytes whatever else was in its batch.

Hypothesis draws requests (sequences of random lengths and output kinds), batch budgets and how many run
at once, and sends them through the real Batcher onto two replicas computing in their own threads, each
one the worker's compute (FlatBatch.from_lengths, then the model) over a real model. Every output (dense,
sparse, ColBERT, scores) is compared byte for byte with the same sequence computed alone, in float32 and
in bfloat16, for an encoder with bge-m3's heads and a sentence-transformers Dense layer, a decoder
(last-token pooling) and a cross-encoder. The reference is the sequence alone: what a text's vector is
when nothing else is in flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embed_service.batching.batcher import Batcher
from embed_service.batching.sequence import RequestState, Sequence
from embed_service.models.loader import EmbeddingModel
from embed_service.models.spec import load_spec
from embed_service.ops import invariance
from embed_service.ops.batch import FlatBatch
from embed_service.outputs import COLBERT, DENSE, SCORE, SPARSE, OutputRequest
from tests.models.tiny import Tiny, build

ENCODER = dict(hidden_size=48, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2)
MODELS = {
    # mean pooling and a Dense layer after it (a float32 matmul over the pooled rows of a batch)
    "encoder": Tiny(
        "bert",
        "BertModel",
        lambda: T.BertConfig(**ENCODER, vocab_size=30522, max_position_embeddings=128),
        tokenizer="wordpiece",
        pooling="mean",
        max_seq_length=128,
        dense=((40, True),),
    ),
    "decoder": Tiny(
        "qwen2",
        "Qwen2Model",
        lambda: T.Qwen2Config(
            **ENCODER, num_key_value_heads=2, vocab_size=30522, max_position_embeddings=128, pad_token_id=0
        ),
        tokenizer="wordpiece",
        pooling="lasttoken",
        max_seq_length=128,
    ),
    "cross-encoder": Tiny(
        "bert-score",
        "BertForSequenceClassification",
        lambda: T.BertConfig(**ENCODER, vocab_size=30522, max_position_embeddings=128, num_labels=2),
        tokenizer="wordpiece",
    ),
}
KINDS = {"encoder": [DENSE, SPARSE, COLBERT], "decoder": [DENSE], "cross-encoder": [SCORE]}
BATCHES = {"count": 0}  # batches run through the property test, all models and dtypes


def _add_bge_m3_heads(path: Path, hidden: int) -> None:
    torch.manual_seed(1)
    torch.save({"weight": torch.randn(1, hidden) * 0.3, "bias": torch.randn(1)}, path / "sparse_linear.pt")
    torch.save({"weight": torch.randn(24, hidden) * 0.3, "bias": torch.randn(24)}, path / "colbert_linear.pt")


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_path) -> Iterator[dict[tuple[str, str], EmbeddingModel]]:
    # One compute thread per replica, as the server runs them on a CPU (two replicas of one thread each).
    threads, was = torch.get_num_threads(), invariance.enabled()
    torch.set_num_threads(1)
    invariance.set_enabled(True)  # --batch-invariant
    out = {}
    for name, tiny in MODELS.items():
        path = build(tiny, tmp_path_factory.mktemp(name), {"wordpiece": default_model_path})
        if name == "encoder":
            _add_bge_m3_heads(path, ENCODER["hidden_size"])
        spec = load_spec(path)
        for dtype in ("float32", "bfloat16"):
            out[name, dtype] = EmbeddingModel(spec, getattr(torch, dtype), torch.device("cpu")).eval()
    yield out
    torch.set_num_threads(threads)
    invariance.set_enabled(was)


def forward(model: EmbeddingModel, ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest]):
    """The worker's compute for one batch (workers/worker.py `run`)."""
    segments = [r.second_segment for r in requests]
    batch = FlatBatch.from_lengths(torch.from_numpy(ids), lengths.tolist(), segments)
    return model(batch, requests)


def compute(model: EmbeddingModel):
    """A replica's compute as the batcher calls it, counting the batches."""

    def run(ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest]):
        with lock:
            BATCHES["count"] += 1
        return forward(model, ids, lengths, requests)

    lock = threading.Lock()
    return run


def output_bytes(out) -> tuple:
    sparse = None if out.sparse is None else (out.sparse.indices.tobytes(), out.sparse.values.tobytes())
    return tuple(None if v is None else v.tobytes() for v in (out.dense, out.colbert, out.score)) + (sparse,)


def alone(model: EmbeddingModel, ids: list[int], request: OutputRequest) -> tuple:
    lengths = np.array([len(ids)], dtype=np.int32)
    return output_bytes(forward(model, np.array(ids, dtype=np.int32), lengths, [request])[0])


sequence = st.lists(st.integers(1000, 30000), min_size=0, max_size=100).map(lambda ids: [101, *ids, 102])


@st.composite
def workload(draw, kinds: list[str]):
    """Requests (each: its sequences with their output requests), the batch budget, and how many of the
    requests are in flight together."""
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        seqs = draw(st.lists(sequence, min_size=1, max_size=8))
        wanted = draw(st.sets(st.sampled_from(kinds), min_size=1))
        second = draw(st.integers(0, 3))  # token type 1 from this position (a pair), when the model reads it
        requests.append([(ids, OutputRequest(frozenset(wanted), min(second, len(ids) - 1))) for ids in seqs])
    return requests, draw(st.sampled_from([128, 256, 1024])), draw(st.integers(1, len(requests)))


class Loop:
    """One event loop in a thread for a whole property test, the batchers started on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def serve(models_: list[EmbeddingModel], requests, budget: int, in_flight: int) -> list[list[tuple]]:
    batcher = Batcher([compute(m) for m in models_], budget, 64, "m")
    batcher.start()
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(in_flight)

    async def one(req):
        async with gate:
            state = RequestState()
            seqs = [Sequence(ids, loop.create_future(), state, o) for ids, o in req]
            batcher.submit(seqs, priority=len(seqs) == 1)
            return [output_bytes(r) for r in await asyncio.gather(*(s.future for s in seqs))]

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await batcher.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_do_not_depend_on_the_batch(models, name, dtype):
    model = models[name, dtype]
    refs: dict[tuple, tuple] = {}
    loop = Loop()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(workload(KINDS[name]))
    def check(work):
        requests, budget, in_flight = work
        # Two replicas with the same weights: the replica that serves must not matter either.
        got = loop.run(serve([model, model], requests, budget, in_flight))
        for req, outs in zip(requests, got):
            for (ids, request), out in zip(req, outs):
                key = (tuple(ids), request)
                if key not in refs:
                    refs[key] = alone(model, ids, request)
                assert out == refs[key], f"{len(ids)} tokens, {sorted(request.kinds)}: bytes differ"

    try:
        check()
    finally:
        loop.close()


def test_thousands_of_compositions_ran():
    """The property test above drove thousands of batches (runs after it in this module)."""
    if BATCHES["count"] == 0:
        pytest.skip("run with the property test (this checks its size)")
    assert BATCHES["count"] >= 1000, BATCHES["count"]
    print(f"{BATCHES['count']} batches compared")
