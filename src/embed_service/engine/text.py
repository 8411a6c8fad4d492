"""The text side of a request, before it is admitted: its options, checks, prompt, truncation rule and token
ids (`TextSide`), and what an embedding answer is (`EmbedResult`). No torch and nothing of the workers: an
HTTP front-end process (frontends/) imports this and the API, never the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from embed_service import metrics, observability
from embed_service.config import Settings
from embed_service.engine import chunking, late
from embed_service.engine.admission import Limits, check_request
from embed_service.engine.errors import InvalidInputError, NotReadyError
from embed_service.engine.tokenizer import (
    InputCharsError,
    InputTooLongError,
    InvalidTokenError,
    PromptError,
    Tokenizer,
    Truncation,
)
from embed_service.models.spec import ModelSpec
from embed_service.outputs import DENSE, DENSE_ONLY, KINDS, SCORE, SPARSE, OutputRequest, Sparse

Inputs = list[str] | list[list[int]]
T = TypeVar("T")


@dataclass
class EmbedOptions:
    """Per-request choices; None means the model's or the server's default."""

    truncate: bool | None = None
    truncation_direction: str = "right"
    normalize: bool | None = None
    dimensions: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    chunking: chunking.ChunkOptions | None = None  # long inputs (engine/chunking.py)
    outputs: frozenset[str] | None = None
    """The output kinds (outputs.KINDS) each input asks for; None: the model's default (ModelSpec.default_outputs)."""
    max_active_dims: int | None = None
    """Sparse output: keep the largest N weights (sentence-transformers' max_active_dims); None: all."""
    sparse_threshold: float | None = None
    """Sparse output: drop the weights below it; None: keep every weight > 0."""
    cache: bool = True
    """False: this request neither reads nor fills the output cache (cache.py)."""


@dataclass
class EmbedResult:
    embeddings: np.ndarray  # (n, d) float32, C-contiguous; (n, 0) when dense was not asked for
    prompt_tokens: int
    chunks: list[chunking.Chunks] | None = None  # per input, with chunking.return_chunks
    sparse: list[Sparse] | None = None  # per input, special tokens dropped, when asked for
    colbert: list[np.ndarray] | None = None  # per input (L - 1, C) float32, normalized, when asked for


