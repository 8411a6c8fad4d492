"""The answer to a batch is held against it: one result per sequence, each with exactly the kinds asked."""

from __future__ import annotations

import numpy as np
import pytest

from embed_service.outputs import (
    DENSE_ONLY,
    OutputMismatchError,
    OutputRequest,
    SequenceOutput,
    Sparse,
    check_outputs,
)

BOTH = OutputRequest(frozenset({"dense", "sparse"}))
VEC = np.zeros(4, np.float32)
SPARSE = Sparse(np.array([5], np.int32), np.array([0.5], np.float32))


def test_a_matching_answer_passes():
    results = [SequenceOutput(dense=VEC), SequenceOutput(dense=VEC, sparse=SPARSE)]
    assert check_outputs([DENSE_ONLY, BOTH], results) is results


@pytest.mark.parametrize(
    "results, message",
    [
        ([SequenceOutput(dense=VEC)], "1 results for a batch of 2"),
        ([SequenceOutput(dense=VEC), SequenceOutput(dense=VEC)], r"sequence 1 .* got \['dense'\]"),
        ([SequenceOutput(dense=VEC, sparse=SPARSE), SequenceOutput(dense=VEC, sparse=SPARSE)], "sequence 0"),
    ],
)
def test_a_short_or_mismatched_answer_is_refused(results, message):
    with pytest.raises(OutputMismatchError, match=message):
        check_outputs([DENSE_ONLY, BOTH], results)
