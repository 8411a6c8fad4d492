"""A model that computes nothing, for measuring everything else (benchmarks only, never served).

With ``EMBED_NULL_MODEL=1`` in the server's environment, each worker builds this instead of the model: it
reads the model's folder as usual (the spec: dimension, outputs), loads no weights, and answers every batch
with constant outputs of the right shapes, one `SequenceOutput` per sequence, as the real heads build them
(dense rows of one (B, D) array, a sparse entry per distinct token id, a ColBERT vector per token after the
first, a late chunking vector per span the sequence asks for, a token vector per token). Tokenization, admission, the batcher, the pipes and the HTTP layer run exactly as they do with the
model, so the server's throughput is then the ceiling of its front end (docs/performance.md).

An environment variable, not a setting: it is a measuring tool, and the vectors it gives mean nothing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from embed_service.outputs import COLBERT, DENSE, LATE, SPARSE, TOKENS, OutputRequest, SequenceOutput, Sparse

ENV = "EMBED_NULL_MODEL"


def wanted() -> bool:
    return os.environ.get(ENV) == "1"


class NullModel:
    """Called as the model is, `model(batch, requests)`; its vectors are unit vectors along all axes."""

    def __init__(self, dimension: int):
        self.dimension = dimension

    def eval(self) -> NullModel:
        return self

    def parameter_bytes(self) -> int:
        return 0

    def __call__(self, batch: Any, requests: list[OutputRequest]) -> list[SequenceOutput]:
        cu = batch.cu_seqlens.tolist()  # (B + 1,)
        ids = batch.input_ids.cpu().numpy()  # (T,)
        outs = [SequenceOutput() for _ in requests]
        dense = np.full((len(requests), self.dimension), self.dimension**-0.5, np.float32)  # (B, D)
        for i, (out, req) in enumerate(zip(outs, requests)):
            if DENSE in req.kinds:
                out.dense = dense[i]
            if SPARSE in req.kinds:
                uniq = np.unique(ids[cu[i] : cu[i + 1]]).astype(np.int32)
                out.sparse = Sparse(uniq, np.ones(uniq.size, np.float32))
            if COLBERT in req.kinds:
                out.colbert = np.zeros((max(0, cu[i + 1] - cu[i] - 1), self.dimension), np.float32)
            if LATE in req.kinds:
                out.late = np.full((len(req.spans), self.dimension), self.dimension**-0.5, np.float32)
            if TOKENS in req.kinds:
                out.tokens = np.zeros((cu[i + 1] - cu[i], self.dimension), np.float32)
        return outs
