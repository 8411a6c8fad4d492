"""Tokenization as the model's reference applies it, plus truncation that keeps the special tokens.

Texts go through the fast tokenizer's batch API (Rust, releases the GIL), with its special-token template;
token-id inputs are taken verbatim. Both are cut by one rule: keep the template's leading and trailing
special tokens, drop content from the right (or the left) until the sequence fits.

Two things the template alone does not do, done here as the model's documented usage does them:
- ``add_eos_token: true`` in tokenizer_config.json (e5-mistral, gte-Qwen2 style) appends the EOS token to
  every text. transformers 5 ignores that key; the EOS is appended unless the template already ends with it,
  and truncation keeps it.
- A prompt (sentence-transformers' ``prompts``) is prepended to each text before tokenization; left
  truncation keeps it, as it keeps the leading special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


class PromptError(ValueError):
    """A prompt that cannot be applied; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def asks_for_eos(path: Path) -> bool:
    """Whether tokenizer_config.json sets ``add_eos_token: true``."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return False
    with open(file, encoding="utf-8") as f:
        return json.load(f).get("add_eos_token") is True


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
        self.vocab_size = spec.check_tokenizer_size(len(hf))
        probe = self.backend.encode("a", add_special_tokens=True)
        content = [i for i, special in enumerate(probe.special_tokens_mask) if not special]
        # How many template tokens stand before and after the content ([CLS] ... [SEP] -> 1, 1).
        self.prefix_len = content[0] if content else 0
        self.suffix_len = len(probe.ids) - content[-1] - 1 if content else 0
        # The EOS id to append to every text, when the tokenizer config asks and the template does not.
        self.eos_appended: int | None = None
        eos = hf.eos_token_id
        if asks_for_eos(spec.path) and eos is not None and probe.ids[-1:] != [eos]:
            self.eos_appended = int(eos)
            self.suffix_len += 1
        self.prompts = spec.prompts
        self.default_prompt_name = spec.default_prompt_name
        self._prompt_lengths: dict[str, int] = {}

    def prompt_for(
        self, inputs: list[str] | list[list[int]], prompt_name: str | None, prompt: str | None
    ) -> str | None:
        """The prompt to prepend to text inputs: the raw one, else the named one, else the model's default.

        Token ids are used verbatim: no default prompt, and an explicit one is refused.
        """
        if prompt is not None and prompt_name is not None:
            raise PromptError("send either prompt or prompt_name, not both", "prompt")
        if not (inputs and isinstance(inputs[0], str)):
            if prompt is not None or prompt_name is not None:
                param = "prompt" if prompt is not None else "prompt_name"
                raise PromptError("prompts apply to text inputs; token ids are used verbatim", param)
            return None
        if prompt is not None:
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                known = ", ".join(sorted(self.prompts)) or "none"
                raise PromptError(
                    f"unknown prompt_name {prompt_name!r}; this model's prompts: {known}", "prompt_name"
                )
            return self.prompts[prompt_name]
        if self.default_prompt_name is not None:
            return self.prompts[self.default_prompt_name]
        return None

    def prompt_length(self, prompt: str) -> int:
        """Tokens the prompt takes at the start of the content (tokenized alone, as sentence-transformers
        measures it)."""
        if prompt not in self._prompt_lengths:
            if len(self._prompt_lengths) > 1024:  # raw prompts come from clients: keep the cache bounded
                self._prompt_lengths.clear()
            self._prompt_lengths[prompt] = len(self.backend.encode(prompt, add_special_tokens=False).ids)
        return self._prompt_lengths[prompt]

    def encode(self, texts: list[str], prompt: str | None = None) -> list[list[int]]:
        if prompt:
            texts = [prompt + t for t in texts]
        seqs = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=True)]
        if self.eos_appended is not None:
            for ids in seqs:
                ids.append(self.eos_appended)
        return seqs

    def check_ids(self, seqs: list[list[int]]) -> None:
        for i, seq in enumerate(seqs):
            for t in seq:
                if not 0 <= t < self.vocab_size:
                    raise InvalidTokenError(
                        f"input {i}: token id {t} is outside the vocabulary (0..{self.vocab_size - 1})"
                    )

    def truncate(self, seqs: list[list[int]], rule: Truncation, prompt: str | None = None) -> list[list[int]]:
        """Cut each sequence to the rule's length; ``prompt``: the one text inputs were encoded with."""
        kept_head = self.prefix_len + (self.prompt_length(prompt) if prompt else 0)
        out = []
        for i, ids in enumerate(seqs):
            if len(ids) <= rule.max_length:
                out.append(ids)
                continue
            if not rule.enabled:
                raise InputTooLongError(i, len(ids), rule.max_length)
            out.append(self.cut(ids, rule.max_length, rule.direction, kept_head))
        return out

    def cut(self, ids: list[int], max_length: int, direction: str, head: int | None = None) -> list[int]:
        """Keep ``head`` leading tokens (the template's, by default) and the template's trailing ones."""
        head = self.prefix_len if head is None else head
        tail = self.suffix_len
        if head + tail >= max_length or head + tail >= len(ids):
            return ids[:max_length] if direction == "right" else ids[-max_length:]
        keep = max_length - head - tail
        body = ids[head : len(ids) - tail]
        body = body[:keep] if direction == "right" else body[len(body) - keep :]
        return ids[:head] + body + (ids[len(ids) - tail :] if tail else [])
