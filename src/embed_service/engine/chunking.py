"""Long inputs: a text longer than the max input length, embedded as windows whose vectors are averaged.

The text is tokenized whole (no special tokens), with the fast tokenizer's character offsets. Its tokens
are cut into windows of ``room`` tokens (the max input length less the template's special tokens and the
prompt's tokens), each starting ``stride = room - overlap`` tokens after the last; the last window ends
at the text's last token and may be shorter. A text of ``n`` tokens makes ``1 + ceil((n - room) / stride)``
windows. Each window is a sequence of its own, built as the model expects an input: the template's
leading special tokens, the prompt (in every window: each window is an input of the prompt's kind), the
window's tokens, the template's trailing ones (and the appended EOS of last-token models). It is pooled
as the model pools (mean, CLS, last token).

The combination (as vLLM's chunked processing does it): the windows' pooled vectors, before normalization,
averaged with each weighted by its number of text tokens; then, as for any input, ``dimensions`` and the
model's normalization. A text that fits one sequence is encoded as it would be without chunking, so its
vector is the plain one.

Cost, bounded per request before any window runs: a text is read whole, so one longer than
--max-input-chars is refused before it is tokenized; each text is tokenized once (a prompt adds a bounded
read of its start, to embed a text that fits exactly as without chunking); a text that would make more
than --max-chunks-per-input windows is refused, and so is a request whose windows make more tokens in all
than an unchunked request may (`ChunkRule.max_inputs` sequences of the max input length:
--max-client-batch-size x max input length), counted as its texts are planned, so a refusal stops
tokenizing at the text that passes the budget. Only then do windows run: each is a sequence, and the
request's permit is re-admitted for its windows (see `run_windowed`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from embed_service.engine.admission import Permit, run_piecewise
from embed_service.engine.tokenizer import Tokenizer, Truncation


@dataclass(frozen=True)
class ChunkOptions:
    """A request's chunking choices; None means the server's default."""

    enabled: bool | None = None
    overlap: int | None = None
    return_chunks: bool = False
    mode: str = "window"
    """"window": long inputs as averaged windows (this module); "late": late chunking (engine/late.py)."""
    spans: tuple[tuple[int, int], ...] | None = None
    """Late chunking: character spans [start, end) of the one input."""
    size: int | None = None
    """Late chunking: text tokens per chunk, cut by the server (`overlap` tokens shared)."""
    context_overlap: int | None = None
    """Long late chunking: tokens of context each macro-window shares with the one before."""
    joined: bool = False
    """Jina's late_chunking: the inputs are the consecutive chunks of one document."""


@dataclass(frozen=True)
class ChunkRule:
    """Chunking as resolved for one request. `max_inputs`: the request's budget, in sequences of
    `max_length` tokens (--max-client-batch-size: what an unchunked request may make); None: no budget."""

    overlap: int
    max_chunks: int
    max_length: int
    max_chars: int
    return_chunks: bool
    max_inputs: int | None = None
    late: ChunkOptions | None = None
    """Late chunking (engine/late.py): the request's options; None: windows."""

    @property
    def max_tokens(self) -> int | None:
        """Tokens the windows of one request may make in all, special tokens and prompt included."""
        return None if self.max_inputs is None else self.max_inputs * self.max_length


@dataclass(frozen=True)
class Window:
    """One window of one text: its token ids (special tokens and prompt included), the characters of the
    text its tokens cover, and its weight (its number of text tokens)."""

    ids: list[int]
    start: int
    end: int
    weight: int


class ChunkError(ValueError):
    """An input chunking cannot take (too many characters to read, too many windows, a bad overlap)."""

    def __init__(self, message: str, param: str = "input"):
        super().__init__(message)
        self.param = param


def window_count(tokens: int, room: int, overlap: int) -> int:
    """Windows a text of `tokens` tokens makes (see the module docstring)."""
    if tokens <= room:
        return 1
    return 1 + math.ceil((tokens - room) / (room - overlap))


def window_bounds(tokens: int, room: int, overlap: int) -> list[tuple[int, int]]:
    """Each window's [start, end) in the text's tokens."""
    stride = room - overlap
    return [(j * stride, min(j * stride + room, tokens)) for j in range(window_count(tokens, room, overlap))]


def check_overlap(tokenizer: Tokenizer, rule: ChunkRule, prompt: str | None) -> int:
    """The text tokens one window holds; refuses an overlap of more than half of them (each window must
    move on by at least half a window, so the windows of a text stay fewer than twice its tokens / room)."""
    room = tokenizer.room(rule.max_length) - (tokenizer.prompt_length(prompt) if prompt else 0)
    if not 0 <= rule.overlap <= room // 2:
        raise ChunkError(
            f"chunking.overlap must be in 0..{room // 2} tokens (half of the {room} text tokens a window "
            f"holds), got {rule.overlap}",
            param="chunking.overlap",
        )
    return room


def check_chars(texts: list[str], prompt: str | None, rule: ChunkRule, first: int = 0) -> None:
    """A chunked text is read whole: refuse one past the characters the tokenizer may read."""
    for i, text in enumerate(texts):
        if len(text) + len(prompt or "") > rule.max_chars:
            raise ChunkError(
                f"input {first + i} has {len(text)} characters; a chunked input is read whole, and may have "
                f"at most {rule.max_chars} with its prompt (--max-input-chars)"
            )


