"""How many rows a CPU forward runs (models/loader.EmbeddingModel): a batch runs padded with dummy sequences
up to a step of token counts (ops/batch.padded_tokens) wherever oneDNN serves a matmul, so that it meets a
few shapes rather than a new one every batch; a bf16 batch short enough for the project's short-sequence
kernel (layers/linear.small_linear, which generates no code per shape) runs its own rows only, and every
vector is bit for bit what the padded forward gives (the padding rows were work for nothing). On the real
all-MiniLM-L6-v2, in bfloat16."""

from __future__ import annotations

import pytest
import torch

from embed_service.layers import linear
from embed_service.models.loader import EmbeddingModel
from embed_service.models.spec import load_spec
from embed_service.ops import fused, invariance
from embed_service.ops.batch import FlatBatch, padded_tokens
from embed_service.outputs import DENSE_ONLY


@pytest.fixture(scope="module")
def model(default_model_path):
    fused.configure("cpu")
    m = EmbeddingModel(load_spec(default_model_path), torch.bfloat16, torch.device("cpu")).eval()
    rows: list[int] = []
    m.model.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].input_ids.numel())))
    m.rows_run = rows  # type: ignore[attr-defined]  # the token rows of each forward of the body
    return m


def forward(model, lengths: list[int], seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """The dense vectors of a batch of random token ids of `lengths`, and the rows the body ran."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (sum(lengths),), generator=g)
    outs = model(FlatBatch.from_lengths(ids, lengths), [DENSE_ONLY] * len(lengths))
    return [torch.as_tensor(o.dense) for o in outs], model.rows_run[-1]


def padded_forward(model, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """The same batch as `forward`'s, run padded to its step as oneDNN's matmuls are."""
    pads = model._pads
    model._pads = lambda batch, tokens: batch.input_ids.device.type == "cpu"
    try:
        vectors, rows = forward(model, lengths, seed)
    finally:
        model._pads = pads
    assert rows == padded_tokens(sum(lengths))
    return vectors


@pytest.fixture(autouse=True)
def kernel():
    linear._small_kernel.cache_clear()
    if linear.small_rows() == 0:
        pytest.skip(
            "the short-sequence kernel runs only on a CPU with AMX tiles or AVX512-BF16 where it loads; on "
            "this one every matmul is oneDNN's and every CPU batch runs padded"
        )


def sequences(tokens: int) -> list[int]:
    """Lengths of `tokens` tokens in all, each within the model's 512 positions."""
    return [200] * (tokens // 200) + ([tokens % 200] if tokens % 200 else [])


def short_batches() -> list[list[int]]:
    rows = linear.small_rows()  # 4,096 as AVX512-BF16 dot products (256 past 2 threads), 16 on AMX tiles
    return [[1], sequences(rows), [2, *sequences(rows // 2 - 3), 3], sequences(rows - 1)]


def test_a_short_batch_runs_its_own_rows_and_gives_the_padded_forwards_vectors(model):
    for i, lengths in enumerate(short_batches()):
        vectors, rows = forward(model, lengths, seed=i)
        assert rows == sum(lengths), lengths
        for got, want in zip(vectors, padded_forward(model, lengths, seed=i)):
            assert torch.equal(got, want), lengths


def test_a_longer_batch_runs_padded_to_its_step(model):
    lengths = sequences(linear.small_rows() + 5)
    vectors, rows = forward(model, lengths)
    assert rows == padded_tokens(sum(lengths)) > sum(lengths)


def test_batch_invariance_keeps_the_padding(model):
    was = invariance.enabled()
    invariance.set_enabled(True)
    try:
        _, rows = forward(model, [17])
    finally:
        invariance.set_enabled(was)
    assert rows == padded_tokens(17) == 32


def test_int8_layers_keep_the_padding(default_model_path):
    fused.configure("cpu")
    m = EmbeddingModel(load_spec(default_model_path), torch.bfloat16, torch.device("cpu")).eval()
    assert linear.mark_int8(m.model) > 0
    rows: list[int] = []
    m.model.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].input_ids.numel())))
    m(FlatBatch.from_lengths(torch.arange(1000, 1017), [17]), [DENSE_ONLY])
    assert rows == [32]


def test_float32_keeps_the_padding(default_model_path):
    m = EmbeddingModel(load_spec(default_model_path), torch.float32, torch.device("cpu")).eval()
    rows: list[int] = []
    m.model.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].input_ids.numel())))
    m(FlatBatch.from_lengths(torch.arange(1000, 1017), [17]), [DENSE_ONLY])
    assert rows == [32]
