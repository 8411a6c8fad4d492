"""One engine per served model: tokenize, admit, batch, run, pool, finish.

The engine owns the tokenizer, the batcher and the worker group. It never sees HTTP; its refusals are the
exceptions in engine/errors.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from embed_service import metrics, observability
from embed_service.batching.batcher import Batcher
from embed_service.batching.sequence import RequestState, Sequence
from embed_service.cache import output_cache
from embed_service.config import ModelSettings, Settings
from embed_service.engine import chunking, invariance_check, late
from embed_service.engine.admission import Admission, Permit, check_request, run_piecewise
from embed_service.engine.errors import InvalidInputError, NotReadyError
from embed_service.engine.replicas import Replicas
from embed_service.engine.scoring import (
    ChatPairTokenizer,
    PairTokenizer,
    PromptTokenizer,
    ScoreResult,
    activate,
    check_pairs,
    pair_tokenizer,
)
from embed_service.engine.text import (  # noqa: F401 (EmbedOptions, Inputs, TextSide: the engine's API)
    EmbedOptions,
    EmbedResult,
    Inputs,
    TextSide,
    finish,
    output_dimension,
)
from embed_service.engine.tokenizer import (
    InputTooLongError,
    PromptError,
    Tokenizer,
)
from embed_service.models.spec import ModelSpec, ScoreSpec
from embed_service.outputs import (
    COLBERT,
    DENSE,
    DENSE_ONLY,
    KINDS,
    SCORE,
    SPARSE,
    OutputRequest,
    SequenceOutput,
    Sparse,
)
from embed_service.parallel import check_shardable
from embed_service.plan import ModelPlan, ModelRequest, copies_fit, plan_resources
from embed_service.workers.device import available_memory, resolve_device, resolve_dtype, this_machine
from embed_service.workers.group import WorkerGroup, free_port
from embed_service.workers.worker import WorkerConfig

log = logging.getLogger(__name__)


def weight_bytes(spec: ModelSpec) -> int:
    """The checkpoint's size on disk."""
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in spec.path.glob(pattern))


def small_enough_to_copy(spec: ModelSpec) -> bool:
    """Two copies of the checkpoint fit in an eighth of the memory the process may use (its cgroup's limit)."""
    return copies_fit(weight_bytes(spec), available_memory())


def model_request(settings: ModelSettings, spec: ModelSpec, name: str, device: str) -> ModelRequest:
    """What one model asks of the resource plan (plan.py)."""
    return ModelRequest(
        name,
        device,
        settings.tensor_parallel_size,
        settings.data_parallel_size,
        settings.num_threads,
        weight_bytes(spec),
    )


DEFAULT_BATCH_TOKENS = 4096


class _Run:
    """One request's sequences on the batcher, from its permit to its answer: what embed, chunked embed and
    scoring share. A `with` block: leaving it on an error or a cancel drops what is still queued of the
    request (the client went away, or a batch failed), and the permit is closed either way."""

    def __init__(self, engine: Engine, permit: Permit, use_cache: bool = True):
        self.engine = engine
        self.permit = permit
        self.cache = engine.cache if use_cache else None
        self.state = RequestState()
        self.loop = asyncio.get_running_loop()
        self.tokens = 0
        self.submitted: list[Sequence] = []  # for the request's trace spans

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.state.cancelled = True
        self.permit.close()

    def submit(
        self, ids: list[list[int]], outputs: OutputRequest | list[OutputRequest] = DENSE_ONLY
    ) -> list[asyncio.Future]:
        """Queue a piece's sequences (`outputs`: for all, or one per sequence); their futures."""
        engine = self.engine
        if engine.state == "failed":  # a drain still finishes what it admitted; a dead worker cannot
            engine._check_ready()
        assert engine.batcher is not None
        each = outputs if isinstance(outputs, list) else [outputs] * len(ids)
        self.tokens += sum(map(len, ids))
        if self.cache is not None:  # hits answered now, the misses queued below (cache.py)
            return self.cache.submit(ids, each, self._queue)
        return self._queue(ids, each)

    def _queue(self, ids: list[list[int]], each: list[OutputRequest]) -> list[asyncio.Future]:
        engine = self.engine
        assert engine.batcher is not None
        seqs = [Sequence(i, self.loop.create_future(), self.state, o) for i, o in zip(ids, each, strict=True)]
        self.submitted.extend(seqs)
        # Interactive requests (admitted into the reserve) of few tokens take the priority lane;
        # see engine/admission.py and batching/policy.py.
        engine.batcher.submit(
            seqs, priority=self.permit.interactive and self.tokens <= engine.settings.priority_max_tokens
        )
        return [seq.future for seq in seqs]

    def answered(self) -> None:
        """Every sequence has its result: the request's trace spans and its token count."""
        observability.trace_batches(self.submitted)
        metrics.INPUT_TOKENS.labels(self.engine.name).inc(self.tokens)


