"""The per-sequence output protocol: what each sequence asks the model for, and what comes back for it.

A sequence carries an `OutputRequest` from the route to the worker with its batch; the worker computes, for
each sequence, only the kinds it asked for, from the one forward of the batch, and answers one
`SequenceOutput` per sequence, in batch order. `check_outputs` holds the answer to the batch on the way back
(one result per sequence, each with exactly the kinds asked). Adding an output kind means a name in KINDS,
a field here, its head in models/heads.py, and its shape in the API; the batcher and the worker plumbing
carry it unchanged.

Plain Python and numpy: the batcher, the engine and the workers all import this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DENSE = "dense"
SPARSE = "sparse"
COLBERT = "colbert"
SCORE = "score"
LATE = "late"
TOKENS = "tokens"
KINDS = (DENSE, SPARSE, COLBERT, SCORE, LATE, TOKENS)
"""LATE is internal: late chunking (engine/late.py) asks for it with the spans to pool; no API names it.
TOKENS (the token-level output: every token's last hidden state) is given by every embedding model, so no
model's spec lists it (ModelSpec.outputs: the heads it has)."""


@dataclass(frozen=True)
class OutputRequest:
    """The outputs one sequence asks for. Frozen and small: it is pickled to the workers with every batch."""

    kinds: frozenset[str] = frozenset({DENSE})
    second_segment: int = 0
    """Where the second text of a pair starts (a cross-encoder's query, document): its tokens, to the end,
    are token type 1; 0: one text, every token type 0. Pairs are [CLS] A [SEP] B [SEP], so one offset is
    the whole of the token type ids, and it costs nothing to carry."""
    spans: tuple[tuple[int, int], ...] = ()
    """With LATE: the rows [start, end) of the sequence whose token vectors each chunk's vector averages
    (late chunking); a few pairs per sequence."""
    pixels: bytes = b""
    """An image input of a two-tower model: its preprocessed pixel values, float32 (C, H, W) in C order
    (images/preprocess.py); its sequence's ids are placeholders as long as its vision-tower tokens, which
    is what it costs the batcher. Empty for text."""


DENSE_ONLY = OutputRequest()


@dataclass(frozen=True)
class Sparse:
    """Lexical weights: token ids (ascending, int32) and their weights (float32, > 0)."""

    indices: np.ndarray
    values: np.ndarray


@dataclass
class SequenceOutput:
    """One sequence's results; a field is set exactly when its kind was asked for.

    dense: (D,) float32, pooled and through the Dense layers, not normalized (normalization and `dimensions`
    are per request, in the engine). sparse: the maximum weight per token id. colbert: (L - 1, C) float32,
    one normalized vector per token after the first. score: (num_labels,) float32, a scoring model's raw
    logits (the engine applies the activation; models/scoring.py). late: (S, D) float32, per span of the
    request the mean of its rows' last hidden states in float32, then the Dense layers, not normalized.
    tokens: (L, H) float32, the last hidden state of every token of the sequence, special tokens included
    (transformers' last_hidden_state): the vectors late chunking pools, before any pooling or Dense layer.
    """

    dense: np.ndarray | None = None
    sparse: Sparse | None = None
    colbert: np.ndarray | None = None
    score: np.ndarray | None = None
    late: np.ndarray | None = None
    tokens: np.ndarray | None = None

    def kinds(self) -> frozenset[str]:
        return frozenset(k for k in KINDS if getattr(self, k) is not None)


class OutputMismatchError(RuntimeError):
    """A backend's answer does not match its batch: a different count, or other kinds than were asked."""


def check_outputs(requests: list[OutputRequest], results: list[SequenceOutput]) -> list[SequenceOutput]:
    """`results` when it answers `requests` one to one with exactly the kinds asked; else raise."""
    if len(results) != len(requests):
        raise OutputMismatchError(f"{len(results)} results for a batch of {len(requests)} sequences")
    for i, (req, out) in enumerate(zip(requests, results)):
        got = out.kinds()
        if got != req.kinds:
            raise OutputMismatchError(
                f"sequence {i} of the batch asked for {sorted(req.kinds)} and got {sorted(got)}"
            )
    return results
