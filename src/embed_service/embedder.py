"""`Embedder`: the server's engine in your own process, without HTTP.

The same engine, batcher and worker processes the server runs, built from the same `Settings` by the same
function (server.build_engine), so a vector equals the server's for the same inputs and options, bit for
bit. Options are checked by the API's own request models (requests/) and refusals are the engine's
exceptions (engine/errors.py) with the messages the API sends in its 400s.

The engine is asyncio code. An `Embedder` runs it on an event loop of its own, on a background thread
that lives until `close()`: `encode` blocks the calling thread on it, `aencode` awaits it from any other
loop. The worker processes are started from that thread and the kernel kills them when it ends
(PR_SET_PDEATHSIG), so a process that exits without `close()` leaves none behind.

Worker processes are started with multiprocessing's "spawn", which imports the main script again in each
worker: a script that builds an Embedder at import time must do so under ``if __name__ == "__main__":``.
Without it, the Embedder that import builds in a worker sees that it is inside a worker's start-up
(`_in_spawn_bootstrap`) and exits it with UNGUARDED_EXIT_CODE, and the script's own Embedder turns that
exit into one RuntimeError saying where the guard goes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from embed_service import __version__
from embed_service.config import Settings
from embed_service.engine.admission import input_chars
from embed_service.engine.chunking import Chunks
from embed_service.engine.engine import Engine
from embed_service.engine.errors import EngineError, InvalidInputError, OverloadedError
from embed_service.engine.text import EmbedOptions
from embed_service.engine_thread import EngineThread
from embed_service.image_pieces import ImageRoom
from embed_service.outputs import COLBERT, DENSE, SPARSE, TOKENS, Sparse
from embed_service.requests import encodings
from embed_service.requests.embed import (
    EmbedCall,
    EmbeddingRequest,
    TokenizeRequest,
    embed_call,
    tokenize_options,
)
from embed_service.requests.score import ClassifyRequest, RerankRequest, classify_options
from embed_service.requests.validation import validate

T = TypeVar("T")

# Inputs per engine call: small enough that a progress bar moves and that two calls in flight keep every
# replica's queue full, large enough that the per-call overhead (a few hundred microseconds) is noise.
PIECE_INPUTS = 512
PIECES_IN_FLIGHT = 3
# Another caller of this Embedder (a thread, a task) holds the engine's capacity: a piece waits for room
# rather than fail with the server's 429, retrying every OVERLOADED_RETRY_S seconds at first and backing
# off to OVERLOADED_RETRY_MAX_S, for at most OVERLOADED_WAIT_S seconds in all; then OverloadedError.
OVERLOADED_RETRY_S = 0.02
OVERLOADED_RETRY_MAX_S = 1.0
OVERLOADED_WAIT_S = 600.0
# A worker that finds itself building an Embedder while spawn imports the main script exits with this
# code; the parent's Embedder recognises it (see the module docstring).
UNGUARDED_EXIT_CODE = 87
UNGUARDED_MESSAGE = (
    "Embedder() ran again in a worker process, which imports the main script: put the code that builds it "
    'under `if __name__ == "__main__":` (worker processes are started with spawn)'
)

_INDEX = re.compile(r"^input (\d+)\b")


@dataclass
class Encoded:
    """What one `aembed` call gives: the vectors as asked, and the tokens they cost.

    embeddings: (n, D) float32, or the compact encoding's storage (see `Embedder.encode`); (n, 0) when
    the dense output was not asked for. sparse / colbert / tokens: one entry per input when asked for.
    """

    embeddings: np.ndarray
    prompt_tokens: int
    sparse: list[Sparse] | None = None
    colbert: list[np.ndarray] | None = None
    chunks: list[Chunks] | None = None
    """Late chunking: per input its chunks, their vectors encoded as the embeddings are."""
    tokens: list[np.ndarray] | None = None
    """Per input (L, H) float32: every token's last hidden state, when asked for."""