class Engine(TextSide):
    """One served model. `plan`: its share of the machine (plan.py) when the server serves several; by default
    the model has the machine to itself."""

    def __init__(
        self, settings: Settings, spec: ModelSpec, served_names: list[str], plan: ModelPlan | None = None
    ):
        self.settings = settings
        self.spec = spec
        self.served_names = served_names
        self.name = served_names[0]
        # Batches of a few thousand tokens run as fast per token as larger ones on a CPU, and they leave work
        # queued for whichever replica frees first instead of one replica holding most of it.
        self.max_batch_tokens = settings.max_batch_tokens or max(DEFAULT_BATCH_TOKENS, spec.max_input_length)
        if self.max_batch_tokens < spec.max_input_length:
            raise ValueError(
                f"--max-batch-tokens ({self.max_batch_tokens}) is below the max input length "
                f"({spec.max_input_length}): the longest input could never be batched"
            )
        self.tokenizer = Tokenizer(spec)
        if spec.score is not None:
            self._pairs  # noqa: B018 (built now: a chat template that cannot carry a pair fails the start)
        self.device = plan.device if plan else resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        tp = settings.tensor_parallel_size
        self.cache = output_cache(settings, spec, self.name, f"{self.dtype}/{self.device}/tp={tp}")
        check_shardable(spec.config, tp)  # before any worker starts: fail fast, naming the numbers
        # Replicas, threads and devices: the resource plan (plan.py says why these defaults). Alone, the
        # model plans for the whole machine; a plan it cannot have (GPUs not there) is a ValueError here.
        self.plan = (
            plan
            or plan_resources(
                [model_request(settings, spec, self.name, self.device)], this_machine(self.device == "cuda")
            ).models[0]
        )
        self.replicas = self.plan.replicas
        self.num_threads = self.plan.num_threads
        self.worker_config = WorkerConfig(
            str(spec.path),
            spec.max_input_length,
            self.dtype,
            self.device,
            self.num_threads,
            tp,
            free_port() if tp > 1 else 0,
            devices=self.plan.devices[0],
            llm_reranker=settings.llm_reranker,
            max_batch_tokens=self.max_batch_tokens,
            fidelity_min_cosine=settings.fidelity_min_cosine,
            fidelity_warn_only=settings.fidelity_warn_only,
            cuda_graphs=settings.cuda_graphs,
        )
        # loading -> ready <-> restarting (no replica up) -> draining | failed
        self.state = "loading"
        self.failure: str | None = None
        self.in_flight = 0
        self._in_flight_gauge = metrics.INPUTS_IN_FLIGHT.labels(self.name)
        self._start_text_side()
        self.admission = Admission(
            settings.max_concurrent_requests,
            settings.interactive_reserved_inputs,
            settings.interactive_max_inputs,
            self.name,
            self._count_in_flight,
        )
        metrics.declare_model(self.name)
        self.replica_set = Replicas(
            self.name,
            self.replicas,
            self._make_group,
            self.max_batch_tokens,
            settings.batch_timeout,
            on_change=self._replicas_changed,
            on_give_up=self._fail,
            devices=self.plan.devices,
        )
        self.batcher: Batcher | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_fatal: list[Any] = []  # callbacks (reason) run on the event loop when the model fails

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers and wait for them to load and warm up (in a thread: the loop keeps serving)."""
        log.info(
            "model %s: architecture=%s pooling=%s normalize=%s dimension=%d max_input_length=%d "
            "dtype=%s device=%s tensor_parallel_size=%d",
            self.name,
            self.spec.architecture,
            self.spec.pooling,
            self.spec.normalize,
            self.spec.dimension,
            self.spec.max_input_length,
            self.dtype,
            self.device,
            self.settings.tensor_parallel_size,
        )
        if self.settings.chunk_long_inputs and DENSE not in self.spec.outputs:
            log.warning(
                "model %s gives no dense vectors: --chunk-long-inputs does not apply to it (its outputs "
                "are truncated as without it)",
                self.name,
            )
        try:
            await self.replica_set.start(lambda text: log.info("model %s: %s", self.name, text))
        except Exception as exc:
            self._fail(str(exc))
            raise
        self.invariance = await asyncio.to_thread(
            invariance_check.check,
            self._compute,
            self.replicas,
            self.spec.outputs,
            self.spec.vocab_size or 1000,
            self.spec.max_input_length,
        )
        if self.invariance["enabled"] and not self.invariance["verified"]:
            log.warning("model %s: batch invariance not verified: %s", self.name, self.invariance["detail"])
            self.cache = None  # its hits would not be the bytes a computation gives
        self.batcher = Batcher(
            [functools.partial(self._compute, replica=r) for r in range(self.replicas)],
            self.max_batch_tokens,
            self.settings.max_batch_requests,
            self.name,
            priority_batch_tokens=self.settings.priority_batch_tokens
            if self.settings.priority_max_tokens
            else 0,
            bulk_aging_s=self.settings.bulk_aging_s,
        )
        self.replica_set.batcher = self.batcher
        self.batcher.start()
        if self.state == "loading":
            self.state = "ready"
            log.info("model %s: ready", self.name)

    def begin_drain(self) -> None:
        if self.state in ("ready", "loading", "restarting"):
            self.state = "draining"

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        if self.batcher:
            await self.batcher.stop(NotReadyError(f"model {self.name} is shutting down"))
        await self.replica_set.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def _make_group(self, index: int, on_death: Any) -> WorkerGroup:
        config = dataclasses.replace(self.worker_config, devices=self.plan.devices[index])  # its own devices
        if config.world_size > 1:  # every group its own rendezvous (an old one's port may linger)
            config = dataclasses.replace(config, dist_port=free_port())
        return WorkerGroup(config, on_death=on_death)

    def _replicas_changed(self, up: int, reason: str | None) -> None:
        """A replica went down or came back: the model can serve while at least one is up."""
        if up == 0 and self.state == "ready":
            self.state, self.failure = "restarting", reason
        elif up and self.state == "restarting":
            self.state, self.failure = "ready", None

    def _fail(self, reason: str) -> None:
        """Restarts keep failing (or start-up failed): the model cannot serve, and the server exits."""
        if self.state == "failed":
            return
        self.state, self.failure = "failed", reason
        if self.batcher:
            self.batcher.fail_all(NotReadyError(f"model {self.name} is unavailable: {reason}"))
        for callback in self.on_fatal:
            callback(reason)

    # --- serving ----------------------------------------------------------------------------------

    def _compute(
        self, ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest], replica: int = 0
    ) -> list[SequenceOutput]:
        return self.replica_set.compute(replica, ids, lengths, requests)

    def _sparse(self, s: Sparse, opts: EmbedOptions) -> Sparse:
        """bge-m3's lexical weights without the special tokens (a SPLADE vector keeps every vocabulary
        entry, as sentence-transformers does); then the request's threshold and top-k."""
        if self.spec.splade is None:
            keep = ~np.isin(s.indices, self.tokenizer.lexical_skip_ids)
            s = Sparse(s.indices[keep], s.values[keep])
        if opts.sparse_threshold is not None:
            keep = s.values >= opts.sparse_threshold
            s = Sparse(s.indices[keep], s.values[keep])
        if opts.max_active_dims is not None and s.values.size > opts.max_active_dims:
            top = np.sort(np.argpartition(-s.values, opts.max_active_dims - 1)[: opts.max_active_dims])
            s = Sparse(s.indices[top], s.values[top])  # ascending ids still
        return s

    def _count_in_flight(self, n: int) -> None:
        """The admission's count, as the drain and the metrics read it."""
        self.in_flight = n
        self._in_flight_gauge.set(n)
        if n:
            self._idle.clear()
        else:
            self._idle.set()

    def _admit(self, inputs: Inputs, prompt: str | None) -> Permit:
        """The one admission of every route: budgets (400), then capacity (429), before any tokenization."""
        check_request(inputs, prompt, self.limits)
        return self.admission.admit(len(inputs))

    async def tokenize(self, inputs: Inputs, opts: EmbedOptions | None = None) -> list[list[int]]:
        """The token ids embed() would run, after prompting and truncation; admitted like embed()."""
        opts = opts or EmbedOptions()
        rule = self.truncation(opts)
        prompt = self._prompt(inputs, opts)
        permit = self._admit(inputs, prompt)
        try:
            ids: list[list[int]] = []
            while len(ids) < len(inputs):
                k = max(1, permit.free())
                permit.take(k)
                ids += await self._tokenize_piece(inputs, len(ids), k, rule, prompt)
                permit.done(k)
            return ids
        finally:
            permit.close()

    async def embed(self, inputs: Inputs, opts: EmbedOptions | None = None) -> EmbedResult:
        opts = opts or EmbedOptions()
        output, rule, prompt, chunk_rule = self._embed_checks(inputs, opts)
        if chunk_rule is not None and chunk_rule.late is not None:  # late chunking: engine/late.py
            return await self._embed_late(inputs, opts, chunk_rule, prompt)  # type: ignore[arg-type]
        if chunk_rule is not None:  # long inputs as windows: engine/chunking.py
            return await self._embed_windowed(inputs, opts, chunk_rule, prompt)  # type: ignore[arg-type]

        async def piece(first: int, k: int) -> list[list[int]]:
            return await self._tokenize_piece(inputs, first, k, rule, prompt)

        return await self._embed_run(self._admit(inputs, prompt), len(inputs), piece, opts, output)

    async def embed_tokenized(self, ids: list[list[int]], opts: EmbedOptions | None = None) -> EmbedResult:
        """embed() of texts that a front-end process has checked and tokenized (frontends/, with
        `TextSide.tokenize_texts`): their budgets, prompt and truncation are done, so `ids` are admitted and
        batched as they are, as embed() would batch the same texts' ids."""
        opts = opts or EmbedOptions()
        output = self._output_checks(opts)

        async def piece(first: int, k: int) -> list[list[int]]:
            return ids[first : first + k]

        return await self._embed_run(self.admission.admit(len(ids)), len(ids), piece, opts, output)

    async def _embed_run(
        self,
        permit: Permit,
        n: int,
        piece: Callable[[int, int], Awaitable[list[list[int]]]],
        opts: EmbedOptions,
        output: OutputRequest,
    ) -> EmbedResult:
        """An admitted request's `n` sequences (`piece(first, k)`: the ids of k of them) batched, run and
        finished."""
        with _Run(self, permit, opts.cache) as run:

            async def start(first: int, k: int) -> list[asyncio.Future]:
                return run.submit(await piece(first, k), output)

            results = await run_piecewise(run.permit, n, start)
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        kinds = output.kinds
        dense = (
            np.stack([r.dense for r in results])
            if DENSE in kinds
            else np.zeros((len(results), 0), np.float32)
        )
        return EmbedResult(
            finish(dense, opts.dimensions, normalize),
            run.tokens,
            sparse=[self._sparse(r.sparse, opts) for r in results] if SPARSE in kinds else None,
            colbert=[r.colbert for r in results] if COLBERT in kinds else None,
        )

    # --- long inputs as windows (engine/chunking.py) -------------------------------------------------

    def _plan(
        self,
        texts: list[str],
        prompt: str | None,
        rule: chunking.ChunkRule,
        first: int,
        tally: chunking.Tally,
    ) -> list[list[chunking.Window]]:
        """Runs on a tokenization thread (the prompt was checked before admission)."""
        try:
            return chunking.plan(self.tokenizer, texts, prompt, rule, first, tally)
        except chunking.ChunkError as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None

    async def _embed_windowed(
        self, inputs: list[str], opts: EmbedOptions, rule: chunking.ChunkRule, prompt: str | None
    ) -> EmbedResult:
        """embed() for a request that chunks its long texts: planned whole (and refused past its budget)
        first, then each window a sequence, admitted as one (chunking.run_windowed)."""
        check_request(inputs, prompt, self.limits)
        try:  # before admission: refusals that need no tokenizing of the texts
            self.tokenizer.check_prompt(prompt, rule.max_length)  # a prompt that fills the window first
            chunking.check_overlap(self.tokenizer, rule, prompt)
            chunking.check_chars(inputs, prompt, rule)
        except (chunking.ChunkError, PromptError) as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None
        planned: list[list[chunking.Window]] = []
        tally = chunking.Tally(rule)  # the request's windows and tokens, against its budget
        with _Run(self, self.admission.admit(len(inputs))) as run:

            async def plan_piece(first: int, k: int) -> list[list[chunking.Window]]:
                with self._tokenizing():
                    done = await self._on_tokenizer(
                        inputs, first, k, prompt, lambda texts, at: self._plan(texts, prompt, rule, at, tally)
                    )
                planned.extend(done)
                return done

            def submit(windows: list[chunking.Window]) -> list[asyncio.Future]:
                return run.submit([w.ids for w in windows])

            results = await chunking.run_windowed(run.permit, len(inputs), plan_piece, submit)
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        pooled = [np.stack([r.dense for r in rs]) for rs in results]  # per input (w, D)
        combined = np.stack([chunking.combine(v, [w.weight for w in ws]) for v, ws in zip(pooled, planned)])
        chunks = None
        if rule.return_chunks:
            chunks = [
                chunking.Chunks(
                    [(w.start, w.end, w.weight) for w in ws], finish(v, opts.dimensions, normalize)
                )
                for v, ws in zip(pooled, planned)
            ]
        return EmbedResult(finish(combined, opts.dimensions, normalize), run.tokens, chunks)

    async def _embed_late(
        self, inputs: list[str], opts: EmbedOptions, rule: chunking.ChunkRule, prompt: str | None
    ) -> EmbedResult:
        """embed() with late chunking (engine/late.py): each input one sequence asking for its plain vector
        and its chunks' pooled vectors, or a long one's macro-windows; planned whole first and run as the
        windows of chunking.run_windowed are (an input that fits is one window, as without chunking)."""
        asked = rule.late
        assert asked is not None
        check_request(inputs, prompt, self.limits)
        texts, spans = inputs, asked
        if asked.joined:  # Jina's late_chunking: the inputs are one document's chunks
            text, cut = late.joined(inputs)
            texts, spans = [text], dataclasses.replace(asked, spans=tuple(cut))
        try:
            self.tokenizer.check_prompt(prompt, rule.max_length)
            chunking.check_chars(texts, prompt, rule)
        except (chunking.ChunkError, PromptError) as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None

        tally = chunking.Tally(rule)  # the request's sequences and tokens, against its budget
        combinable = not self.spec.dense  # a long input's chunks combine pieces: no Dense layers after

        def plan(piece: list[str], at: int) -> list[late.LatePlan]:
            try:
                out = []
                for i, t in enumerate(piece):
                    p = late.plan(
                        self.tokenizer, t, prompt, spans, rule.max_length, at + i, rule.max_chunks, combinable
                    )
                    tally.add(p.windows, at + i)
                    out.append(p)
                return out
            except chunking.ChunkError as exc:
                raise InvalidInputError(str(exc), param=exc.param) from None

        planned: list[late.LatePlan] = []
        with _Run(self, self.admission.admit(len(texts))) as run:

            async def plan_piece(first: int, k: int) -> list[list[late.LateWindow]]:
                with self._tokenizing():
                    done = await self._on_tokenizer(texts, first, k, prompt, plan)
                planned.extend(done)
                return [p.windows for p in done]

            def submit(windows: list[late.LateWindow]) -> list[asyncio.Future]:
                return run.submit([w.ids for w in windows], [w.request for w in windows])

            results = await chunking.run_windowed(run.permit, len(texts), plan_piece, submit)  # type: ignore[arg-type]
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        pooled = [late.combine(p, r) for p, r in zip(planned, results)]
        chunks = [
            chunking.Chunks(p.spans, finish(v, opts.dimensions, normalize))
            for p, (v, _) in zip(planned, pooled)
        ]
        if asked.joined:  # one vector per input: the chunks' vectors
            return EmbedResult(chunks[0].vectors, run.tokens)
        dense = finish(np.stack([d for _, d in pooled]), opts.dimensions, normalize)
        return EmbedResult(dense, run.tokens, chunks)

    # --- scoring models: rerank and classify (engine/scoring.py) ----------------------------------------

    @functools.cached_property
    def _pairs(self) -> PairTokenizer | PromptTokenizer | ChatPairTokenizer:
        return pair_tokenizer(self.spec, self.tokenizer.backend.to_str(), self.settings.rerank_instruction)

    def _score_spec(self, route: str) -> ScoreSpec:
        if self.spec.score is None:
            raise InvalidInputError(
                f"model {self.name} is an embedding model: it does not {route} (serve a cross-encoder or a "
                "sequence classifier; see docs/models.md)",
                param="model",
            )
        return self.spec.score

    async def rerank(
        self,
        query: str,
        documents: list[str],
        truncate: bool = True,
        doc_tokens: int | None = None,
        instruction: str | None = None,
    ) -> ScoreResult:
        """One relevance score per (query, document), as CrossEncoder.predict gives it; (n, 1) scores."""
        self._check_ready()
        score = self._score_spec("rerank")
        if len(score.labels) != 1:
            raise InvalidInputError(
                f"model {self.name} has {len(score.labels)} labels; reranking needs one score per pair "
                "(use /classify)",
                param="model",
            )
        if not query:
            raise InvalidInputError("query must not be empty", param="query")
        pairs = self._pairs
        if instruction is not None and not isinstance(pairs, PromptTokenizer):
            raise InvalidInputError(
                "instruction applies to LLM rerankers (--llm-reranker); a cross-encoder scores the pair as it is",
                param="instruction",
            )
        check_pairs(query + (instruction or ""), documents, self.limits)

        def encode(piece: list[str], first: int) -> list[tuple[list[int], int]]:
            try:
                if isinstance(pairs, PromptTokenizer):
                    return pairs.encode(query, piece, truncate, doc_tokens, first, instruction)
                return pairs.encode(query, piece, truncate, doc_tokens, first)
            except InputTooLongError as exc:  # the route's fields are query and documents, not input
                raise InvalidInputError(
                    f"the query and document {exc.index} make more than the maximum of {exc.limit} tokens "
                    f"(at least {exc.length}); shorten them, or send truncate=true (the default) or "
                    "max_tokens_per_doc",
                    param="documents",
                ) from None

        logits, tokens = await self._score(documents, query, encode)
        return ScoreResult(activate(logits, score.rerank_activation), tokens)

    async def classify(self, inputs: list[str], opts: EmbedOptions | None = None) -> ScoreResult:
        """Label probabilities per text, as the transformers text-classification pipeline gives them."""
        opts = opts or EmbedOptions()
        self._check_ready()
        score = self._score_spec("classify")
        if score.head in ("yes_no", "logit_score"):
            raise InvalidInputError(f"model {self.name} is an LLM reranker: it reranks, it does not classify")
        rule = self.truncation(opts)
        check_request(inputs, None, self.limits)

        def encode(piece: list[str], first: int) -> list[tuple[list[int], int]]:
            return [(ids, 0) for ids in self._token_ids(piece, rule, None, first)]

        logits, tokens = await self._score(inputs, None, encode)
        return ScoreResult(activate(logits, score.classify_activation), tokens)

    async def _score(self, texts: list[str], query: str | None, encode: Any) -> tuple[np.ndarray, int]:
        """Admit, tokenize (`encode(piece, first)` on a tokenization thread), batch and run scoring
        sequences; their (n, labels) logits and token count. A request of thousands of documents is
        admitted piecewise and batched by tokens, like any other work."""
        kinds = frozenset({SCORE})
        with _Run(self, self.admission.admit(len(texts))) as run:

            async def start(first: int, k: int) -> list[asyncio.Future]:
                with self._tokenizing():
                    encoded: list[tuple[list[int], int]] = await self._on_tokenizer(
                        texts, first, k, query, encode
                    )
                return run.submit(
                    [ids for ids, _ in encoded], [OutputRequest(kinds, second) for _, second in encoded]
                )

            results = await run_piecewise(run.permit, len(texts), start)
            run.answered()
        return np.stack([r.score for r in results]), run.tokens

    def info(self) -> dict[str, Any]:
        s = self.settings
        # The first replica that serves (its workers' pids and parameter bytes).
        first = next((r for r in self.replica_set.replicas if r.state == "ready"), None)
        return {
            "model": self.name,
            "served_model_names": self.served_names,
            "model_path": str(self.spec.path),
            "architecture": self.spec.architecture,
            # A SPLADE model pools its MLM logits (SpladePooling), not its hidden states.
            "pooling": self.spec.pooling
            if self.spec.splade is None
            else f"splade_{self.spec.splade.pooling_strategy}",
            "outputs": [k for k in KINDS if k in self.spec.outputs],
            "normalize": self.spec.normalize,
            "dimension": self.spec.dimension,
            "max_input_length": self.spec.max_input_length,
            "prompts": sorted(self.spec.prompts),
            "default_prompt_name": self.spec.default_prompt_name,
            "auto_truncate": s.auto_truncate,
            "chunk_long_inputs": s.chunk_long_inputs,
            "chunk_overlap": s.chunk_overlap,
            "max_chunks_per_input": s.max_chunks_per_input,
            # On CUDA --dtype auto is decided by the workers (from the GPU's compute capability).
            "dtype": first.group.rank_info[0].get("dtype", self.dtype) if first else self.dtype,
            "device": self.device,
            "tensor_parallel_size": s.tensor_parallel_size,
            "num_threads": self.num_threads,
            "max_batch_tokens": self.max_batch_tokens,
            "max_batch_requests": s.max_batch_requests,
            "max_concurrent_requests": s.max_concurrent_requests,
            "priority_max_tokens": s.priority_max_tokens,
            "priority_batch_tokens": s.priority_batch_tokens,
            "data_parallel_size": self.replicas,
            "max_client_batch_size": s.max_client_batch_size,
            "max_request_bytes": s.max_request_bytes,
            "interactive_reserved_inputs": self.admission.reserved,
            "interactive_max_inputs": s.interactive_max_inputs,
            "max_input_chars": s.max_input_chars,
            "max_request_chars": s.max_request_chars,
            "bulk_aging_s": s.bulk_aging_s,
            "state": self.state,
            "batch_timeout": self.replica_set.batch_timeouts[0] if self.replica_set.replicas else None,
            "parameter_bytes_per_rank": [r["parameter_bytes"] for r in first.group.rank_info]
            if first
            else [],
            "worker_pids": [r["pid"] for r in first.group.rank_info] if first else [],
            "replicas": self.replica_set.info(),
            # What the workers chose (ops/fused.py, ops/attention.py) and the start-up fidelity check's
            # figure (workers/fidelity.py).
            "kernels": first.group.rank_info[0].get("kernels") if first else None,
            "attention": first.group.rank_info[0].get("attention") if first else None,
            "fidelity": first.group.rank_info[0].get("fidelity") if first else None,
            # The token-count steps replayed from CUDA graphs, or why none are (workers/graphs.py).
            "cuda_graphs": first.group.rank_info[0].get("cuda_graphs") if first else None,
            # --batch-invariant and its start-up self-check (engine/invariance_check.py); the cache's size.
            "batch_invariance": getattr(self, "invariance", None),
            "cache": None
            if self.cache is None
            else {"bytes": self.cache.max_bytes, "redis": bool(self.cache.redis)},
        }