@dataclass
class Tally:
    """A request's windows and their tokens so far, as its texts are planned, against `rule.max_tokens`."""

    rule: ChunkRule
    windows: int = 0
    tokens: int = 0

    def add(self, windows: Sequence[Window], index: int) -> None:
        """Count input `index`'s windows; refuse the request once they pass its budget."""
        self.windows += len(windows)
        self.tokens += sum(len(w.ids) for w in windows)
        limit = self.rule.max_tokens
        if limit is not None and self.tokens > limit:
            what = "input 0 makes" if index == 0 else f"the first {index + 1} inputs make"
            raise ChunkError(
                f"with chunking, {what} {self.tokens} tokens in {self.windows} windows, more than the "
                f"{limit} tokens one request may make ({self.rule.max_inputs} sequences of "
                f"{self.rule.max_length}: --max-client-batch-size x the max input length, as without "
                "chunking); send fewer or shorter inputs, or a smaller chunking.overlap"
            )


def plan(
    tokenizer: Tokenizer,
    texts: list[str],
    prompt: str | None,
    rule: ChunkRule,
    first: int = 0,
    tally: Tally | None = None,
) -> list[list[Window]]:
    """The windows of each text (one, the plain sequence, for a text that fits). Runs on a tokenization
    thread; `first` is the index of texts[0] in its request, for messages; `tally`: the request's count
    so far, which refuses the text that passes its budget (a fresh one by default).

    Each text is tokenized once, whole, without special tokens: without a prompt the plain sequence is
    the template around those tokens (the post-processor only adds the special tokens), so the one
    tokenization decides whether the text fits and cuts its windows. A prompt is tokenized with the text
    as the plain sequence is (the words at the join may differ), read only as far as the max input length
    needs (`Tokenizer.encode` with a truncation rule), so it costs a bounded read of the text's start.
    """
    room = check_overlap(tokenizer, rule, prompt)
    tally = tally or Tally(rule)
    head = tokenizer.template_head + (
        tokenizer.backend.encode(prompt, add_special_tokens=False).ids if prompt else []
    )
    tail = tokenizer.template_tail + ([tokenizer.eos_appended] if tokenizer.eos_appended is not None else [])
    check_chars(texts, prompt, rule, first)
    joined: list[list[int] | None] = [None] * len(texts)
    if prompt:
        cut = Truncation(True, rule.max_length)
        joined = tokenizer.encode(texts, prompt, cut, rule.max_chars, first)  # type: ignore[assignment]
    out = []
    for i, text in enumerate(texts):
        plain = joined[i]
        if plain is not None and len(plain) <= rule.max_length:
            windows = [Window(plain, 0, len(text), len(plain) - len(head) - len(tail))]
        else:
            windows = _windows(tokenizer, text, head, tail, room, rule, first + i, plain is None)
        tally.add(windows, first + i)
        out.append(windows)
    return out


def _windows(
    tokenizer: Tokenizer,
    text: str,
    head: list[int],
    tail: list[int],
    room: int,
    rule: ChunkRule,
    index: int,
    may_fit: bool,
) -> list[Window]:
    """One text's windows, from its one whole tokenization (`may_fit`: no prompt decided it is long)."""
    e = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, offsets = e.ids, e.offsets
    if may_fit and len(head) + len(ids) + len(tail) <= rule.max_length:
        return [Window(head + ids + tail, 0, len(text), len(ids))]
    count = window_count(len(ids), room, rule.overlap)
    if count > rule.max_chunks:
        raise ChunkError(
            f"input {index} has {len(ids)} tokens, which make {count} windows of {room}; "
            f"the limit is {rule.max_chunks} per input (--max-chunks-per-input)"
        )
    return [
        Window(head + ids[s:e_] + tail, offsets[s][0], offsets[e_ - 1][1], e_ - s)
        for s, e_ in window_bounds(len(ids), room, rule.overlap)
    ]


def combine(vectors: np.ndarray, weights: list[int]) -> np.ndarray:
    """(w, D) pooled window vectors -> (D,) their average weighted by tokens, in float32. A text of one
    window is its vector as it is (a text with no content token, e.g. only a control character, weighs 0)."""
    if len(weights) == 1:
        return vectors[0].astype(np.float32, copy=False)
    w = np.asarray(weights, dtype=np.float32)
    return (w @ vectors.astype(np.float32, copy=False)) / np.float32(w.sum())


async def run_windowed(
    permit: Permit,
    n: int,
    plan_piece: Callable[[int, int], Awaitable[list[list[Window]]]],
    submit: Callable[[list[Window]], list[asyncio.Future]],
) -> list[list[Any]]:
    """Answer a chunked request of `n` inputs through its permit: per input, its windows' results in order.

    First the request is planned whole (`plan_piece(first, k)` plans inputs first..first+k-1: tokenized,
    cut into windows, refused past a budget) under the capacity it was admitted with, so that no window
    runs for a request that is then refused. Then its permit is re-admitted for its windows
    (`Admission.resize`), as a request of that many inputs would be admitted: a request of one input of
    64 windows holds up to 64 slots (within the piecewise window), not the one its input took, and its
    windows run side by side. They enter as admission.run_piecewise starts inputs: as many as the permit
    has free slots, the rest as the request's own earlier windows are answered, so it never waits for
    capacity it does not hold and cannot deadlock.
    """
    planned = await plan_piece(0, n)
    flat = [(i, w) for i, windows in enumerate(planned) for w in windows]
    permit.admission.resize(permit, len(flat))

    async def start(first: int, k: int) -> list[asyncio.Future]:
        return submit([w for _, w in flat[first : first + k]])

    results = await run_piecewise(permit, len(flat), start)
    out: list[list[Any]] = [[] for _ in planned]
    for (i, _), result in zip(flat, results):
        out[i].append(result)
    return out


@dataclass
class Chunks:
    """One input's windows as a response gives them: (start, end, tokens) per window, and their vectors."""

    spans: list[tuple[int, int, int]]  # characters [start, end) of the text, text tokens
    vectors: np.ndarray  # (w, d) float32, finished as the input's vector is