class Embedder:
    """Embed texts in this process with embed-service's engine: ``Embedder(model).encode(texts)``.

    Args:
        model: a model folder, a Hugging Face cache folder or a repo id, as ``--model``; None: the
            packaged all-MiniLM-L6-v2.
        **options: any server setting (docs/configuration.md), by its field name, with the server's
            defaults: ``dtype`` ("auto", "float32", "bfloat16", "float16"), ``device`` ("auto", "cpu",
            "cuda"), ``tensor_parallel_size``, ``data_parallel_size`` (replicas), ``num_threads``,
            ``max_batch_tokens``, ``max_input_length``, ``auto_truncate``, ``served_model_name``,
            ``revision``, ... ``EMBED_*`` environment variables apply as they do to the server. HTTP
            settings (host, port, keys, HTTP limits) are accepted and have no effect.

    The constructor returns once the workers have loaded and warmed up. Use it as a context manager, or
    call `close()`, to stop them. Errors: invalid options raise ``ValueError`` (pydantic's
    ``ValidationError`` for a setting); a model that cannot be served raises ``ValueError`` with the line
    the server prints; a request the API would refuse raises `InvalidInputError` (param: the field at
    fault) with the API's message.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any):
        if _in_spawn_bootstrap():
            raise SystemExit(UNGUARDED_EXIT_CODE)  # silently: the parent says what to do, once
        unknown = sorted(set(options) - set(Settings.model_fields) - {"model"})
        if unknown:
            raise TypeError(
                f"Embedder() got unknown options {', '.join(unknown)}; the options are the server's "
                "settings (docs/configuration.md)"
            )
        if model is not None:  # None: the EMBED_MODEL variable, else the packaged model (a None would win)
            options["model"] = os.fspath(model)
        self.settings = Settings(**options)
        self._loop = EngineThread()
        self._finalizer = weakref.finalize(self, self._loop.close)
        try:
            self._loop.engine = self._loop.run(_start(self.settings))
        except BaseException:
            self.close()
            raise
        self._engine: Engine = self._loop.engine

    # --- life cycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes and the engine's thread. Idempotent; the Embedder cannot be used after."""
        self._finalizer()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine_or_raise(self) -> Engine:
        if self._loop.closed:
            raise RuntimeError("this Embedder is closed")
        return self._engine

    # --- what it serves -----------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        """What the engine resolved, as the server's /info: model, dimension, max_input_length, dtype,
        device, replicas, threads, worker pids, ..."""
        return {**self._engine_or_raise().info(), "version": __version__}

    @property
    def dimension(self) -> int:
        """The model's output dimension (before any ``dimensions``)."""
        return self._engine_or_raise().spec.dimension

    # --- embedding ----------------------------------------------------------------------------------

    def encode(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Any,
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        outputs: Sequence[str] | None = None,
        embed_dtype: str = "float32",
        embed_ranges: Sequence[Any] | None = None,
        chunking: dict[str, Any] | None = None,
        late_chunking: bool | None = None,
        show_progress_bar: bool = False,
    ) -> Any:
        """Embed texts or token ids; the vectors as numpy, equal to the server's for the same request.

        Args:
            inputs: a text, a list of texts, a list of token ids or a list of token-id lists, as the
                API's ``input``; for an image model (CLIP, SigLIP) also images, alone or in a list with
                texts: PIL images (taken as the image processor takes them), encoded bytes or
                ``pathlib.Path`` files (decoded as transformers' load_image decodes them), or the API's
                item objects. A ``str`` is always a text. Any number of inputs: they are sent to the engine in pieces, several at
                a time, and the answers are put back in order.
            normalize: L2-normalize (default: the model's).
            dimensions: keep the first N features, then normalize (Matryoshka).
            prompt_name: one of the model's named prompts (``info["prompts"]``), prepended to each text.
            prompt: a raw prefix for each text, instead of a named prompt.
            truncate: cut inputs past the max input length (default: ``auto_truncate``); False: an input
                that is too long is an `InvalidInputError`.
            truncation_direction: "right" or "left".
            outputs: the output kinds, from one forward ("dense", "sparse", "colbert", "tokens"; sparse and
                colbert need a model with those heads). Default: dense only.
            embed_dtype: "float32" (default), "float16", "bfloat16" (its bits as uint16), "int8",
                "uint8", "binary" or "ubinary" (int8 / uint8 of 8 packed sign bits), as the API's.
            embed_ranges: int8/uint8 only: [low, high], or [[lows...], [highs...]] (default [-1, 1]).
            chunking: the API's ``chunking`` object; ``{"mode": "late", "spans": [[start, end], ...]}``
                or ``{"mode": "late", "size": N, "overlap": M}``: late chunking (docs/api.md).
            late_chunking: Jina's shape: the inputs are the consecutive chunks of one document, embedded
                in one forward pass; one vector per input.
            show_progress_bar: a tqdm bar on stderr, in inputs.

        Returns:
            Without ``outputs``: the (n, D) array (a single text or token-id list gives one (D,) row).
            With ``outputs``: a dict with the kinds asked for: "dense" the array, "sparse" a list of
            `Sparse` (token ids, weights), "colbert" a list of (tokens - 1, C) float32 arrays, "tokens" a
            list of (tokens, hidden size) float32 arrays (every token's last hidden state).
            With late chunking by ``chunking``: per input a `Chunks` (``spans``: (start, end, tokens) per
            chunk; ``vectors``: one row per chunk, encoded as ``embed_dtype`` says); one for a single text.

        Raises:
            InvalidInputError: what the API answers with a 400, with its message.
        """
        request = self._request(inputs, locals())
        encoded = self._loop.run(self._embed(request, show_progress_bar))
        return _shape(request, encoded, _single(inputs))

    async def aencode(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Any,
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        outputs: Sequence[str] | None = None,
        embed_dtype: str = "float32",
        embed_ranges: Sequence[Any] | None = None,
        chunking: dict[str, Any] | None = None,
        late_chunking: bool | None = None,
        show_progress_bar: bool = False,
    ) -> Any:
        """`encode` for asyncio code: awaits the engine's thread from the caller's loop (cancelling the
        await cancels the work). Same arguments and result."""
        request = self._request(inputs, locals())
        encoded = await asyncio.wrap_future(self._loop.submit(self._embed(request, show_progress_bar)))
        return _shape(request, encoded, _single(inputs))

    async def aembed(self, inputs: Sequence[str] | Sequence[Sequence[int]], **options: Any) -> Encoded:
        """`aencode`'s lower level: the `Encoded` result with its token count (``prompt_tokens``)."""
        request = self._request(inputs, options)
        return await asyncio.wrap_future(self._loop.submit(self._embed(request, False)))

    def tokenize(
        self,
        inputs: str | Sequence[str],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncate: bool | None = None,
        truncation_direction: str = "right",
    ) -> list[list[int]]:
        """The token ids `encode` would embed for each text, after prompting and truncation (as /tokenize)."""
        options = {k: v for k, v in locals().items() if k not in ("self", "inputs")}
        body = validate(TokenizeRequest, {"input": _plain(inputs), **_given(options)})
        opts = tokenize_options(body)
        engine = self._engine_or_raise()

        async def run() -> list[list[int]]:
            parts = await _in_pieces(body.input, engine, opts, lambda piece: engine.tokenize(piece, opts))
            return [ids for part in parts for ids in part]

        return self._loop.run(run())

    # --- scoring models ------------------------------------------------------------------------------

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        max_tokens_per_doc: int | None = None,
        instruction: str | None = None,
    ) -> np.ndarray:
        """One relevance score per document, in the order given ((n,) float32): what ``/rerank`` scores and
        sentence-transformers' ``CrossEncoder.predict`` gives; ``np.argsort(-scores)`` ranks them.

        For scoring models only: a cross-encoder, or a causal LM served with ``llm_reranker=True`` (which
        also takes an ``instruction``). ``truncate=False`` refuses a pair longer than the max input length;
        ``max_tokens_per_doc`` cuts each document first.
        """
        given = _given(
            {"truncate": truncate, "max_tokens_per_doc": max_tokens_per_doc, "instruction": instruction}
        )
        body = validate(RerankRequest, {"query": query, "documents": _plain(documents), **given})
        engine = self._engine_or_raise()
        result = self._loop.run(
            engine.rerank(body.query, body.texts, body.truncate, body.max_tokens_per_doc, body.instruction)
        )
        return result.scores[:, 0].copy()

    def classify(self, texts: str | Sequence[str], *, truncate: bool | None = None) -> np.ndarray:
        """Label probabilities per text, ((n, labels) float32; (labels,) for one string), in the order of
        `labels`: what ``/classify`` answers and the transformers text-classification pipeline gives."""
        body = validate(ClassifyRequest, {"input": _plain(texts), **_given({"truncate": truncate})})
        engine = self._engine_or_raise()
        result = self._loop.run(engine.classify(body.input, classify_options(body)))
        return result.scores[0] if isinstance(texts, str) else result.scores

    @property
    def labels(self) -> list[str]:
        """A scoring model's labels (config.json's id2label, in label order); empty for an embedding model."""
        score = self._engine_or_raise().spec.score
        return list(score.labels) if score else []

    # --- the request ----------------------------------------------------------------------------------

    def _request(self, inputs: Any, options: dict[str, Any]) -> EmbedCall:
        """The request checked as the API checks it, before any work (requests/embed.py)."""
        engine = self._engine_or_raise()
        options = _given(
            {k: v for k, v in options.items() if k not in ("self", "inputs", "show_progress_bar")}
        )
        return embed_call(validate(EmbeddingRequest, {"input": _plain(inputs), **options}), engine)

    async def _embed(self, request: EmbedCall, progress: bool) -> Encoded:
        engine = self._engine_or_raise()
        inputs = request.body.input
        bar = _progress_bar(len(inputs)) if progress else None

        async def piece(part: list[Any]) -> Any:
            result = await engine.embed(part, request.opts)
            if bar is not None:
                bar.update(len(part))
            return result

        try:
            if request.opts.chunking is not None and request.opts.chunking.joined:
                results = [await piece(inputs)]  # Jina's late chunking: the inputs are one document
            else:
                results = await _in_pieces(inputs, engine, request.opts, piece)
        finally:
            if bar is not None:
                bar.close()
        vectors = (
            np.concatenate([r.embeddings for r in results]) if len(results) > 1 else results[0].embeddings
        )
        kinds = request.opts.outputs or frozenset({DENSE})
        return Encoded(
            encodings.encode(vectors, request.body.embed_dtype, request.ranges)
            if DENSE in kinds
            else vectors,
            sum(r.prompt_tokens for r in results),
            [s for r in results for s in r.sparse] if SPARSE in kinds else None,
            [c for r in results for c in r.colbert] if COLBERT in kinds else None,
            [
                Chunks(c.spans, encodings.encode(c.vectors, request.body.embed_dtype, request.ranges))
                for r in results
                for c in r.chunks
            ]
            if results[0].chunks is not None
            else None,
            [t for r in results for t in r.tokens] if TOKENS in kinds else None,
        )


