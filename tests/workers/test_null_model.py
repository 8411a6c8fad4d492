"""The measuring tool's model: one answer per sequence, the kinds asked and the shapes the real heads give."""

import numpy as np
import torch

from embed_service.ops.batch import FlatBatch
from embed_service.outputs import OutputRequest, check_outputs
from embed_service.workers.null_model import NullModel


def test_null_model_answers_each_sequence_with_the_kinds_and_shapes_asked():
    ids = torch.tensor([101, 7, 7, 9, 102, 101, 5, 102], dtype=torch.int32)
    batch = FlatBatch.from_lengths(ids, [5, 3])
    requests = [OutputRequest(frozenset({"dense", "sparse"})), OutputRequest(frozenset({"colbert"}))]
    outs = check_outputs(requests, NullModel(384)(batch, requests))
    assert outs[0].dense is not None and outs[0].dense.shape == (384,)
    assert np.isclose(np.linalg.norm(outs[0].dense), 1.0)
    assert outs[0].sparse is not None and outs[0].sparse.indices.tolist() == [7, 9, 101, 102]
    assert outs[1].colbert is not None and outs[1].colbert.shape == (
        2,
        384,
    )  # a vector per token after the first
