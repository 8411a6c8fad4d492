"""CUDA graphs for short batches: one captured forward of the transformer body per token-count step.

A short batch on a GPU is bound by kernel launches (a 6-layer encoder launches ~100 kernels for 32 tokens,
each a few microseconds of work), and one graph replay launches them all at once. A graph replays fixed
shapes and fixed addresses, so each step's graph owns static buffers laid out the same way every time:

    input_ids, positions, token_type_ids: (S,)   S: the step, padded_tokens(T) for a batch of T tokens
    cu_seqlens: (N + P + 1,) int32                N slots for real sequences, P for the padding
    [real sequences][zero-length sequences up to N][padding sequences of token 0 up to S tokens]

max_seqlen is fixed per graph (min(S, the max input length)), an upper bound flash-attn's varlen kernel
sizes its grid by; zero-length sequences do no work. The output heads (pooling, sparse, ColBERT, scoring)
copy to the host, so they run after the replay, eagerly, on the real rows of the static output (T, H).

Only the transformer body of a family whose attention is ops/attention.varlen_attention is captured, and
only with a one-launch varlen backend (torch-varlen or flash-attn): the SDPA fallback groups sequences by length on the host
(FlatBatch.length_groups, a device sync and shapes that change per batch), and scored attention (MPNet's
relative bias, Gemma's soft-capping) builds per-batch tensors. Tensor parallelism (world size > 1) runs
eagerly too. Everything else (a batch over the largest step, more sequences than the slots) runs eagerly.

`capture` is the one CUDA-only part: tests pass `eager` instead and run the same layout on a CPU.

After capture, `replay_check` replays every step on a batch that runs at it and compares the real tokens'
hidden states with the eager body's; a worker whose replay disagrees serves eagerly (workers/worker.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from embed_service.ops.attention import VARLEN_BACKENDS
from embed_service.ops.batch import FlatBatch, padded_tokens

# Steps up to this many tokens get a graph: past ~2k tokens a forward is long enough that launches are a
# small share of it, and each graph holds its own static buffers.
GRAPH_MAX_TOKENS = 2048
# Real sequences one graph holds; a short batch with more runs eagerly. flash-attn's grid grows with the
# sequence count (zero-length ones return at once, but are still launched blocks).
GRAPH_MAX_SEQUENCES = 64
# Families whose body is capture-safe (registry.Family.module): varlen attention, no host reads.
CAPTURE_SAFE_FAMILIES = frozenset({"bert", "distilbert", "modernbert", "decoder"})
# The longest padding sequence (positions 0 .. PAD_LEN - 1 stay inside every position table).
PAD_LEN = 64


# The reason /info gives while the setting is off (its default until a device run has passed).
OFF_BY_SETTING = "off (--cuda-graphs turns them on)"


def graph_steps(max_tokens: int) -> list[int]:
    """The token counts batches run at (ops/batch.padded_tokens), up to `max_tokens`."""
    return sorted(s for s in {padded_tokens(t) for t in range(1, max_tokens + 1)} if s <= max_tokens)


@dataclass(frozen=True)
class GraphSteps:
    """The steps a worker captures (none: `off` says why), reported in /info as `cuda_graphs`."""

    steps: tuple[int, ...]
    max_sequences: int
    off: str | None

    def info(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "max_sequences": self.max_sequences, "off": self.off}


def choose_steps(
    enabled: bool,
    device_type: str,
    attention_backend: str,
    family_module: str,
    world_size: int,
    max_batch_tokens: int,
    max_tokens: int = GRAPH_MAX_TOKENS,
) -> GraphSteps:
    """Which steps get a graph, or why none does."""
    off = (
        OFF_BY_SETTING
        if not enabled
        else f"the device is a {device_type}, not CUDA"
        if device_type != "cuda"
        else f"the {family_module} family's attention is not capture-safe"
        if family_module not in CAPTURE_SAFE_FAMILIES
        else f"attention backend {attention_backend} syncs with the host (torch-varlen or flash-attn is needed)"
        if attention_backend not in VARLEN_BACKENDS
        else "tensor parallelism (graphs run on one rank only)"
        if world_size > 1
        else None
    )
    if off is not None:
        return GraphSteps((), 0, off)
    return GraphSteps(
        tuple(graph_steps(min(max_tokens, padded_tokens(max_batch_tokens)))), GRAPH_MAX_SEQUENCES, None
    )


def _grain(step: int) -> int:
    """The largest padding a batch that runs at `step` can need, plus one (see padded_tokens)."""
    return 16 if step <= 256 else 64 if step <= 2048 else 256


def pad_slots(step: int, max_len: int) -> int:
    """Padding sequences a graph of `step` holds: enough for the most padding a batch there needs."""
    return -(-(_grain(step) - 1) // min(PAD_LEN, max_len))


def graph_layout(batch: FlatBatch, step: int, slots: int, max_len: int) -> FlatBatch:
    """`batch` (T <= step tokens, B <= slots sequences) in the static layout of the graph of `step`.

    Returns (step,) ids, positions and token types, and (slots + pad_slots + 1,) cu_seqlens; the real
    tokens keep their rows 0 .. T - 1, so the body's output rows for them are the batch's.
    """
    tokens, seqs = int(batch.cu_seqlens[-1]), batch.num_seqs
    if tokens > step or seqs > slots:
        raise ValueError(
            f"a batch of {tokens} tokens, {seqs} sequences does not fit step {step}, {slots} slots"
        )
    pad = step - tokens
    piece = min(PAD_LEN, max_len)
    pieces = [piece] * (pad // piece) + ([pad % piece] if pad % piece else [])
    extra = pad_slots(step, max_len)
    if len(pieces) > extra:
        raise ValueError(f"{pad} padding tokens need more than {extra} padding sequences")
    pieces += [0] * (extra - len(pieces))
    cu = torch.cat(
        [
            batch.cu_seqlens.to(torch.int32),
            torch.full((slots - seqs,), tokens, dtype=torch.int32),
            tokens + torch.cumsum(torch.tensor(pieces, dtype=torch.int32), 0, dtype=torch.int32),
        ]
    )
    ids = torch.cat([batch.input_ids, torch.zeros(pad, dtype=batch.input_ids.dtype)])
    positions = torch.cat([batch.positions, *(torch.arange(n) for n in pieces if n)])
    types = (
        batch.token_type_ids if batch.token_type_ids is not None else torch.zeros(tokens, dtype=torch.long)
    )
    types = torch.cat([types, torch.zeros(pad, dtype=types.dtype)])
    return FlatBatch(ids, positions, cu, min(step, max_len), types)


Replay = Callable[[], torch.Tensor]


def eager(fn: Replay, pool: Any = None) -> Replay:
    """The stand-in for `cuda_graph`: runs `fn` at every call (the same buffers, the same layout)."""
    return fn


def cuda_graph(fn: Replay, pool: Any = None) -> Replay:
    """Capture `fn` (after two warm-up runs on a side stream, as torch.cuda.graphs asks) into a graph; the
    returned callable replays it and returns its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class _StepGraph:
    """One step's static buffers and its replay."""

    def __init__(
        self,
        body: torch.nn.Module,
        step: int,
        slots: int,
        max_len: int,
        device: torch.device,
        capture: Callable[..., Replay],
        pool: Any,
    ):
        self.step, self.slots, self.max_len = step, slots, max_len
        # Every sequence zero-length until a batch is loaded: the capture's warm-up runs then read nothing
        # past the buffers (rows outside every sequence are left as the kernels find them).
        self.ids = torch.zeros(step, dtype=torch.long, device=device)
        self.positions = torch.zeros(step, dtype=torch.long, device=device)
        self.types = torch.zeros(step, dtype=torch.long, device=device)  # a pair batch copies its types in
        self.cu = torch.zeros(slots + pad_slots(step, max_len) + 1, dtype=torch.int32, device=device)

        def forward() -> torch.Tensor:
            # A new FlatBatch per call: its length-group cache must never outlive the buffers' contents.
            return body(FlatBatch(self.ids, self.positions, self.cu, min(step, max_len), self.types))

        self.replay = capture(forward, pool)

    def load(self, batch: FlatBatch) -> None:
        layout = graph_layout(batch, self.step, self.slots, self.max_len)
        self.ids.copy_(layout.input_ids, non_blocking=True)
        self.positions.copy_(layout.positions, non_blocking=True)
        self.cu.copy_(layout.cu_seqlens, non_blocking=True)
        assert layout.token_type_ids is not None  # graph_layout always gives them
        self.types.copy_(layout.token_type_ids, non_blocking=True)