async def _start(settings: Settings) -> Engine:
    """Build the engine as the server does, on the engine's loop, and wait until it serves."""
    from embed_service.server import StartupError, build_engine

    try:
        engine = build_engine(settings)
    except StartupError as exc:  # a SystemExit for the server's command line; an error here
        raise ValueError(str(exc.code).removeprefix("embed-service: ")) from None
    try:
        await engine.start()
    except BaseException as exc:
        await engine.close()
        if f"exited with code {UNGUARDED_EXIT_CODE} while loading" in str(exc):
            raise RuntimeError(UNGUARDED_MESSAGE) from None
        raise
    return engine


def _in_spawn_bootstrap() -> bool:
    """Whether this process is a spawned worker still importing the parent's main script (multiprocessing
    sets `_inheriting` for that phase; the script's module is then ``__mp_main__``)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False)) and (
        "__mp_main__" in sys.modules
    )


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options the caller set: None means "the default", as a field left out of a request body."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items() if v is not None}


def _plain(inputs: Any) -> Any:
    """numpy arrays of token ids as the lists the request model checks."""
    if isinstance(inputs, np.ndarray):
        return inputs.tolist()
    if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], np.ndarray):
        return [x.tolist() for x in inputs]
    return list(inputs) if isinstance(inputs, tuple) else inputs


def _single(inputs: Any) -> bool:
    """One text, one image or one list of token ids: one row, as sentence-transformers gives."""
    if isinstance(inputs, (str, bytes, bytearray, Path)) or type(inputs).__module__.startswith("PIL."):
        return True
    if isinstance(inputs, np.ndarray):
        return inputs.ndim == 1
    return bool(inputs) and isinstance(inputs, (list, tuple)) and isinstance(inputs[0], (int, np.integer))


def _shape(request: EmbedCall, encoded: Encoded, single: bool) -> Any:
    if encoded.chunks is not None and request.opts.chunking and request.opts.chunking.mode == "late":
        return encoded.chunks[0] if single else encoded.chunks
    if request.body.outputs is None:
        return encoded.embeddings[0] if single else encoded.embeddings
    dense = encoded.embeddings if DENSE in request.body.outputs else None
    given = {DENSE: dense, SPARSE: encoded.sparse, COLBERT: encoded.colbert, TOKENS: encoded.tokens}
    return {kind: rows[0] if single else rows for kind, rows in given.items() if rows is not None}


def pieces(
    inputs: Sequence[Any], prompt: str | None, engine: Engine, most: int = PIECE_INPUTS
) -> list[tuple[int, int]]:
    """(start, end) of consecutive pieces within the per-request budgets (inputs, characters, images)."""
    limits, room = engine.limits, ImageRoom(engine.settings)
    most = max(1, min(most, limits.max_inputs))
    out, start, chars = [], 0, 0
    for i, item in enumerate(inputs):
        c = input_chars(item, prompt, limits.max_input_chars)
        fits = room.take(item)
        if i > start and (i - start >= most or chars + c > limits.max_request_chars or not fits):
            out.append((start, i))
            start, chars = i, 0
            room.restart()
        chars += c
    out.append((start, len(inputs)))
    return out


async def _in_pieces(
    inputs: list[Any], engine: Engine, opts: EmbedOptions, call: Callable[[list[Any]], Awaitable[T]]
) -> list[T]:
    """`call` on each piece of `inputs`, PIECES_IN_FLIGHT at a time, answers in order. A refusal names the
    input by its index in `inputs` (the engine counts within the piece)."""
    try:  # the prompt's characters count against the budgets; a bad prompt is the engine's to refuse
        prompt = engine.tokenizer.prompt_for(inputs, opts.prompt_name, opts.prompt)
    except ValueError:
        prompt = None
    bounds = pieces(inputs, prompt, engine)
    gate = asyncio.Semaphore(PIECES_IN_FLIGHT)

    async def one(start: int, end: int) -> T:
        async with gate:
            deadline, pause = time.monotonic() + OVERLOADED_WAIT_S, OVERLOADED_RETRY_S
            while True:
                try:
                    return await call(inputs[start:end])
                except OverloadedError as exc:  # refused at admission, before any work: wait for room
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise OverloadedError(
                            f"{str(exc).removesuffix('; retry shortly')}: no room for inputs {start}..{end - 1} "
                            f"within {OVERLOADED_WAIT_S:g} s (other callers of this Embedder hold its "
                            "capacity, max_concurrent_requests)"
                        ) from None
                    await asyncio.sleep(min(pause, left))
                    pause = min(pause * 2, OVERLOADED_RETRY_MAX_S)
                except EngineError as exc:
                    raise rebased(exc, start) from None

    tasks = [asyncio.ensure_future(one(s, e)) for s, e in bounds]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def rebased(exc: EngineError, offset: int) -> EngineError:
    """The engine's message names inputs by their index in the piece; name them by the caller's."""
    if not offset or not isinstance(exc, InvalidInputError):
        return exc
    message = _INDEX.sub(lambda m: f"input {int(m.group(1)) + offset}", str(exc))
    return type(exc)(message, exc.param)


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="inputs", dynamic_ncols=True)
