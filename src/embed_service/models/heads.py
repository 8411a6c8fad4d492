"""The output heads over a batch's last hidden states: each sequence gets the kinds it asked for.

Dense: the pooling, then the sentence-transformers Dense layers. Sparse and ColBERT: bge-m3's heads
(``sparse_linear.pt``, ``colbert_linear.pt`` in the model folder), with FlagEmbedding's formulas
(BGEM3FlagModel): sparse = ReLU(sparse_linear(h)) per token, the maximum per token id, zero weights
dropped (the engine drops the special tokens, which the tokenizer knows); ColBERT = colbert_linear over every
token but the first (CLS), each vector L2-normalized. All in float32, whatever the model's dtype.

SPLADE (sentence-transformers' SparseEncoder: MLMTransformer, then SpladePooling): the masked-LM head's
logits over the vocabulary per token, in the model's dtype (the head is the checkpoint's own, a part of the
model); then in float32 log(1 + ReLU(logits)) (``log1p_relu``: log1p once more), the maximum or the sum over
the sequence's tokens, special tokens included, the zero entries dropped. The (tokens, vocabulary) logits
never exist whole: they are made a few hundred rows at a time (SPLADE_CHUNK_ELEMENTS).

Late chunking (engine/late.py): per span a sequence asks for, the mean of the span's rows of the last hidden
states in float32 (the paper's pooling, whatever the model's own pooling), then the Dense layers as for the
dense output, so a chunk vector is finished as a plain vector is. Token-level output: every row of a
sequence's last hidden states in float32, as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from embed_service.layers.linear import Linear
from embed_service.models.spec import SpladeSpec
from embed_service.ops import invariance
from embed_service.outputs import (
    COLBERT,
    DENSE,
    KINDS,
    LATE,
    SCORE,
    SPARSE,
    TOKENS,
    OutputRequest,
    SequenceOutput,
    Sparse,
)
from embed_service.parallel import all_gather_last_dim, tp_world_size

# Float32 elements of one (rows, vocabulary) slab of SPLADE logits or pooled rows: 64 MiB, whatever the batch.
SPLADE_CHUNK_ELEMENTS = 1 << 24


def load_linear(path: Path, device: torch.device) -> nn.Linear:
    """A Linear (float32; batch-invariant like the layers: layers/linear.py) from a state dict saved with torch.save ({"weight": (out, in), "bias"})."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "weight" not in state or state["weight"].dim() != 2:
        raise ValueError(f"{path}: not the state dict of a linear layer (a 2-D weight and a bias)")
    out_features, in_features = state["weight"].shape
    layer = Linear(in_features, out_features, bias="bias" in state, dtype=torch.float32, device=device)
    layer.load_state_dict({k: v.float() for k, v in state.items()})
    return layer


def _rows(cu: list[int], seqs: list[int], skip_first: bool) -> torch.Tensor:
    """Flat token positions of the given sequences, in order (without each one's first token if asked)."""
    return torch.cat([torch.arange(cu[i] + int(skip_first), cu[i + 1]) for i in seqs])


class OutputHeads(nn.Module):
    """Turns (T, H) hidden states and per-sequence requests into one SequenceOutput per sequence.

    Each head runs once per batch, over the rows of the sequences that asked for it only.
    """

    def __init__(
        self,
        pool: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        dense: nn.ModuleList,
        sparse: nn.Linear | None = None,
        colbert: nn.Linear | None = None,
        score: nn.Module | None = None,
        splade: SpladeHead | None = None,
    ):
        super().__init__()
        self.pool = pool
        self.dense = dense
        self.sparse = sparse
        self.colbert = colbert
        self.score = score  # (T, H), cu_seqlens -> (B, L) logits: models/scoring.py
        self.splade = splade  # a SPLADE model's sparse output, instead of bge-m3's

    def forward(
        self, hidden: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor, requests: list[OutputRequest]
    ) -> list[SequenceOutput]:
        outs = [SequenceOutput() for _ in requests]
        want = {k: [i for i, r in enumerate(requests) if k in r.kinds] for k in KINDS}
        cu = cu_seqlens.tolist()
        if want[DENSE]:
            # Pooling is one pass over the tokens; the Dense layers run on the rows asked for.
            pooled = self.pool(hidden, cu_seqlens)[torch.tensor(want[DENSE], device=hidden.device)]
            for d in self.dense:
                pooled = d(pooled)
            for i, row in zip(want[DENSE], pooled.cpu().numpy()):
                outs[i].dense = row
        if want[SPARSE] and self.splade is not None:
            self.splade(hidden, cu, want[SPARSE], outs)
        elif want[SPARSE]:
            self._sparse(hidden, ids, cu, want[SPARSE], outs)
        if want[COLBERT]:
            self._colbert(hidden, cu, want[COLBERT], outs)
        if want[LATE]:
            self._late(hidden, cu, [(i, requests[i].spans) for i in want[LATE]], outs)
        if want[TOKENS]:
            rows = _rows(cu, want[TOKENS], skip_first=False).to(hidden.device)
            vectors = hidden[rows].float().cpu().numpy()
            start = 0
            for i in want[TOKENS]:
                n = cu[i + 1] - cu[i]
                outs[i].tokens = vectors[start : start + n]
                start += n
        if want[SCORE]:
            assert self.score is not None, "only scoring models give scores (ModelSpec.outputs)"
            scores = self.score(hidden.float(), cu_seqlens)[torch.tensor(want[SCORE], device=hidden.device)]
            for i, row in zip(want[SCORE], scores.cpu().numpy()):
                outs[i].score = row
        return outs

    def _sparse(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cu: list[int],
        seqs: list[int],
        outs: list[SequenceOutput],
    ) -> None:
        assert self.sparse is not None, "the engine refuses sparse for a model without the head"
        rows = _rows(cu, seqs, skip_first=False).to(hidden.device)
        weights = torch.relu(self.sparse(hidden[rows].float())).squeeze(-1).cpu()
        tokens = ids[rows].cpu()
        start = 0
        for i in seqs:
            n = cu[i + 1] - cu[i]
            uniq, inverse = torch.unique(tokens[start : start + n], return_inverse=True)  # ascending ids
            best = torch.zeros(uniq.numel(), dtype=torch.float32)
            best.scatter_reduce_(0, inverse, weights[start : start + n], "amax", include_self=True)
            keep = best > 0
            outs[i].sparse = Sparse(uniq[keep].to(torch.int32).numpy(), best[keep].numpy())
            start += n

    def _colbert(
        self, hidden: torch.Tensor, cu: list[int], seqs: list[int], outs: list[SequenceOutput]
    ) -> None:
        assert self.colbert is not None, "the engine refuses colbert for a model without the head"
        rows = _rows(cu, seqs, skip_first=True).to(hidden.device)
        vectors = torch.nn.functional.normalize(self.colbert(hidden[rows].float()), dim=-1).cpu().numpy()
        start = 0
        for i in seqs:
            n = cu[i + 1] - cu[i] - 1
            outs[i].colbert = vectors[start : start + n]
            start += n

    def _late(
        self,
        hidden: torch.Tensor,
        cu: list[int],
        seqs: list[tuple[int, tuple[tuple[int, int], ...]]],
        outs: list[SequenceOutput],
    ) -> None:
        """Each span's mean of its rows (spans may share rows), then the Dense layers: one (S, D) per sequence."""
        rows: list[torch.Tensor] = []
        seg: list[torch.Tensor] = []
        counts: list[int] = []
        for i, spans in seqs:
            for s, e in spans:
                rows.append(torch.arange(cu[i] + s, cu[i] + e))
                seg.append(torch.full((e - s,), len(counts)))
                counts.append(e - s)
        device = hidden.device
        sums = torch.zeros(len(counts), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, torch.cat(seg).to(device), hidden[torch.cat(rows).to(device)].float())
        pooled = sums / torch.tensor(counts, dtype=torch.float32, device=device)[:, None]
        for d in self.dense:
            pooled = d(pooled)
        vectors = pooled.cpu().numpy()
        start = 0
        for i, spans in seqs:
            outs[i].late = vectors[start : start + len(spans)]
            start += len(spans)