def finish(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keep the first `dimensions` features, then L2-normalize in float32 (as torch's F.normalize)."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    vectors = vectors.astype(np.float32, copy=False)
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(vectors, dtype=np.float32)


def output_dimension(dimensions: int | None, model_dimension: int, param: str = "dimensions") -> int:
    """The width of a request's vectors: `dimensions` (checked: 1..the model's) or the model's. Checked
    before anything is sized by it (the encodings' ranges, the response)."""
    if dimensions is None:
        return model_dimension
    if not 1 <= dimensions <= model_dimension:
        raise InvalidInputError(f"{param} must be in 1..{model_dimension}, got {dimensions}", param=param)
    return dimensions


INLINE_TOKENIZE_CHARS = 1024
# Characters one call on a tokenization thread reads at most (a single input may pass it): a cancelled
# request stops between calls, so this bounds the CPU a client that went away still costs (~30 ms).
TOKENIZE_CALL_CHARS = 65536


def _small(inputs: Inputs, prompt: str | None) -> bool:
    """At most 4 texts of INLINE_TOKENIZE_CHARS characters in all, prompts included (token-id input:
    tokenized already)."""
    if len(inputs) > 4 or not inputs or not isinstance(inputs[0], str):
        return False
    return sum(len(text) for text in inputs) + len(inputs) * len(prompt or "") <= INLINE_TOKENIZE_CHARS


def _tokenize_step(inputs: Inputs, start: int, most: int, prompt: str | None, limit: int) -> int:
    """How many inputs from `start` (1..most) one tokenization call takes: TOKENIZE_CALL_CHARS at most."""
    if not isinstance(inputs[start], str):
        return most
    extra = len(prompt or "")
    k, chars = 0, 0
    while k < most:
        chars += min(len(inputs[start + k]) + extra, limit)
        if k and chars > TOKENIZE_CALL_CHARS:
            break
        k += 1
    return k


class TextSide:
    """What a request asks of a model before it is admitted: its checks, prompt, truncation rule and token
    ids. The `Engine` and a front-end process's `RemoteEngine` (frontends/frontend.py) share it, so that a front end
    tokenizes as the engine would: the same budgets, prompt, truncation, refusals and ids."""

    settings: Settings
    spec: ModelSpec
    name: str
    state: str
    failure: str | None
    tokenizer: Tokenizer
    limits: Limits
    _tokenize_pool: ThreadPoolExecutor

    def _start_text_side(self) -> None:
        """The request budgets and the tokenization threads (`settings` and `name` set)."""
        s = self.settings
        self.limits = Limits(s.max_client_batch_size, s.max_input_chars, s.max_request_chars)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tokenize-{self.name}")

    def _output_checks(self, opts: EmbedOptions) -> OutputRequest:
        """embed()'s first refusals: the model not ready, `dimensions`, the outputs and their options."""
        self._check_ready()
        output_dimension(opts.dimensions, self.spec.dimension)
        output = self.output_request(opts.outputs)
        self._check_sparse_options(opts, output)
        return output

    def _embed_checks(
        self, inputs: Inputs, opts: EmbedOptions
    ) -> tuple[OutputRequest, Truncation, str | None, chunking.ChunkRule | None]:
        """Everything embed() refuses before its budgets, and what it needs after: the output request, the
        truncation rule, the prompt and the chunking rule (None: no chunking)."""
        output = self._output_checks(opts)
        rule = self.truncation(opts)
        prompt = self._prompt(inputs, opts)
        chunk_rule = self._chunk_rule(inputs, opts, output)
        return output, rule, prompt, chunk_rule

    async def tokenize_texts(
        self, inputs: list[str], rule: Truncation, prompt: str | None
    ) -> list[list[int]]:
        """A whole request's token ids after its budget check (`check_request`, which bounds this work):
        what embed() would submit, tokenized piece by piece on the tokenization threads as it does."""
        check_request(inputs, prompt, self.limits)
        return await self._tokenize_piece(inputs, 0, len(inputs), rule, prompt)

    def _check_ready(self) -> None:
        if self.state != "ready":
            what = {
                "loading": "is still loading",
                "restarting": f"is restarting: {self.failure}",
                "draining": "is shutting down",
                "failed": f"is unavailable: {self.failure}",
            }[self.state]
            raise NotReadyError(f"model {self.name} {what}")

    def output_request(self, kinds: frozenset[str] | None) -> OutputRequest:
        """What each input of a request asks the workers for; a kind this model cannot give is a 400."""
        if SCORE in self.spec.outputs and SCORE not in (kinds or ()):
            raise InvalidInputError(
                f"model {self.name} is a cross-encoder or classifier: it scores (/rerank, /classify) and does "
                "not embed; see docs/models.md",
                param="model",
            )
        if kinds is None and DENSE in self.spec.outputs:
            return DENSE_ONLY
        kinds = self.spec.default_outputs if kinds is None else kinds  # sparse for a SPLADE model
        if not kinds:
            raise InvalidInputError("outputs must name at least one output kind", param="outputs")
        missing = sorted(kinds - self.spec.outputs)
        if missing:
            raise InvalidInputError(
                f"model {self.name} does not give {', '.join(missing)} outputs (it gives "
                f"{', '.join(k for k in KINDS if k in self.spec.outputs)}); see docs/models.md",
                param="outputs",
            )
        return OutputRequest(frozenset(kinds))

    def _check_sparse_options(self, opts: EmbedOptions, output: OutputRequest) -> None:
        """max_active_dims >= 1 and a finite sparse_threshold >= 0, with a sparse output only."""
        for name in ("max_active_dims", "sparse_threshold"):
            if getattr(opts, name) is not None and SPARSE not in output.kinds:
                raise InvalidInputError(f"{name} applies to the sparse output, which was not asked for", name)
        if opts.max_active_dims is not None and opts.max_active_dims < 1:
            raise InvalidInputError(
                f"max_active_dims must be at least 1, got {opts.max_active_dims}", "max_active_dims"
            )
        t = opts.sparse_threshold
        if t is not None and not (np.isfinite(t) and t >= 0):
            raise InvalidInputError(
                f"sparse_threshold must be a finite number >= 0, got {t}", "sparse_threshold"
            )

    def truncation(self, opts: EmbedOptions) -> Truncation:
        enabled = self.settings.auto_truncate if opts.truncate is None else opts.truncate
        return Truncation(enabled, self.spec.max_input_length, opts.truncation_direction)

    def _prompt(self, inputs: Inputs, opts: EmbedOptions) -> str | None:
        try:
            return self.tokenizer.prompt_for(inputs, opts.prompt_name, opts.prompt)
        except PromptError as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None

    def _token_ids(
        self, inputs: Inputs, rule: Truncation, prompt: str | None, first: int = 0
    ) -> list[list[int]]:
        """Runs on a tokenization thread (or inline for a few short texts). `first`: the index of inputs[0]
        in its request, for messages."""
        if inputs and isinstance(inputs[0], str):
            self.tokenizer.check_prompt(prompt, rule.max_length)
            seqs = self.tokenizer.encode(inputs, prompt, rule, self.settings.max_input_chars, first)
        else:
            seqs = inputs  # type: ignore[assignment]
            self.tokenizer.check_ids(seqs, first)
        try:
            return self.tokenizer.truncate(seqs, rule, prompt)
        except InputTooLongError as exc:
            raise InputTooLongError(exc.index + first, exc.length, exc.limit) from None

    @contextlib.contextmanager
    def _tokenizing(self) -> Iterator[Any]:
        """Around one piece's tokenization: its trace span (yielded; None when not tracing), its duration
        metric, and the tokenizer's refusals as InvalidInputError."""
        t0 = time.perf_counter()
        with observability.span("tokenize") as span:
            try:
                yield span
            except (InputTooLongError, InvalidTokenError, InputCharsError) as exc:
                raise InvalidInputError(str(exc)) from None
            except PromptError as exc:
                raise InvalidInputError(str(exc), param=exc.param) from None
        metrics.TOKENIZATION_DURATION.labels(self.name).observe(time.perf_counter() - t0)

    async def _on_tokenizer(
        self, texts: Inputs, first: int, k: int, extra: str | None, fn: Callable[[Any, int], list[T]]
    ) -> list[T]:
        """`fn(texts[at : at + step], at)` over texts[first : first + k] on a tokenization thread, a call per
        TOKENIZE_CALL_CHARS (`extra`: what each text carries besides itself, a prompt or a query): cancelling
        the caller stops the work at the next call. `fn` gives one result per text."""
        loop = asyncio.get_running_loop()
        done: list[T] = []
        while len(done) < k:
            at = first + len(done)
            step = _tokenize_step(texts, at, k - len(done), extra, self.settings.max_input_chars)
            done += await loop.run_in_executor(self._tokenize_pool, fn, texts[at : at + step], at)
        return done

    async def _tokenize_piece(
        self, inputs: Inputs, start: int, k: int, rule: Truncation, prompt: str | None
    ) -> list[list[int]]:
        """Token ids of inputs[start:start+k]; see _on_tokenizer."""
        piece = inputs[start : start + k]
        with self._tokenizing() as span:
            if _small(piece, prompt):
                # A few short texts tokenize in tens of microseconds: less than the hop to a thread and
                # back, which online traffic (one query per request) would pay on every request.
                ids = self._token_ids(piece, rule, prompt, start)
            else:
                ids = await self._on_tokenizer(
                    inputs, start, k, prompt, lambda texts, at: self._token_ids(texts, rule, prompt, at)
                )
            if span is not None:
                span.set_attributes({"embed.inputs": len(ids), "embed.tokens": sum(map(len, ids))})
        return ids

    def _chunk_rule(
        self, inputs: Inputs, opts: EmbedOptions, output: OutputRequest
    ) -> chunking.ChunkRule | None:
        """How this request chunks its inputs, or None when it does not (token ids never do). The server's
        --chunk-long-inputs applies to requests for dense vectors only: chunking averages them, and sparse
        and ColBERT outputs are truncated as without it; a request that asks for chunking with them is a
        400."""
        asked = opts.chunking or chunking.ChunkOptions()
        if asked.mode == "late":
            return self._late_rule(inputs, asked, output)
        if asked.enabled is None:
            if not (self.settings.chunk_long_inputs and output.kinds == {DENSE}):
                return None
        elif not asked.enabled:
            return None
        elif output.kinds != {DENSE}:
            raise InvalidInputError(
                "chunking averages dense vectors; ask for the sparse and colbert outputs without it",
                param="chunking",
            )
        if not isinstance(inputs[0], str):
            if asked.enabled:
                raise InvalidInputError(
                    "chunking applies to text inputs; token ids are used verbatim", "chunking"
                )
            return None
        overlap = self.settings.chunk_overlap if asked.overlap is None else asked.overlap
        return chunking.ChunkRule(
            overlap,
            self.settings.max_chunks_per_input,
            self.spec.max_input_length,
            self.settings.max_input_chars,
            asked.return_chunks,
            self.settings.max_client_batch_size,  # the request's budget, as without chunking
        )

    def _late_rule(
        self, inputs: Inputs, asked: chunking.ChunkOptions, output: OutputRequest
    ) -> chunking.ChunkRule:
        """Late chunking's refusals before admission (engine/late.py), and its rule."""
        try:
            if output.kinds != {DENSE}:
                raise chunking.ChunkError(
                    "late chunking pools dense vectors; ask for the sparse and colbert outputs without it",
                    param="chunking",
                )
            if not isinstance(inputs[0], str):
                raise chunking.ChunkError("chunking applies to text inputs; token ids are used verbatim")
            if not asked.joined:  # Jina's shape: the inputs are the spans
                late.check_options(asked, len(inputs))
        except chunking.ChunkError as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None
        s = self.settings
        return chunking.ChunkRule(
            0,
            s.max_chunks_per_input,  # a long input's macro-windows
            self.spec.max_input_length,
            s.max_input_chars,
            True,
            s.max_client_batch_size,  # the request's budget, as without chunking
            late=asked,
        )
