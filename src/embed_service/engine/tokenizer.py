"""Tokenization as the model's reference applies it, plus truncation that keeps the special tokens.

Texts go through the fast tokenizer's batch API (Rust, releases the GIL), with its special-token template;
token-id inputs are taken verbatim. Both are cut by one rule: keep the template's leading and trailing
special tokens, drop content from the right (or the left) until the sequence fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from embed_service.models.spec import ModelSpec


class InputTooLongError(ValueError):
    def __init__(self, index: int, length: int, limit: int):
        super().__init__(
            f"input {index} has {length} tokens, more than the maximum of {limit}; "
            "shorten it or send truncate=true"
        )
        self.index = index


class InvalidTokenError(ValueError):
    pass


@dataclass(frozen=True)
class Truncation:
    enabled: bool
    max_length: int
    direction: str = "right"


class Tokenizer:
    def __init__(self, spec: ModelSpec):
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(spec.path))
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{spec.path}: a fast tokenizer (tokenizer.json) is needed")
        self.backend = hf.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()
        self.vocab_size = max(len(hf), int(spec.config.get("vocab_size", 0)))
        probe = self.backend.encode("a", add_special_tokens=True)
        content = [i for i, special in enumerate(probe.special_tokens_mask) if not special]
        # How many template tokens stand before and after the content ([CLS] ... [SEP] -> 1, 1).
        self.prefix_len = content[0] if content else 0
        self.suffix_len = len(probe.ids) - content[-1] - 1 if content else 0

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=True)]

    def check_ids(self, seqs: list[list[int]]) -> None:
        for i, seq in enumerate(seqs):
            for t in seq:
                if not 0 <= t < self.vocab_size:
                    raise InvalidTokenError(
                        f"input {i}: token id {t} is outside the vocabulary (0..{self.vocab_size - 1})"
                    )

    def truncate(self, seqs: list[list[int]], rule: Truncation) -> list[list[int]]:
        out = []
        for i, ids in enumerate(seqs):
            if len(ids) <= rule.max_length:
                out.append(ids)
                continue
            if not rule.enabled:
                raise InputTooLongError(i, len(ids), rule.max_length)
            out.append(self.cut(ids, rule.max_length, rule.direction))
        return out

    def cut(self, ids: list[int], max_length: int, direction: str) -> list[int]:
        head, tail = self.prefix_len, self.suffix_len
        if head + tail >= max_length or head + tail >= len(ids):
            return ids[:max_length] if direction == "right" else ids[-max_length:]
        keep = max_length - head - tail
        body = ids[head : len(ids) - tail]
        body = body[:keep] if direction == "right" else body[len(body) - keep :]
        return ids[:head] + body + (ids[len(ids) - tail :] if tail else [])
