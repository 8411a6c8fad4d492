"""Late chunking: chunk vectors that know their document, from one forward pass of the whole document.

As in Günther et al., "Late Chunking: Contextual Chunk Embeddings Using Long-Context Embedding Models"
(2024, arXiv 2409.04701): the whole input runs through the model once, as one sequence, and each chunk's
vector is the mean of the last hidden states of the chunk's tokens, then the model's Dense layers (if any),
``dimensions`` and normalization as for any vector. The mean is the paper's pooling for every model: for a
mean-pooling model it is the model's own pooling over the chunk; a CLS or last-token model's chunks are
pooled by the mean too.

A chunk is given by its characters ([start, end) of the input) or cut by the server in tokens:

- ``spans``: character spans of one input (a request of one input). A token belongs to the span its first
  character falls in (its offsets, from the fast tokenizer); spans may not overlap, must lie inside the
  text, and each must hold at least one token.
- ``size`` (and ``overlap``): chunks of ``size`` text tokens, each starting ``size - overlap`` tokens after
  the last, the last ending at the text's last token (the windows of engine/chunking.py, in tokens of one
  sequence); each chunk's span is the characters its tokens cover.
- Jina's ``late_chunking: true``: the inputs are the consecutive chunks of one document; they are joined as
  they are (no separator: keep the whitespace between chunks in them) and each input is one span.

The sequence is the model's template around the text's tokens (the prompt's tokens after the leading
special tokens, tokenized on their own): without a prompt it is the plain sequence, so the input's own
``embedding`` beside its chunks is its plain vector. An input that fits the max input length is one
sequence, admitted and counted as an unchunked input; a longer one runs as macro-windows (`macro_windows`,
the paper's long late chunking), admitted and bounded as the windows of engine/chunking.py are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from embed_service.engine.chunking import ChunkError, ChunkOptions, Window, window_bounds
from embed_service.engine.tokenizer import Tokenizer
from embed_service.outputs import DENSE, LATE, OutputRequest, SequenceOutput

SPANS = "chunking.spans"


@dataclass(frozen=True)
class LateWindow(Window):
    """A sequence of a late-chunked input, and what it asks the heads for (its spans' rows)."""

    request: OutputRequest = OutputRequest()


@dataclass(frozen=True)
class LatePlan:
    """One input's sequences (one, or a long document's macro-windows), its chunks' (start, end, tokens) in
    characters, and per chunk the pieces it is pooled from: (window, span of that window, tokens). A long
    document's last piece list is its whole sequence (its own vector); a short one's is its dense output."""

    windows: list[LateWindow]
    spans: list[tuple[int, int, int]]
    parts: list[list[tuple[int, int, int]]]
    long: bool = False


def joined(inputs: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """Jina's shape: the inputs as one document and each input's character span in it."""
    spans, at = [], 0
    for text in inputs:
        spans.append((at, at + len(text)))
        at += len(text)
    return "".join(inputs), spans


def check_options(opts: ChunkOptions, inputs: int) -> None:
    """Refusals that need no tokenizing: the shape of the request's late chunking options."""
    if (opts.spans is None) == (opts.size is None):
        raise ChunkError(
            'late chunking takes either "spans" (character spans of one input) or "size" (tokens per chunk)',
            param="chunking",
        )
    if opts.spans is not None:
        if inputs != 1:
            raise ChunkError(
                f"chunking.spans are the character spans of one input; the request has {inputs} inputs",
                param=SPANS,
            )
        if not opts.spans:
            raise ChunkError("chunking.spans must name at least one span", param=SPANS)
        if opts.overlap is not None:
            raise ChunkError("chunking.overlap applies to size-cut chunks, not to spans", "chunking.overlap")
    if opts.size is not None and not 0 <= (opts.overlap or 0) < opts.size:
        raise ChunkError(
            f"chunking.overlap must be in 0..{opts.size - 1} (less than chunking.size), got {opts.overlap}",
            param="chunking.overlap",
        )


def check_spans(spans: list[tuple[int, int]], length: int) -> None:
    """Each span inside the text, not empty, and no two overlapping (named by their place in the list)."""
    for j, (s, e) in enumerate(spans):
        if not 0 <= s <= e <= length:
            raise ChunkError(
                f"chunking.spans[{j}] = [{s}, {e}] is out of range: the input has {length} characters",
                param=SPANS,
            )
        if s == e:
            raise ChunkError(f"chunking.spans[{j}] = [{s}, {e}] is empty", param=SPANS)
    order = sorted(range(len(spans)), key=lambda j: spans[j])
    for a, b in zip(order, order[1:]):
        if spans[b][0] < spans[a][1]:
            raise ChunkError(
                f"chunking.spans[{a}] = {list(spans[a])} and chunking.spans[{b}] = {list(spans[b])} overlap",
                param=SPANS,
            )


def plan(
    tokenizer: Tokenizer,
    text: str,
    prompt: str | None,
    opts: ChunkOptions,
    max_length: int,
    index: int,
    max_chunks: int = 1,
    combinable: bool = True,
) -> LatePlan:
    """One input's sequences and chunks. Runs on a tokenization thread (the text's characters are checked).
    `max_chunks`: the macro-windows a long input may make; `combinable`: the model has no Dense layers after
    its pooling, so a chunk's vector may be the token-weighted mean of its pieces' (long late chunking as
    the paper's code does it: `macro_windows`); else each chunk is pooled from one window (`chunk_windows`)."""
    spans = [(int(s), int(e)) for s, e in opts.spans] if opts.spans is not None else None
    if spans is not None:
        check_spans(spans, len(text))
    head = tokenizer.template_head + (
        tokenizer.backend.encode(prompt, add_special_tokens=False).ids if prompt else []
    )
    tail = tokenizer.template_tail + ([tokenizer.eos_appended] if tokenizer.eos_appended is not None else [])
    e = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, offsets = e.ids, e.offsets
    if spans is None:
        assert opts.size is not None
        if not ids:
            raise ChunkError(f"input {index} has no tokens to chunk")
        bounds = window_bounds(len(ids), opts.size, opts.overlap or 0)
    else:
        starts = [o[0] for o in offsets]
        # Jina's shape: the spans are the inputs
        bounds = (
            token_bounds(spans, starts, "input {}", "input") if opts.joined else token_bounds(spans, starts)
        )
    chars = [(offsets[s][0], offsets[t - 1][1]) for s, t in bounds] if spans is None else spans
    chunks = [(a, b, t - s) for (a, b), (s, t) in zip(chars, bounds)]
    seq = head + ids + tail
    rows = [(len(head) + s, len(head) + t) for s, t in bounds]
    if len(seq) <= max_length:
        request = OutputRequest(frozenset({DENSE, LATE}), spans=tuple(rows))
        window = LateWindow(seq, 0, len(text), len(ids), request)
        return LatePlan([window], chunks, [[(0, k, t - s)] for k, (s, t) in enumerate(rows)])
    if combinable:
        windows, parts = macro_windows(seq, rows, max_length, opts.context_overlap or 0, max_chunks, index)
    else:
        param = "input" if opts.joined else SPANS if spans is not None else "chunking.size"
        windows, parts = chunk_windows(
            seq, rows, max_length, opts.context_overlap or 0, max_chunks, index, param
        )
    return LatePlan(windows, chunks, parts, long=True)


def _check_overlap(overlap: int, max_length: int) -> None:
    if not 0 <= overlap <= max_length // 2:
        raise ChunkError(
            f"chunking.context_overlap must be in 0..{max_length // 2} tokens (half of the {max_length} of a "
            f"window), got {overlap}",
            param="chunking.context_overlap",
        )


def _check_count(windows: int, tokens: int, max_length: int, max_chunks: int, index: int) -> None:
    if windows > max_chunks:
        raise ChunkError(
            f"input {index} has {tokens} tokens, which make {windows} windows of {max_length}; "
            f"the limit is {max_chunks} per input (--max-chunks-per-input)"
        )


def macro_windows(
    seq: list[int], rows: list[tuple[int, int]], max_length: int, overlap: int, max_chunks: int, index: int
) -> tuple[list[LateWindow], list[list[tuple[int, int, int]]]]:
    """Long late chunking, as the paper's code does it: the whole sequence (its special tokens at its ends
    only) cut into windows of `max_length` tokens, each starting `max_length - overlap` after the one before;
    each token's vector comes from the first window in which it is not one of the `overlap` leading tokens
    of context, so window j > 0 owns its tokens from its (overlap + 1)-th on. A chunk is pooled from the
    pieces of it each window owns; the whole sequence is one more chunk (the input's own vector)."""
    _check_overlap(overlap, max_length)
    bounds = window_bounds(len(seq), max_length, overlap)
    _check_count(len(bounds), len(seq), max_length, max_chunks, index)
    owned = [(s + (overlap if j else 0), e) for j, (s, e) in enumerate(bounds)]
    return _pieces(seq, rows, bounds, owned)


def chunk_windows(
    seq: list[int],
    rows: list[tuple[int, int]],
    max_length: int,
    overlap: int,
    max_chunks: int,
    index: int,
    param: str = SPANS,
) -> tuple[list[LateWindow], list[list[tuple[int, int, int]]]]:
    """Long late chunking for a model with Dense layers after its pooling, which do not commute with the
    mean: each chunk is pooled whole from one window, then the Dense layers. Taking the chunks in the order
    of their first token, a window opens for the first chunk no window holds yet: `overlap` tokens of
    context before the chunk (from the sequence's start when that reaches its leading special tokens; fewer
    when the chunk is longer than ``max_length - overlap``; more when the window would pass the sequence's
    end, so that the last window holds ``max_length`` tokens), `max_length` tokens long; it holds every
    chunk that lies inside it. The input's own vector: its windows' vectors weighted by their tokens, each
    window's the mean of the tokens it adds to the ones before it, then the Dense layers (as long inputs'
    windows are averaged without late chunking)."""
    _check_overlap(overlap, max_length)
    first = min((a for a, _ in rows), default=0)  # the text's first token: after the template's head
    bounds: list[tuple[int, int]] = []
    held = [False] * len(rows)
    for k in sorted(range(len(rows)), key=lambda k: rows[k]):
        if held[k]:
            continue
        a, b = rows[k]
        if b - a > max_length:
            raise ChunkError(
                f"chunk {k} of input {index} has {b - a} tokens, more than the {max_length} of the model's "
                "window: a model with Dense layers after its pooling pools each chunk from one window",
                param=param,
            )
        start = max(0, a - overlap)
        start = 0 if start <= first else start
        start = max(b - max_length, min(start, len(seq) - max_length))
        end = min(len(seq), start + max_length)
        for q, (x, y) in enumerate(rows):
            held[q] = held[q] or (start <= x and y <= end)
        bounds.append((start, end))
    _check_count(len(bounds), len(seq), max_length, max_chunks, index)
    owned = [(max(s, bounds[j - 1][1]) if j else s, e) for j, (s, e) in enumerate(bounds)]
    window_of = [next(j for j, (s, e) in enumerate(bounds) if s <= a and b <= e) for a, b in rows]
    return _pieces(seq, rows, bounds, owned, window_of)


def _pieces(
    seq: list[int],
    rows: list[tuple[int, int]],
    bounds: list[tuple[int, int]],
    owned: list[tuple[int, int]],
    window_of: list[int] | None = None,
) -> tuple[list[LateWindow], list[list[tuple[int, int, int]]]]:
    """The windows and each chunk's pieces (window, its span's place in that window's spans, tokens): a
    chunk's pieces are what each window owns of it, or (`window_of`) the whole chunk from its one window;
    the last chunk is the whole sequence (the input's own vector), from the `owned` ranges."""
    spans: list[list[tuple[int, int]]] = [[] for _ in bounds]
    parts = []

    def piece(j: int, x: int, y: int) -> tuple[int, int, int]:
        spans[j].append((x - bounds[j][0], y - bounds[j][0]))
        return (j, len(spans[j]) - 1, y - x)

    for c, (a, b) in enumerate([*rows, (0, len(seq))]):
        if window_of is not None and c < len(rows):
            parts.append([piece(window_of[c], a, b)])
            continue
        mine = []
        for j, (lo, hi) in enumerate(owned):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                mine.append(piece(j, x, y))
        parts.append(mine)
    windows = [
        LateWindow(seq[s:e], 0, 0, e - s, OutputRequest(frozenset({LATE}), spans=tuple(spans[j])))
        for j, (s, e) in enumerate(bounds)
    ]
    return windows, parts


def combine(plan: LatePlan, outputs: list[SequenceOutput]) -> tuple[np.ndarray, np.ndarray]:
    """(S, D) chunk vectors and the input's (D,) vector, from its windows' outputs: each chunk the mean of
    its pieces' means weighted by their tokens (a short input: its one window's rows as they are)."""
    pooled = []
    for mine in plan.parts:
        if len(mine) == 1:
            j, k, _ = mine[0]
            pooled.append(outputs[j].late[k])  # type: ignore[index]
            continue
        w = np.array([n for _, _, n in mine], dtype=np.float32)
        rows = np.stack([outputs[j].late[k] for j, k, _ in mine])  # type: ignore[index]
        pooled.append((w / w.sum()) @ rows.astype(np.float32, copy=False))
    vectors = np.stack(pooled).astype(np.float32, copy=False)
    if plan.long:
        return vectors[:-1], vectors[-1]
    return vectors, outputs[0].dense  # type: ignore[return-value]


def token_bounds(
    spans: list[tuple[int, int]], starts: list[int], name: str = "chunking.spans[{}] = {}", param: str = SPANS
) -> list[tuple[int, int]]:
    """Each character span's tokens, as [first, last + 1): those whose first character lies in the span
    (`starts`: each token's first character, ascending). A span that holds no token is refused (`name`:
    how the message names span j, formatted with j and the span)."""
    out = []
    for j, (s, e) in enumerate(spans):
        first, end = bisect.bisect_left(starts, s), bisect.bisect_left(starts, e)
        if first == end:
            raise ChunkError(f"{name.format(j, [s, e])} holds no token (only whitespace?)", param)
        out.append((first, end))
    return out
