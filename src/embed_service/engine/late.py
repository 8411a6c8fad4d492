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
``embedding`` beside its chunks is its plain vector. The input must fit the max input length; its tokens
are admitted and counted as an unchunked input's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from embed_service.engine.chunking import ChunkError, ChunkOptions, window_bounds
from embed_service.engine.tokenizer import Tokenizer
from embed_service.outputs import DENSE, LATE, OutputRequest

SPANS = "chunking.spans"


@dataclass(frozen=True)
class LatePlan:
    """One input's sequence, the chunks' (start, end, tokens) in characters, and the rows the head pools."""

    ids: list[int]
    spans: list[tuple[int, int, int]]
    request: OutputRequest


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
) -> LatePlan:
    """One input's sequence and chunks. Runs on a tokenization thread (the text's characters are checked)."""
    spans = [(int(s), int(e)) for s, e in opts.spans] if opts.spans is not None else None
    if spans is not None:
        check_spans(spans, len(text))
    head = tokenizer.template_head + (
        tokenizer.backend.encode(prompt, add_special_tokens=False).ids if prompt else []
    )
    tail = tokenizer.template_tail + ([tokenizer.eos_appended] if tokenizer.eos_appended is not None else [])
    e = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, offsets = e.ids, e.offsets
    total = len(head) + len(ids) + len(tail)
    if total > max_length:
        raise ChunkError(
            f"input {index} makes {total} tokens, more than the {max_length} of the model's window; late "
            "chunking runs the whole input as one sequence (shorten it, or chunk it into windows without "
            '"mode": "late")'
        )
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
    rows = tuple((len(head) + s, len(head) + t) for s, t in bounds)
    return LatePlan(
        head + ids + tail,
        [(a, b, t - s) for (a, b), (s, t) in zip(chars, bounds)],
        OutputRequest(frozenset({DENSE, LATE}), spans=rows),
    )


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