class SpladeHead:
    """A SPLADE model's sparse vectors: SpladePooling over the masked-LM logits, per sequence.

    ``logits`` maps (N, hidden) to (N, V_r), this rank's rows of the vocabulary (models/bert.py); each rank
    pools its own rows (the activation and the pooling are per vocabulary entry, so the split is exact) and
    the pooled rows are gathered, a group of sequences at a time. Every rank runs the same steps: the
    gather is a collective.
    """

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], spec: SpladeSpec, vocab_size: int):
        self.logits = logits
        self.spec = spec
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp_world_size())  # as VocabParallelEmbedding pads

    def _activate(self, logits: torch.Tensor) -> torch.Tensor:
        x = torch.log1p(torch.relu(logits.float()))
        return torch.log1p(x) if self.spec.activation_function == "log1p_relu" else x

    def _pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(sum(lengths), hidden) rows of consecutive sequences -> (len(lengths), V_r) pooled, float32."""
        device = hidden.device
        seg = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
        )
        pooled = torch.zeros(len(lengths), self.rows_per_rank, dtype=torch.float32, device=device)
        step = max(
            invariance.ROW_TILE,
            SPLADE_CHUNK_ELEMENTS // self.rows_per_rank // invariance.ROW_TILE * invariance.ROW_TILE,
        )
        for start in range(0, hidden.shape[0], step):
            chunk = hidden[start : start + step]
            # The logits are per row; in fixed tiles the rows of a sequence do not depend on where a
            # chunk happens to start.
            logits = invariance.tiled(self.logits, chunk) if invariance.enabled() else self.logits(chunk)
            act = self._activate(logits)  # (r, V_r)
            rows = seg[start : start + step]
            # The values are >= 0, so a maximum from 0 is the maximum sentence-transformers takes from -inf.
            if self.spec.pooling_strategy == "max":
                pooled.scatter_reduce_(0, rows[:, None].expand_as(act), act, "amax")
            else:
                pooled.index_add_(0, rows, act)
        return pooled

    def __call__(
        self, hidden: torch.Tensor, cu: list[int], seqs: list[int], outs: list[SequenceOutput]
    ) -> None:
        group = max(1, SPLADE_CHUNK_ELEMENTS // self.vocab_size)  # sequences whose gathered rows fit
        for g in range(0, len(seqs), group):
            part = seqs[g : g + group]
            rows = _rows(cu, part, skip_first=False).to(hidden.device)
            pooled = self._pool(hidden[rows], [cu[i + 1] - cu[i] for i in part])
            pooled = all_gather_last_dim(pooled)[:, : self.vocab_size]  # (n, V): padded rows cut
            nz = pooled.nonzero()  # (K, 2), row-major: ascending ids within each row
            values = pooled[nz[:, 0], nz[:, 1]].cpu().numpy()
            ids = nz[:, 1].to(torch.int32).cpu().numpy()
            counts = torch.bincount(nz[:, 0], minlength=len(part)).tolist()
            start = 0
            for i, n in zip(part, counts):
                outs[i].sparse = Sparse(ids[start : start + n], values[start : start + n])
                start += n
