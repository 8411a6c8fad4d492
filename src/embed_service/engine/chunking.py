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

Cost: each window is a sequence, and admission counts it as one: a chunked request's inputs take one
slot each while they are tokenized, and each further window takes one more (see `run_windowed`). A text
is read whole, so one longer than --max-input-chars is refused, and one that would make more than
--max-chunks-per-input windows is refused once tokenized, before any of its windows runs.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embed_service.engine.admission import Permit, Slots
from embed_service.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChunkOptions:
    """A request's chunking choices; None means the server's default."""

    enabled: bool | None = None
    overlap: int | None = None
    return_chunks: bool = False


@dataclass(frozen=True)
class ChunkRule:
    """Chunking as resolved for one request."""

    overlap: int
    max_chunks: int
    max_length: int
    max_chars: int
    return_chunks: bool


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


def plan(
    tokenizer: Tokenizer, texts: list[str], prompt: str | None, rule: ChunkRule, first: int = 0
) -> list[list[Window]]:
    """The windows of each text (one, the plain sequence, for a text that fits). Runs on a tokenization
    thread; `first` is the index of texts[0] in its request, for messages."""
    room = check_overlap(tokenizer, rule, prompt)
    head = tokenizer.template_head + (
        tokenizer.backend.encode(prompt, add_special_tokens=False).ids if prompt else []
    )
    tail = tokenizer.template_tail + ([tokenizer.eos_appended] if tokenizer.eos_appended is not None else [])
    check_chars(texts, prompt, rule, first)
    out = []
    for text in texts:
        whole = tokenizer.encode([text], prompt)[0]
        if len(whole) <= rule.max_length:
            out.append([Window(whole, 0, len(text), len(whole) - len(head) - len(tail))])
            continue
        e = tokenizer.backend.encode(text, add_special_tokens=False)
        ids, offsets = e.ids, e.offsets
        count = window_count(len(ids), room, rule.overlap)
        if count > rule.max_chunks:
            raise ChunkError(
                f"input {first + len(out)} has {len(ids)} tokens, which make {count} windows of {room}; "
                f"the limit is {rule.max_chunks} per input (--max-chunks-per-input)"
            )
        out.append(
            [
                Window(head + ids[s:e_] + tail, offsets[s][0], offsets[e_ - 1][1], e_ - s)
                for s, e_ in window_bounds(len(ids), room, rule.overlap)
            ]
        )
    return out


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

    Like admission.run_piecewise, with windows as the units of capacity: an input takes one slot while it
    is tokenized (`plan_piece(first, k)` plans inputs first..first+k-1), its first window keeps that slot,
    and each further window is one more unit of the request (`Permit.extend`), started when the permit has
    a free slot. Windows waiting for a slot go before inputs not yet tokenized. It waits only for its own
    windows to be answered, never for capacity it does not hold, so it cannot deadlock.
    """
    futures: list[list[asyncio.Future]] = []
    waiting: deque[tuple[int, Window]] = deque()  # (input index, window) not started yet
    slots = Slots(permit)

    def start(items: list[tuple[int, Window]]) -> None:
        for (i, _), future in zip(items, submit([w for _, w in items])):
            slots.watch(future)
            futures[i].append(future)

    while len(futures) < n or waiting:
        k = await slots.free()
        if slots.failed:
            break
        if waiting:
            k = min(k, len(waiting))
            permit.take(k)
            start([waiting.popleft() for _ in range(k)])
            continue
        k = min(k, n - len(futures))
        permit.take(k)
        first = len(futures)
        planned = await plan_piece(first, k)
        futures += [[] for _ in planned]
        for windows in planned:
            permit.extend(len(windows) - 1)
        start([(first + j, windows[0]) for j, windows in enumerate(planned)])
        waiting.extend((first + j, w) for j, windows in enumerate(planned) for w in windows[1:])
    return [list(await asyncio.gather(*fs)) for fs in futures]


@dataclass
class Chunks:
    """One input's windows as a response gives them: (start, end, tokens) per window, and their vectors."""

    spans: list[tuple[int, int, int]]  # characters [start, end) of the text, text tokens
    vectors: np.ndarray  # (w, d) float32, finished as the input's vector is
