"""Tokenization as the model's reference applies it, plus truncation that keeps the special tokens.

Texts go through the fast tokenizer's batch API (Rust, releases the GIL), with its special-token template;
token-id inputs are taken verbatim. Both are cut by one rule: keep the template's leading and trailing
special tokens, drop content from the right (or the left) until the sequence fits.

Two things the template alone does not do, done here as the model's documented usage does them:
- ``add_eos_token: true`` in tokenizer_config.json (e5-mistral, gte-Qwen2 style) appends the EOS token to
  every text. transformers 5 ignores that key; the EOS is appended unless the template already ends with it,
  and truncation keeps it.
- A prompt (sentence-transformers' ``prompts``) is prepended to each text before tokenization; left
  truncation keeps it, as it keeps the leading special tokens. A prompt that leaves no room for a token of
  text is refused.

Bounded by characters before tokenizing. A text longer than the max input length can use is cut before it
reaches the tokenizer, so memory and CPU do not grow with what a client sent. The cut must not change the
result, and a plain characters-per-token bound cannot promise that alone: whitespace, control characters
and stripped accents make no token at all. So the cut is checked: the tokenizers' models encode each
pre-token (word) on its own, and the standard normalizers and pre-tokenizers decide a word from its
neighbours only, so every token of a window of the text is the full text's token except those of the
window's last two words (and, for a window taken from the end, its first two). A window of
``(tokens needed + 8) * longest token string`` characters (a token covers at most that many characters
of the input: ``##`` and byte-level symbols only make token strings longer) usually holds enough of those
tokens; when not (much whitespace), it grows four times at a time up to ``max_chars``; a text whose cut
cannot be decided within that is refused, never guessed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tokenizers

from embed_service.models.spec import ModelSpec


class InputTooLongError(ValueError):
    def __init__(self, index: int, length: int, limit: int):
        super().__init__(
            f"input {index} has more than the maximum of {limit} tokens (at least {length}); "
            "shorten it or send truncate=true"
        )
        self.index, self.length, self.limit = index, length, limit


class InvalidTokenError(ValueError):
    pass


class InputCharsError(ValueError):
    """An input whose truncation cannot be decided within the characters the tokenizer may read."""

    def __init__(self, index: int, chars: int, limit: int, why: str):
        super().__init__(
            f"input {index} has {chars} characters; {why} within the first {limit} characters "
            "(--max-input-chars); shorten it (or strip its whitespace)"
        )
        self.index = index


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


PROMPT_CACHE_CHARS = 1 << 20  # characters of prompts whose token counts are kept (client prompts)
PROMPT_CACHE_ONE = 1 << 14  # a longer prompt is measured every time: one request must not fill the cache
FEW_TEXTS = 4  # up to this many short texts tokenize one call each, on the calling thread
GROWTH = 4  # a window that does not decide the cut grows this many times over


@dataclass(frozen=True)
class TokenizerFiles:
    """What transformers' AutoTokenizer makes of a model's tokenizer files, as plain data: the fast
    tokenizer (its JSON, template and added tokens included), its size and special ids. An HTTP front end
    builds its `Tokenizer` from the engine process's, without transformers (which imports torch)."""

    backend_json: str
    size: int
    eos_token_id: int | None
    special_ids: tuple[int | None, ...]  # cls, eos, pad, unk


def _read_tokenizer(spec: ModelSpec) -> tuple[Any, TokenizerFiles]:
    """The fast tokenizer transformers loads for `spec`, and its `TokenizerFiles`."""
    from transformers import AutoTokenizer  # imports torch: only where the model runs

    hf = AutoTokenizer.from_pretrained(str(spec.path))
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{spec.path}: a fast tokenizer (tokenizer.json) is needed")
    backend = hf.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    special = (hf.cls_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id)
    return backend, TokenizerFiles("", len(hf), hf.eos_token_id, special)  # its JSON: `Tokenizer.files`