class GraphRunner:
    """The transformer body of a model replayed from one graph per step of `cuda_graphs`.

    `hidden(batch)` -> (T, H) last hidden states of a host-side FlatBatch's real tokens, or None when the
    batch has no graph (more tokens than the largest step, or more sequences than the slots).
    """

    def __init__(
        self,
        body: torch.nn.Module,
        cuda_graphs: GraphSteps,
        max_len: int,
        device: torch.device,
        capture: Callable[..., Replay] = cuda_graph,
    ):
        self.steps = cuda_graphs
        pool = torch.cuda.graph_pool_handle() if capture is cuda_graph else None
        self.graphs: dict[int, _StepGraph] = {}
        with torch.inference_mode():
            # The largest first: the smaller graphs then fit in the memory pool it left (one pool for all).
            for step in sorted(cuda_graphs.steps, reverse=True):
                self.graphs[step] = _StepGraph(
                    body, step, cuda_graphs.max_sequences, max_len, device, capture, pool
                )

    @torch.inference_mode()  # the buffers were made in it
    def hidden(self, batch: FlatBatch) -> torch.Tensor | None:
        tokens = int(batch.cu_seqlens[-1])
        graph = self.graphs.get(padded_tokens(tokens))
        if graph is None or batch.num_seqs > graph.slots:
            return None
        graph.load(batch)
        return graph.replay()[:tokens].clone()  # (T, H): the next replay overwrites the static output

    def forward(self, model: Any, batch: FlatBatch, requests: list[Any]) -> list[Any] | None:
        """models/loader.EmbeddingModel.forward through a graph: the body replayed, then the heads eagerly on the
        real rows (with the device's copies of the ids and bounds). None: run the model eagerly."""
        with torch.inference_mode():
            hidden = self.hidden(batch)
            if hidden is None:
                return None
            graph = self.graphs[padded_tokens(int(batch.cu_seqlens[-1]))]
            tokens, seqs = hidden.shape[0], batch.num_seqs
            return model.heads(hidden, graph.ids[:tokens].clone(), graph.cu[: seqs + 1].clone(), requests)


