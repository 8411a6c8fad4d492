"""The padding-free batch a model consumes: one flat token stream cut by cu_seqlens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LengthGroup:
    """Sequences of similar length, for kernels that pad: spans [(start, end)] into the flat stream (longest
    first); key_valid (B, 1, 1, L) bool, None when every sequence is L long; token_index (sum of lengths,)
    int64: the flat position of each real grid row, in (sequence, position) order."""

    spans: list[tuple[int, int]]
    max_len: int
    key_valid: torch.Tensor | None
    token_index: torch.Tensor


@dataclass
class FlatBatch:
    """Sequences laid end to end.

    input_ids, positions: (T,) int64; cu_seqlens: (B + 1,) int32 with cu_seqlens[0] = 0 and [-1] = T.
    Positions restart at 0 for each sequence. token_type_ids: (T,) int64, or None when every token is type 0
    (single texts). The length groups that attention pads by are derived once per batch and shared by
    every layer.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    token_type_ids: torch.Tensor | None = None
    _groups: list[LengthGroup] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @classmethod
    def from_lengths(
        cls, input_ids: torch.Tensor, lengths: list[int], second_segments: list[int] | None = None
    ) -> FlatBatch:
        """`second_segments`: per sequence, the position its token type 1 starts at (0: none); see
        outputs.OutputRequest.second_segment."""
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        starts = torch.repeat_interleave(cu[:-1].long(), lens.long())
        positions = torch.arange(int(cu[-1]), dtype=torch.long) - starts
        types = None
        if second_segments is not None and any(second_segments):
            split = torch.tensor([s or n for s, n in zip(second_segments, lengths)], dtype=torch.long)
            types = (positions >= torch.repeat_interleave(split, lens.long())).long()
        return cls(input_ids.to(torch.long), positions, cu, max(lengths), types)

    def padded(self, total: int, max_len: int = 64) -> FlatBatch:
        """This batch with dummy sequences (token 0, at most `max_len` long) appended up to `total` tokens.

        Rows past the real tokens are computed and dropped; they exist so that a CPU matmul sees one of a
        few token counts rather than a new one every batch (see `padded_tokens`).
        """
        extra = total - int(self.cu_seqlens[-1])
        if extra <= 0:
            return self
        lengths = [max_len] * (extra // max_len) + ([extra % max_len] if extra % max_len else [])
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.cat([self.cu_seqlens, self.cu_seqlens[-1] + torch.cumsum(lens, 0, dtype=torch.int32)])
        ids = torch.cat([self.input_ids, torch.zeros(extra, dtype=self.input_ids.dtype)])
        positions = torch.cat([self.positions, torch.cat([torch.arange(n) for n in lengths])])
        types = self.token_type_ids
        if types is not None:
            types = torch.cat([types, torch.zeros(extra, dtype=types.dtype)])
        return FlatBatch(ids, positions, cu, max(self.max_seqlen, max(lengths)), types)

    def to(self, device: torch.device | str) -> FlatBatch:
        types = self.token_type_ids
        return FlatBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            None if types is None else types.to(device),
        )

    def attention_groups(self, ratio: float) -> list[LengthGroup]:
        """What the padded attention paths attend by: length_groups, or with batch invariance on
        (ops/invariance.py) one group per sequence, so that no sequence's grid depends on its neighbours."""
        from embed_service.ops import invariance

        if not invariance.enabled():
            return self.length_groups(ratio)
        bounds = self.cu_seqlens.tolist()
        device = self.cu_seqlens.device
        return [
            LengthGroup([(s, e)], e - s, None, torch.arange(s, e, device=device))
            for s, e in zip(bounds[:-1], bounds[1:])
        ]

    def length_groups(self, ratio: float) -> list[LengthGroup]:
        """The sequences sorted by length, longest first, cut where one is shorter than `ratio` times the
        longest of its group. Computed once per batch and shared by every layer."""
        if self._groups is None:
            bounds = self.cu_seqlens.tolist()
            spans = sorted(zip(bounds[:-1], bounds[1:]), key=lambda se: se[0] - se[1])
            cuts: list[list[tuple[int, int]]] = []
            for s, e in spans:
                if not cuts or e - s < ratio * (cuts[-1][0][1] - cuts[-1][0][0]):
                    cuts.append([])
                cuts[-1].append((s, e))
            self._groups = []
            for group in cuts:
                lens = torch.tensor([e - s for s, e in group])
                L = int(lens[0])
                valid = None
                if int(lens[-1]) != L:
                    valid = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]
                    valid = valid.to(self.cu_seqlens.device)
                index = torch.cat([torch.arange(s, e) for s, e in group]).to(self.cu_seqlens.device)
                self._groups.append(LengthGroup(group, L, valid, index))
        return self._groups


def padded_tokens(tokens: int) -> int:
    """The token count a CPU forward runs at: `tokens` rounded up to a step of 16 (up to 256 tokens), 64 (up
    to 2,048) or 256 (beyond), at most ~6% more work.

    Why: oneDNN generates (JIT-compiles) its matmul kernels for every new shape, and with a new token count
    per batch that code generation took 10-20% of a worker's time under load (perf: Xbyak's code emitter
    among the top symbols). With these steps a 16k-token budget needs about 100 shapes per linear layer, all
    of them kept in oneDNN's primitive cache after their first use. A bf16 batch that the project's
    short-sequence kernel serves whole runs unpadded (models/loader.EmbeddingModel._pads).
    """
    step = 16 if tokens <= 256 else 64 if tokens <= 2048 else 256
    return -(-tokens // step) * step