class Tokenizer:
    def __init__(self, spec: ModelSpec, files: TokenizerFiles | None = None):
        """`spec`'s tokenizer, read with transformers; or, given `files` (another process's), rebuilt from
        them with the tokenizers library alone."""
        if files is None:
            self.backend, files = _read_tokenizer(spec)
        else:
            self.backend = tokenizers.Tokenizer.from_str(files.backend_json)
            self.backend.no_truncation()
            self.backend.no_padding()
        self._files = files
        # The short texts' batch call needs only the ids: the variant that tracks no character offsets is
        # 10-20% cheaper (tokenizers >= 0.20; 512-token texts 564 -> 450 us each, 32 per call).
        self._encode_ids = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        self.vocab_size = spec.check_tokenizer_size(files.size)
        probe = self.backend.encode("a", add_special_tokens=True)
        content = [i for i, special in enumerate(probe.special_tokens_mask) if not special]
        # How many template tokens stand before and after the content ([CLS] ... [SEP] -> 1, 1).
        self.prefix_len = content[0] if content else 0
        self.suffix_len = len(probe.ids) - content[-1] - 1 if content else 0
        # The EOS id to append to every text, when the tokenizer config asks and the template does not.
        self.eos_appended: int | None = None
        eos = files.eos_token_id
        if asks_for_eos(spec.path) and eos is not None and probe.ids[-1:] != [eos]:
            self.eos_appended = int(eos)
            self.suffix_len += 1
        # The template's own ids, to rebuild a sequence around content tokens taken from a window.
        self.template_head = list(probe.ids[: self.prefix_len])
        self.template_tail = list(probe.ids[content[-1] + 1 :]) if content else []
        # The ids lexical (sparse) weights leave out, as FlagEmbedding's BGEM3FlagModel: cls, eos, pad, unk.
        self.lexical_skip_ids = sorted({int(i) for i in files.special_ids if i is not None})
        self.prompts = spec.prompts
        self.default_prompt_name = spec.default_prompt_name
        # Characters one token covers at most (see the module docstring).
        self.token_chars = max([len(t) for t in self.backend.get_vocab(with_added_tokens=True)] or [1])
        self._prompt_lengths: OrderedDict[str, int] = OrderedDict()
        self._prompt_chars = 0
        self._prompt_lock = threading.Lock()  # tokenization threads and the event loop share the cache

    def files(self) -> TokenizerFiles:
        """This tokenizer as plain data, for a front-end process to rebuild."""
        return replace(self._files, backend_json=self.backend.to_str())

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
        measures it). Cached by characters: raw prompts come from clients."""
        with self._prompt_lock:
            known = self._prompt_lengths.get(prompt)
            if known is not None:
                self._prompt_lengths.move_to_end(prompt)
                return known
        length = len(self.backend.encode(prompt, add_special_tokens=False).ids)
        if len(prompt) <= PROMPT_CACHE_ONE:
            with self._prompt_lock:
                if prompt not in self._prompt_lengths:
                    self._prompt_lengths[prompt] = length
                    self._prompt_chars += len(prompt)
                while self._prompt_chars > PROMPT_CACHE_CHARS:
                    old, _ = self._prompt_lengths.popitem(last=False)
                    self._prompt_chars -= len(old)
        return length

    def room(self, max_length: int) -> int:
        """Content tokens (prompt and text) a sequence of `max_length` holds besides the special tokens."""
        return max_length - self.prefix_len - self.suffix_len

    def check_prompt(self, prompt: str | None, max_length: int) -> None:
        """Refuse a prompt that leaves no room for one token of text: every input would embed the same."""
        if not prompt:
            return
        length = self.prompt_length(prompt)
        if length >= self.room(max_length):
            raise PromptError(
                f"the prompt takes {length} tokens, and with the {self.prefix_len + self.suffix_len} special "
                f"tokens leaves no room for text within the max input length of {max_length} tokens; "
                "send a shorter prompt",
                "prompt",
            )

    def window(self, tokens: int) -> int:
        """Characters that usually hold `tokens` tokens whose cut is decided (see the module docstring)."""
        return (tokens + 8) * self.token_chars

    def encode(
        self,
        texts: list[str],
        prompt: str | None = None,
        rule: Truncation | None = None,
        max_chars: int | None = None,
        first_index: int = 0,
    ) -> list[list[int]]:
        """Token ids of `prompt + text` for each text, special tokens included, not yet truncated.

        With a `rule`, a text longer than the rule can use is cut first (the result, once truncated by
        the rule, is the same as for the whole text); `max_chars`: what the tokenizer may read of one
        input, the prompt included.
        """
        prompt = prompt or ""
        out: list[list[int] | None] = [None] * len(texts)
        direct: list[int] = []
        if rule is None:
            direct = list(range(len(texts)))
        else:
            room = self.room(rule.max_length)
            head = self.prompt_length(prompt) if prompt else 0
            for i, text in enumerate(texts):
                # Left truncation reads the start (for the prompt's tokens) and the end of the text.
                reach = self.window(room + 1) * (2 if rule.direction == "left" else 1)
                if len(text) <= reach:
                    direct.append(i)
                else:
                    out[i] = self._long(text, prompt, rule, room, head, max_chars, first_index + i)
        if direct:
            # Short texts: one batch call (Rust, releases the GIL), or a call each for a few. The prompt is
            # joined only to texts already known to be short: its copies are bounded by the request's
            # character budget.
            joined = [prompt + texts[i] for i in direct]
            if len(joined) <= FEW_TEXTS:
                # A few texts one at a time: the batch call hands even one text to the tokenizer's
                # thread pool and waits for it, dearer than the text itself on busy cores.
                encoded = [self.backend.encode(text, add_special_tokens=True) for text in joined]
            else:
                encoded = self._encode_ids(joined, add_special_tokens=True)
            for i, e in zip(direct, encoded):
                out[i] = self._with_eos(e.ids)
        return out  # type: ignore[return-value]

    def _with_eos(self, ids: list[int]) -> list[int]:
        if self.eos_appended is not None:
            ids.append(self.eos_appended)
        return ids

    def _long(
        self,
        text: str,
        prompt: str,
        rule: Truncation,
        room: int,
        head: int,
        max_chars: int | None,
        index: int,
    ) -> list[int]:
        """A sequence for a text longer than the rule can use, from windows of it: more content tokens
        than `room`, so that truncation cuts it exactly as it would cut the whole text's sequence."""
        limit = max(1, (max_chars or len(prompt) + len(text)) - len(prompt))
        try:
            if rule.direction == "right" or not rule.enabled:
                content = self._stable_head(text, prompt, room + 1, limit, index)
            else:
                # Left: the prompt's tokens from the start of the content, the rest from the end of the
                # text. Each side reads at most half the text, so the two windows never overlap.
                half = max(1, min(limit, len(text)) // 2)
                lead = self._stable_head(text, prompt, head, half, index)[:head] if head else []
                content = lead + self._stable_tail(text, room - head + 1, half, index)
        except InputCharsError:
            if len(text) > limit:
                raise
            # Windows did not decide it (much whitespace), but the whole text may be read: read it.
            return self._with_eos(self.backend.encode(prompt + text, add_special_tokens=True).ids)
        return self._with_eos(self.template_head + content + self.template_tail)

    def _stable_head(self, text: str, prompt: str, need: int, limit: int, index: int) -> list[int]:
        """Content ids from the start of `prompt + text`: at least `need` of them, each the whole text's
        own (or all of them, when the whole text fits within `limit`)."""
        width = self.window(need)
        while True:
            if width >= len(text) and len(text) <= limit:
                return self.backend.encode(prompt + text, add_special_tokens=False).ids
            width = min(width, limit)
            e = self.backend.encode(prompt + text[:width], add_special_tokens=False)
            words = [w for w in e.word_ids if w is not None]
            stable = sum(1 for w in words if w < words[-1] - 1) if words else 0
            if stable >= need:
                return e.ids[:stable]
            if width >= limit:
                raise InputCharsError(index, len(text), limit, f"it does not make {need} tokens")
            width *= GROWTH

    def _stable_tail(self, text: str, need: int, limit: int, index: int) -> list[int]:
        """Content ids of the end of `text` (no prompt): at least `need` of them, each the whole text's own."""
        width = self.window(need)
        while True:
            width = min(width, limit)
            e = self.backend.encode(text[len(text) - width :], add_special_tokens=False)
            words = [w for w in e.word_ids if w is not None]
            stable = sum(1 for w in words if w > words[0] + 1) if words else 0
            if stable >= need:
                return e.ids[len(e.ids) - stable :]
            if width >= limit:
                raise InputCharsError(index, len(text), limit, f"its end does not make {need} tokens")
            width *= GROWTH

    def tokens(self, ids: list[int]) -> list[str]:
        """The vocabulary's token for each id (ids known to be in range)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def check_ids(self, seqs: list[list[int]], first: int = 0) -> None:
        """`first`: the index of seqs[0] in its request, for the message."""
        for i, seq in enumerate(seqs, first):
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