def check_batch(step: int, slots: int, max_len: int, vocab_size: int, seed: int = 0) -> FlatBatch | None:
    """A batch that runs at `step` with padding to fill (half its grain short of the step), cut into the
    fewest sequences of at most `max_len`; None when that takes more sequences than the graph's slots."""
    tokens = max(1, step - (_grain(step) - 1) // 2)
    count = -(-tokens // max_len)
    if count > slots:
        return None
    lengths = [tokens // count + (i < tokens % count) for i in range(count)]
    ids = torch.randint(
        min(1000, vocab_size // 4),
        vocab_size,
        (tokens,),
        generator=torch.Generator().manual_seed(seed + step),
    )
    return FlatBatch.from_lengths(ids, lengths)


@dataclass(frozen=True)
class ReplayCheck:
    """The lowest cosine between replayed and eager hidden states over the steps checked, and its step."""

    min_cosine: float
    step: int | None
    steps_checked: int


def replay_check(
    runner: GraphRunner, body: torch.nn.Module, max_len: int, vocab_size: int, device: torch.device
) -> ReplayCheck:
    """Every step of `runner` replayed on check_batch(step) against the eager `body` on the same batch:
    the real tokens' last hidden states, row by row (cosine in float64 on the host)."""
    worst, worst_step, checked = 1.0, None, 0
    with torch.inference_mode():
        for step, graph in sorted(runner.graphs.items()):
            batch = check_batch(step, graph.slots, max_len, vocab_size)
            if batch is None:
                continue
            got = runner.hidden(batch)
            want = body(batch.to(device))
            if got is None:
                continue
            a, b = got.double().cpu(), want.double().cpu()
            cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-30)
            low = float(torch.nan_to_num(cos, nan=-1.0).min())
            checked += 1
            if low < worst:
                worst, worst_step = low, step
    return ReplayCheck(round(worst, 6), worst_step, checked)


def capture_checked(
    body: torch.nn.Module,
    cuda_graphs: GraphSteps,
    max_len: int,
    vocab_size: int,
    device: torch.device,
    min_cosine: float,
    capture: Callable[..., Replay] = cuda_graph,
) -> tuple[GraphRunner | None, GraphSteps, str]:
    """(runner, plan, what to log): the plan's graphs captured, then every step replayed against the eager
    body (replay_check). A replay below `min_cosine` gives no runner and a plan that is off and says why
    (the worker serves eagerly); an error while capturing is raised to the caller."""
    runner = GraphRunner(body, cuda_graphs, max_len, device, capture)
    replay = replay_check(runner, body, max_len, vocab_size, device)
    if replay.min_cosine < min_cosine:
        off = (
            f"replay disagreed with the eager forward: cosine {replay.min_cosine:.6f} at step "
            f"{replay.step} (needs {min_cosine}); serving eagerly"
        )
        return None, GraphSteps((), 0, off), f"WARNING: CUDA graphs off, {off}"
    return (
        runner,
        cuda_graphs,
        (
            f"CUDA graph replays match the eager forward at {replay.steps_checked} steps "
            f"(cosine >= {replay.min_cosine:.6f})"
        ),
    )
