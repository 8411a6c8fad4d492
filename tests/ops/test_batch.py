"""The flat batch carries each pair's token types: type 1 from the second text's first token to the end."""

from __future__ import annotations

import torch

from embed_service.ops.batch import FlatBatch


def test_token_types_follow_each_sequences_second_segment():
    ids = torch.arange(12)
    batch = FlatBatch.from_lengths(ids, [5, 3, 4], [3, 0, 1])  # a pair, a single text, a pair
    assert batch.token_type_ids.tolist() == [0, 0, 0, 1, 1] + [0, 0, 0] + [0, 1, 1, 1]
    padded = batch.padded(20, max_len=4)
    assert padded.token_type_ids.tolist()[:12] == batch.token_type_ids.tolist()
    assert padded.token_type_ids[12:].eq(0).all() and padded.input_ids.numel() == 20
    assert batch.to("cpu").token_type_ids.tolist() == batch.token_type_ids.tolist()


def test_single_texts_carry_no_token_types():
    assert FlatBatch.from_lengths(torch.arange(6), [2, 4], [0, 0]).token_type_ids is None
    assert FlatBatch.from_lengths(torch.arange(6), [2, 4]).padded(16).token_type_ids is None
