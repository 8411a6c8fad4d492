"""One engine per served model: tokenize, admit, batch, run, pool, finish.

The engine owns the tokenizer, the batcher and the worker group. It never sees HTTP; its refusals are the
exceptions in engine/errors.py. This module builds it and runs its life cycle (start, drain, close, a
replica lost) and /info; what each request kind does is in engine/serving/ (embed.py, windowed.py,
score.py, over base.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Any, cast

import numpy as np

from embed_service import metrics
from embed_service.batching.batcher import Batcher
from embed_service.cache import output_cache
from embed_service.config import ModelSettings, Settings
from embed_service.engine import invariance_check
from embed_service.engine.admission import Admission
from embed_service.engine.errors import NotReadyError
from embed_service.engine.image_side import MixedInputs, has_images
from embed_service.engine.replicas import Replicas
from embed_service.engine.serving.embed import EmbedServing
from embed_service.engine.serving.images import ImageServing
from embed_service.engine.serving.score import ScoreServing
from embed_service.engine.serving.windowed import WindowedServing
from embed_service.engine.text import EmbedOptions, EmbedResult, Inputs
from embed_service.engine.tokenizer import Tokenizer
from embed_service.layers.quantize import fidelity_threshold, unsupported
from embed_service.models.spec import ModelSpec
from embed_service.ops.cpu_kernels import cpu_flags
from embed_service.outputs import DENSE, KINDS, OutputRequest, SequenceOutput
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
# A priority lane's batches take at most this many priority requests' worth of tokens
# (--priority-max-tokens each): the second batch a CPU worker holds beside its bulk one stays small.
LANE_BATCH_REQUESTS = 8
# How many levels nicer bulk work runs than the priority lane, on a CPU. With priority lanes (one rank per
# replica: each worker's second thread answers short requests beside its bulk batch) the workers' main
# threads run BULK_THREAD_NICE levels lower; otherwise (tensor parallelism) the bulk replicas' processes,
# all but the last one, which the batcher keeps small for short requests, run BULK_REPLICA_NICE lower.
# While the cores are contended the short requests' work and the HTTP process go first; idle cores still go
# to bulk work. docs/performance.md has the measured effect ("Interactive traffic under bulk load").
BULK_THREAD_NICE = 10
BULK_REPLICA_NICE = 4


class Engine(EmbedServing, WindowedServing, ScoreServing, ImageServing):
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
        if settings.quantization == "int8":
            why = unsupported(self.device, spec.family.causal, cpu_flags())
            if why is not None:
                raise ValueError(why)
        tp = settings.tensor_parallel_size
        numerics = self.dtype if settings.quantization == "none" else f"{self.dtype}+{settings.quantization}"
        self.cache = output_cache(settings, spec, self.name, f"{numerics}/{self.device}/tp={tp}")
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
            quantization=settings.quantization,
            fidelity_min_cosine=fidelity_threshold(settings),
            # int8 is checked on real text too (workers/fidelity.CHECK_TEXTS says why)
            check_ids=() if settings.quantization == "none" else self._check_ids(),
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
        lanes = self._priority_lanes()
        self.invariance = await asyncio.to_thread(
            invariance_check.check,
            self._compute_any,  # every replica, then (with lanes) every replica's lane
            self.replicas * (2 if lanes else 1),
            self.spec.outputs,
            self.spec.vocab_size or 1000,
            self.spec.max_input_length,
        )
        if self.invariance["enabled"] and not self.invariance["verified"]:
            log.warning("model %s: batch invariance not verified: %s", self.name, self.invariance["detail"])
            self.cache = None  # its hits would not be the bytes a computation gives
        self.batcher = Batcher(
            [functools.partial(self._compute_async, replica=r) for r in range(self.replicas)],
            self.max_batch_tokens,
            self.settings.max_batch_requests,
            self.name,
            priority_batch_tokens=self.settings.priority_batch_tokens
            if self.settings.priority_max_tokens and not lanes
            else 0,
            bulk_aging_s=self.settings.bulk_aging_s,
            lanes=[functools.partial(self._compute_async, replica=r, lane=True) for r in range(self.replicas)]
            if lanes
            else None,
            lane_batch_tokens=LANE_BATCH_REQUESTS * self.settings.priority_max_tokens,
        )
        self.replica_set.batcher = self.batcher
        self.batcher.start()
        if self.state == "loading":
            self.state = "ready"
            log.info("model %s: ready", self.name)

    def _check_ids(self) -> tuple[tuple[int, ...], ...]:
        """The fidelity check's real texts as this model serves them (special tokens, EOS where it asks)."""
        from embed_service.workers.fidelity import CHECK_TEXTS

        return tuple(tuple(ids) for ids in self.tokenizer.encode(list(CHECK_TEXTS)))

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
        if self._priority_lanes():
            config = dataclasses.replace(config, priority_lane=True, nice=BULK_THREAD_NICE)
        elif self._reserves_last_replica() and index < self.replicas - 1:
            config = dataclasses.replace(config, nice=BULK_REPLICA_NICE)
        if config.world_size > 1:  # every group its own rendezvous (an old one's port may linger)
            config = dataclasses.replace(config, dist_port=free_port())
        return WorkerGroup(config, on_death=on_death)

    def _priority_lanes(self) -> bool:
        """Whether each replica's worker answers the priority lane on a thread of its own (worker.py): on a
        CPU, one rank per replica, with the lane on (--priority-max-tokens)."""
        return (
            self.worker_config.device == "cpu"
            and self.worker_config.world_size == 1
            and bool(self.settings.priority_max_tokens)
        )

    def _reserves_last_replica(self) -> bool:
        """Whether the batcher keeps the last replica's batches small for short requests (batcher.py): on a
        CPU without priority lanes its workers then run at normal priority and the others' at
        BULK_REPLICA_NICE."""
        s = self.settings
        return (
            not self._priority_lanes()
            and self.replicas > 1
            and self.worker_config.device == "cpu"
            and bool(s.priority_max_tokens and s.priority_batch_tokens)
        )

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

    async def _compute_async(
        self,
        ids: np.ndarray,
        lengths: np.ndarray,
        requests: list[OutputRequest],
        replica: int = 0,
        lane: bool = False,
    ) -> list[SequenceOutput]:
        return await self.replica_set.compute_async(replica, ids, lengths, requests, lane)

    def _compute_any(
        self, ids: np.ndarray, lengths: np.ndarray, requests: list[OutputRequest], backend: int
    ) -> list[SequenceOutput]:
        """Backend `backend` as the batcher numbers them: the replicas, then their priority lanes."""
        replica, lane = backend % self.replicas, backend >= self.replicas
        return self.replica_set.compute(replica, ids, lengths, requests, lane)

    def _count_in_flight(self, n: int) -> None:
        """The admission's count, as the drain and the metrics read it."""
        self.in_flight = n
        self._in_flight_gauge.set(n)
        if n:
            self._idle.clear()
        else:
            self._idle.set()

    async def embed(self, inputs: Inputs | MixedInputs, opts: EmbedOptions | None = None) -> EmbedResult:
        """The request's vectors: chunked (late, or long inputs as windows: serving/windowed.py) or not
        (serving/embed.py), as its options and the server's defaults say."""
        opts = opts or EmbedOptions()
        if has_images(inputs):  # a CLIP or SigLIP model's images (and texts): serving/images.py
            return await self._embed_images(inputs, opts)
        inputs = cast(Inputs, inputs)
        output, rule, prompt, chunk_rule = self._embed_checks(inputs, opts)
        if chunk_rule is not None and chunk_rule.late is not None:  # late chunking: engine/late.py
            return await self._embed_late(inputs, opts, chunk_rule, prompt)  # type: ignore[arg-type]
        if chunk_rule is not None:  # long inputs as windows: engine/chunking.py
            return await self._embed_windowed(inputs, opts, chunk_rule, prompt)  # type: ignore[arg-type]
        return await self._embed_plain(inputs, opts, output, rule, prompt)

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
            "modalities": sorted(self.spec.modalities),
            "max_input_length": self.spec.max_input_length,
            "prompts": sorted(self.spec.prompts),
            "default_prompt_name": self.spec.default_prompt_name,
            "auto_truncate": s.auto_truncate,
            "chunk_long_inputs": s.chunk_long_inputs,
            "chunk_overlap": s.chunk_overlap,
            "max_chunks_per_input": s.max_chunks_per_input,
            # On CUDA --dtype auto is decided by the workers (from the GPU's compute capability).
            "dtype": first.group.rank_info[0].get("dtype", self.dtype) if first else self.dtype,
            "quantization": self.settings.quantization,
            "device": self.device,
            "tensor_parallel_size": s.tensor_parallel_size,
            "num_threads": self.num_threads,
            "max_batch_tokens": self.max_batch_tokens,
            "max_batch_requests": s.max_batch_requests,
            "max_concurrent_requests": s.max_concurrent_requests,
            "priority_max_tokens": s.priority_max_tokens,
            "priority_batch_tokens": s.priority_batch_tokens,
            "priority_lanes": self._priority_lanes(),
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
            "packed_weight_bytes_per_rank": [r.get("packed_weight_bytes", 0) for r in first.group.rank_info]
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
