"""The output heads over a batch's last hidden states: each sequence gets the kinds it asked for.

Dense: the pooling, then the sentence-transformers Dense layers. Sparse and ColBERT: bge-m3's heads
(``sparse_linear.pt``, ``colbert_linear.pt`` in the model folder), with FlagEmbedding's formulas
(BGEM3FlagModel): sparse = ReLU(sparse_linear(h)) per token, the maximum per token id, zero weights
dropped (the engine drops the special tokens, which the tokenizer knows); ColBERT = colbert_linear over every
token but the first (CLS), each vector L2-normalized. All in float32, whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from embed_service.outputs import COLBERT, DENSE, KINDS, SCORE, SPARSE, OutputRequest, SequenceOutput, Sparse


def load_linear(path: Path, device: torch.device) -> nn.Linear:
    """An nn.Linear (float32) from a state dict saved with torch.save ({"weight": (out, in), "bias"})."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "weight" not in state or state["weight"].dim() != 2:
        raise ValueError(f"{path}: not the state dict of a linear layer (a 2-D weight and a bias)")
    out_features, in_features = state["weight"].shape
    layer = nn.Linear(in_features, out_features, bias="bias" in state, dtype=torch.float32, device=device)
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
    ):
        super().__init__()
        self.pool = pool
        self.dense = dense
        self.sparse = sparse
        self.colbert = colbert
        self.score = score  # (T, H), cu_seqlens -> (B, L) logits: models/scoring.py

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
        if want[SPARSE]:
            self._sparse(hidden, ids, cu, want[SPARSE], outs)
        if want[COLBERT]:
            self._colbert(hidden, cu, want[COLBERT], outs)
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
