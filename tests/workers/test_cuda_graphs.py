"""CUDA graphs per token-count step (workers/graphs.py), everything but the capture itself, on a CPU.

The layout a graph replays (a batch padded to its step, zero-length sequences up to the fixed slot count,
padding sequences after them) must leave the real tokens' last hidden states as the unpadded batch has
them: checked on a tiny random BERT and a tiny random decoder in float32, through the same runner with
the capture replaced by eager execution. The capture and replay on a GPU: benchmarks/gpu_check.sh.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from embed_service.models.bert import BertModel
from embed_service.models.decoder import DecoderModel
from embed_service.ops.batch import FlatBatch, padded_tokens
from embed_service.workers import graphs
from tests.models.tiny import randomize
from tests.server import ServerProcess

MAX_LEN = 40  # below PAD_LEN: padding is cut into several sequences


def tiny_bert() -> torch.nn.Module:
    cfg = {
        "vocab_size": 97,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "max_position_embeddings": MAX_LEN,
        "type_vocab_size": 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
    }
    return BertModel(SimpleNamespace(config=cfg, position_offset=0, causal=False))


def tiny_decoder() -> torch.nn.Module:
    cfg = {
        "vocab_size": 97,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 5000.0,
    }
    return DecoderModel(SimpleNamespace(config=cfg, causal=True))


@pytest.mark.parametrize("build", [tiny_bert, tiny_decoder], ids=["bert", "decoder"])
def test_padded_layout_keeps_the_real_tokens_hidden_states(build):
    torch.manual_seed(0)
    body = build().float().eval()
    randomize(body, seed=3)
    steps = (16, 48, 320)
    plan = graphs.GraphSteps(steps, 8, None)
    runner = graphs.GraphRunner(body, plan, MAX_LEN, torch.device("cpu"), capture=graphs.eager)
    g = torch.Generator().manual_seed(1)
    # 1 token; a full step (no padding); padding of one piece; of several pieces; all 8 slots; a pair.
    for lengths, second in [
        ([1], None),
        ([7, 9], None),
        ([30, 2, 5], None),
        ([40, 40, 40, 40, 40, 40, 17], None),
        ([1, 2, 3, 4, 5, 6, 7, 8], None),
        ([12, 21], [5, 0]),
    ]:
        ids = torch.randint(1, 97, (sum(lengths),), generator=g)
        batch = FlatBatch.from_lengths(ids, lengths, second)
        assert padded_tokens(sum(lengths)) in steps
        with torch.inference_mode():
            want = body(batch)
        got = runner.hidden(batch)
        assert got is not None and got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (lengths, (got - want).abs().max())


def test_batches_without_a_graph_run_eagerly():
    body = tiny_bert().float().eval()
    runner = graphs.GraphRunner(
        body, graphs.GraphSteps((16,), 2, None), MAX_LEN, torch.device("cpu"), graphs.eager
    )
    ids = torch.ones(17, dtype=torch.long)
    assert runner.hidden(FlatBatch.from_lengths(ids, [17])) is None  # step 32: no graph
    assert runner.hidden(FlatBatch.from_lengths(ids[:6], [2, 2, 2])) is None  # 3 sequences, 2 slots
    assert runner.hidden(FlatBatch.from_lengths(ids[:6], [3, 3])) is not None


def test_layout_shapes_are_the_steps_whatever_the_batch():
    """The fewest and the most tokens that run at a step, as 1 or many sequences: one set of shapes."""
    for step in (16, 256, 320, 2048):
        shapes = set()
        for tokens in (step - graphs._grain(step) + 1, step):
            for lengths in [split(tokens)] + ([[1, 1, *split(tokens - 2)]] if tokens > 2 else []):
                batch = FlatBatch.from_lengths(torch.ones(sum(lengths), dtype=torch.long), lengths)
                layout = graphs.graph_layout(batch, step, graphs.GRAPH_MAX_SEQUENCES, MAX_LEN)
                assert int(layout.cu_seqlens[-1]) == step and layout.max_seqlen == min(step, MAX_LEN)
                assert int(layout.positions.max()) < MAX_LEN and torch.all(
                    layout.cu_seqlens.diff() <= MAX_LEN
                )
                shapes.add((layout.input_ids.shape, layout.cu_seqlens.shape, layout.positions.shape))
        assert len(shapes) == 1, (step, shapes)


def split(tokens: int) -> list[int]:
    """`tokens` as sequences of MAX_LEN and the rest."""
    return [MAX_LEN] * (tokens // MAX_LEN) + ([tokens % MAX_LEN] if tokens % MAX_LEN else [])


def test_plan_captures_only_where_it_is_safe():
    assert (
        graphs.choose_steps(True, "cuda", "torch-varlen", "bert", 1, 4096).steps
        == graphs.choose_steps(True, "cuda", "flash-attn", "bert", 1, 4096).steps
    )  # torch's own varlen kernel is capture-safe as flash-attn's is
    on = graphs.choose_steps(True, "cuda", "flash-attn", "bert", 1, 16384)
    assert on.off is None and on.steps[0] == 16 and on.steps[-1] == graphs.GRAPH_MAX_TOKENS
    assert list(on.steps) == sorted({padded_tokens(t) for t in range(1, graphs.GRAPH_MAX_TOKENS + 1)})
    assert on.info() == {"steps": list(on.steps), "max_sequences": graphs.GRAPH_MAX_SEQUENCES, "off": None}
    assert graphs.choose_steps(True, "cuda", "flash-attn", "decoder", 1, 512).steps[-1] == 512
    for args, reason in [
        ((False, "cuda", "torch-varlen", "bert", 1, 4096), "--cuda-graphs turns them on"),
        ((True, "cpu", "cpu-kernel", "bert", 1, 4096), "not CUDA"),
        ((True, "cuda", "sdpa", "bert", 1, 4096), "torch-varlen or flash-attn is needed"),
        ((True, "cuda", "flash-attn", "mpnet", 1, 4096), "not capture-safe"),
        ((True, "cuda", "flash-attn", "bert", 2, 4096), "tensor parallelism"),
    ]:
        off = graphs.choose_steps(*args)
        assert off.steps == () and reason in (off.off or "")


def test_a_replay_that_disagrees_leaves_the_worker_eager_and_says_why():
    """graphs.capture_checked, as each worker runs it after capture: every step replayed against the eager
    body; a faithful replay keeps the runner, one that returns other rows (a stale static output at one
    step) gives none and a plan that is off, naming the step (a worker then serves eagerly, /info says so)."""
    torch.manual_seed(0)
    body = tiny_decoder().float().eval()
    randomize(body, seed=3)
    plan = graphs.GraphSteps((16, 48, 320), 8, None)
    cpu = torch.device("cpu")
    runner, kept, note = graphs.capture_checked(body, plan, MAX_LEN, 97, cpu, 0.999, graphs.eager)
    assert runner is not None and kept == plan and "match the eager forward at 3 steps" in note
    assert graphs.replay_check(runner, body, MAX_LEN, 97, cpu).min_cosine >= 0.999999

    def stale_at_320(fn, pool=None):  # a replay whose output is the first capture's, whatever was loaded
        first = fn().clone()
        return (lambda: first) if first.shape[0] == 320 else fn

    runner, off, note = graphs.capture_checked(body, plan, MAX_LEN, 97, cpu, 0.999, stale_at_320)
    assert runner is None and off.steps == () and off.info()["max_sequences"] == 0
    assert off.off is not None and "replay disagreed" in off.off and "at step 320" in off.off
    assert note.startswith("WARNING: CUDA graphs off") and off.off in note


def test_check_batches_pad_every_step():
    for step in (16, 48, 256, 320, 2048):
        batch = graphs.check_batch(step, graphs.GRAPH_MAX_SEQUENCES, MAX_LEN, 97)
        assert batch is not None and padded_tokens(int(batch.cu_seqlens[-1])) == step
        assert int(batch.cu_seqlens[-1]) < step and int(batch.cu_seqlens.diff().max()) <= MAX_LEN
    assert graphs.check_batch(2048, 8, MAX_LEN, 97) is None  # more sequences than the slots


def test_info_reports_the_choice():
    """Off by default: the setting reaches the workers, and /info says no graph runs and why."""
    with ServerProcess("--dtype", "float32", "--data-parallel-size", "1") as server:
        info = httpx.get(server.url + "/info").json()
        assert info["cuda_graphs"] == {"steps": [], "max_sequences": 0, "off": graphs.OFF_BY_SETTING}
        vectors = httpx.post(server.url + "/v1/embeddings", json={"input": ["a", "b c"]}).json()["data"]
        assert len(vectors) == 2
