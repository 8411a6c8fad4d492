"""The start-up self-check of batch invariance: a few fixed sequences computed alone, then inside a mixed
batch at other positions, on every replica, compared byte for byte. /info reports the result; a check
that fails withdraws the claim (and the output cache, which relies on it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from embed_service.ops import invariance
from embed_service.outputs import OutputRequest, SequenceOutput

Compute = Callable[[np.ndarray, np.ndarray, list[OutputRequest], int], list[SequenceOutput]]


def _bytes(out: SequenceOutput) -> tuple:
    sparse = None if out.sparse is None else (out.sparse.indices.tobytes(), out.sparse.values.tobytes())
    return (*(None if a is None else a.tobytes() for a in (out.dense, out.colbert, out.score)), sparse)


def probes(vocab_size: int, max_len: int) -> list[list[int]]:
    """Three sequences of fixed ids (5, 37 and up to 120 tokens) below `vocab_size`, away from the first
    ids, where tokenizers keep their special tokens."""
    base, span = _ids(vocab_size)
    return [[base + (i * 7919 + n) % span for i in range(n)] for n in (5, 37, min(120, max_len))]


def _ids(vocab_size: int) -> tuple[int, int]:
    base = min(1000, vocab_size // 4)
    return base, max(1, min(vocab_size, 30000) - base)


def check(compute: Compute, replicas: int, kinds: frozenset[str], vocab_size: int, max_len: int) -> dict:
    """{"enabled", "verified", "checked", "detail"}: whether the running configuration keeps the guarantee
    on these inputs (not checked when batch invariance is off)."""
    if not invariance.enabled():
        return {"enabled": False, "verified": False, "checked": 0, "detail": "off (--batch-invariant)"}
    request = OutputRequest(kinds)
    seqs = probes(vocab_size, max_len)
    base, span = _ids(vocab_size)
    fillers = [[base + (i * 31 + 3) % span for i in range(min(n, max_len))] for n in (3, 64, 17, 90)]

    def run(batch: list[list[int]], replica: int) -> list[tuple]:
        lengths = np.array([len(s) for s in batch], dtype=np.int32)
        ids = np.array([t for s in batch for t in s], dtype=np.int32)
        return [_bytes(o) for o in compute(ids, lengths, [request] * len(batch), replica)]

    alone = [run([s], 0)[0] for s in seqs]
    checked = 0
    for replica in range(replicas):
        # The probes between and after fillers, in reverse order.
        mixed = [fillers[0], seqs[2], fillers[1], seqs[1], fillers[2], fillers[3], seqs[0]]
        got = run(mixed, replica)
        for probe, out in ((2, got[1]), (1, got[3]), (0, got[6])):
            checked += 1
            if out != alone[probe]:
                detail = f"replica {replica}: a {len(seqs[probe])}-token input differs inside a mixed batch"
                return {"enabled": True, "verified": False, "checked": checked, "detail": detail}
    return {"enabled": True, "verified": True, "checked": checked, "detail": "alone == in a mixed batch"}
