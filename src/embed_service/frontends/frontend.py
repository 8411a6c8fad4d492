"""An HTTP front-end process: the app over `RemoteEngine`s, whose calls go to the engine process over the
channel (channel.py). No torch is imported here: the text side (engine/text.py) and the API are torch-free.

Each call has a deadline (--engine-call-timeout; past it: 503, and the engine's work is cancelled). When
the engine process is gone, or the channel fails, every pending call fails at once with 503, later calls
get 503 at once, /health says why, and the process exits 1 soon after (the engine process is its parent:
there is nothing to reconnect to).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import sys
from dataclasses import dataclass
from typing import Any, cast

from embed_service import observability
from embed_service.api.app import create_app
from embed_service.api.http_limits import server_wide
from embed_service.config import ServerSettings, Settings
from embed_service.engine.errors import NotReadyError, OverloadedError
from embed_service.engine.image_side import ImageSide, MixedInputs, has_images
from embed_service.engine.scoring import ScoreResult
from embed_service.engine.text import EmbedOptions, EmbedResult, Inputs
from embed_service.engine.tokenizer import Tokenizer, TokenizerFiles
from embed_service.frontends.channel import (
    Call,
    Cancel,
    Channel,
    Err,
    HttpSeries,
    Ok,
    Report,
    State,
    error_from,
    trace_context,
)
from embed_service.frontends.series import http_samples
from embed_service.http_server import DrainingServer, uvicorn_config
from embed_service.models.spec import ModelSpec
from embed_service.plan import ModelPlan, Plan

log = logging.getLogger("embed_service")

MAX_PENDING_CALLS = 4096  # per front end; past it a call is refused at once (429), not queued


@dataclass
class ModelInfo:
    """What a front end needs to build one model's `RemoteEngine`."""

    name: str
    served_names: list[str]
    settings: Settings
    spec: ModelSpec
    device: str
    plan: ModelPlan
    tokenizer: TokenizerFiles  # the engine's, rebuilt here without transformers (and torch)


class SharedCount:
    """Every front end's open connections, as `http_limits.server_wide` counts them (`get_lock`, `value`),
    kept in one slot per front end of a shared array: the total is their sum, and a front end counts in its
    own slot, so one that dies (its connections never report closed) leaves nothing behind once the engine
    process zeroes its slot to restart it."""

    def __init__(self, slots: Any, index: int):
        self.slots = slots
        self.index = index

    def get_lock(self) -> Any:
        return self.slots.get_lock()

    @property
    def value(self) -> int:
        return int(sum(self.slots))

    @value.setter
    def value(self, total: int) -> None:  # under get_lock(), as server_wide sets it
        self.slots[self.index] += total - self.value


class EngineClient:
    """A front end's calls to the engine process, by id, their answers routed back."""

    def __init__(self, sock: socket.socket, timeout: float, on_state: Any, on_gone: Any):
        self.timeout = timeout
        self.on_state = on_state
        self.on_gone = on_gone
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.gone: str | None = None
        self.channel = Channel(sock, self._receive, self._closed, "engine")

    async def call(self, model: str | None, method: str, *args: Any, wait: float = 0.0) -> Any:
        """`method(*args)` of `model`'s engine in the engine process; `wait`: how long the call itself
        may wait (a drain's), past which the deadline starts."""
        if self.gone:
            raise NotReadyError(self.gone)
        if len(self.pending) >= MAX_PENDING_CALLS:
            raise OverloadedError(f"this HTTP process has {MAX_PENDING_CALLS} calls waiting on the engine")
        call_id = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        try:
            try:
                await self.channel.send(Call(call_id, model, method, args, trace_context()))
            except OSError:
                raise NotReadyError(self.gone or "the engine process is gone") from None
            return await asyncio.wait_for(future, self.timeout + wait)
        except TimeoutError:
            self.channel.post(Cancel(call_id))
            raise NotReadyError(f"the engine did not answer within {self.timeout + wait:g} s") from None
        except asyncio.CancelledError:  # the client went away: so does the engine's work for it
            self.channel.post(Cancel(call_id))
            raise
        finally:
            self.pending.pop(call_id, None)

    def _receive(self, message: Any) -> None:
        if isinstance(message, State):
            self.on_state(message.models, message.fatal)
        elif isinstance(message, Report):
            self.channel.post(HttpSeries(http_samples()))
        elif isinstance(message, (Ok, Err)):
            future = self.pending.get(message.id)
            if future is None or future.done():
                return
            if isinstance(message, Ok):
                future.set_result(message.value)
            else:
                future.set_exception(error_from(message))
        else:
            raise TypeError(f"no such message from the engine process: {type(message).__name__}")

    def close(self) -> None:
        """This process is stopping: the channel closes, and nothing is reported gone."""
        self.gone = "this HTTP process is stopping"
        self.channel.close(self.gone)
        self._fail_pending()

    def _fail_pending(self) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(NotReadyError(self.gone or "the engine process is gone"))

    def _closed(self, reason: str) -> None:
        """The engine process is gone (or the channel failed): every pending call fails now, with 503."""
        if self.gone:  # closed here, on purpose
            return
        self.gone = f"the engine process is unavailable: {reason}"
        log.error("%s; failing %d pending calls", self.gone, len(self.pending))
        self._fail_pending()
        self.on_gone(self.gone)


class RemoteEngine(ImageSide):
    """A `ServingEngine` (engine/protocol.py) in a front-end process: its calls run in the engine process,
    but for embed() of texts without chunking, which it checks and tokenizes here (with the engine's own
    code, `TextSide`, on threads of its own) and sends as token ids: tokenization, most of the work of long
    inputs, is then spread over the front ends. Chunked requests go as texts (the engine plans windows on
    the texts)."""

    def __init__(self, info: ModelInfo, client: EngineClient):
        self.name = info.name
        self.served_names = info.served_names
        self.settings = info.settings
        self.spec = info.spec
        self.device = info.device
        self.plan = info.plan
        self.tokenizer = Tokenizer(info.spec, info.tokenizer)
        self._start_text_side()
        self.client = client
        self.state = "loading"
        self.failure: str | None = None
        self._info: dict[str, Any] = {}
        self.on_fatal: list[Any] = []
        self.loaded = asyncio.Event()

    def update(self, state: str, failure: str | None, info: dict[str, Any]) -> None:
        if self.state != "draining" or state == "failed":
            self.state = state
        self.failure = failure
        self._info = info
        if state != "loading":
            self.loaded.set()

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    async def start(self) -> None:
        await self.loaded.wait()
        if self.state == "failed":
            raise RuntimeError(self.failure or f"model {self.name} failed")

    def begin_drain(self) -> None:
        if self.state in ("ready", "loading", "restarting"):
            self.state = "draining"

    async def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)  # the engine process closes the engine

    async def embed(self, inputs: Inputs | MixedInputs, opts: EmbedOptions | None = None) -> EmbedResult:
        opts = opts or EmbedOptions()
        if has_images(inputs):  # decoded and preprocessed here; the pixels travel with their sequences
            ids, outputs = await self.prepare_items(inputs, opts)
            return await self.client.call(self.name, "embed_prepared", ids, outputs, opts)
        inputs = cast(Inputs, inputs)
        if not inputs or not isinstance(inputs[0], str):  # token ids: the engine checks them
            return await self.client.call(self.name, "embed", inputs, opts)
        # The engine's refusals in its order: its checks, then the budgets, then tokenization; its 429
        # comes after (the tokenizing here is bounded by the budgets, as the engine's is).
        _output, rule, prompt, chunk_rule = self._embed_checks(inputs, opts)
        if chunk_rule is not None:
            return await self.client.call(self.name, "embed", inputs, opts)
        ids = await self.tokenize_texts(inputs, rule, prompt)
        return await self.client.call(self.name, "embed_tokenized", ids, opts)

    async def tokenize(self, inputs: Inputs, opts: EmbedOptions | None = None) -> list[list[int]]:
        return await self.client.call(self.name, "tokenize", inputs, opts)

    async def rerank(
        self,
        query: str,
        documents: list[str],
        truncate: bool = True,
        doc_tokens: int | None = None,
        instruction: str | None = None,
    ) -> ScoreResult:
        return await self.client.call(
            self.name, "rerank", query, documents, truncate, doc_tokens, instruction
        )

    async def classify(self, inputs: list[str], opts: EmbedOptions | None = None) -> ScoreResult:
        return await self.client.call(self.name, "classify", inputs, opts)

    async def wait_idle(self, timeout: float) -> bool:
        return bool(await self.client.call(self.name, "wait_idle", timeout, wait=timeout))


async def _serve(
    settings: ServerSettings,
    sock: socket.socket,
    channel_sock: socket.socket,
    infos: list[ModelInfo],
    plan: Plan,
    connections: SharedCount,
) -> int:
    engines: list[RemoteEngine] = []
    server: DrainingServer | None = None

    def on_state(models: dict, fatal: str | None) -> None:
        for e in engines:
            if e.name in models:
                e.update(*models[e.name])
        if fatal:
            on_gone(fatal)

    def on_gone(reason: str) -> None:
        for e in engines:
            e.state, e.failure = "failed", reason
        if server is not None:
            server.app_state.fatal = reason  # /health: 503 with the reason, until the exit
            server.fatal(reason)

    client = EngineClient(channel_sock, settings.engine_call_timeout, on_state, on_gone)
    engines.extend(RemoteEngine(info, client) for info in infos)
    app = create_app(settings, engines, plan)

    async def metrics_text() -> bytes:
        return await client.call(None, "metrics")

    app.state.server.metrics_text = metrics_text
    config = uvicorn_config(app, settings)
    config.http = server_wide(config.http, connections)  # type: ignore[arg-type]
    server = DrainingServer(config, app.state.server, settings.drain_timeout)
    app.state.server.on_fatal.append(server.fatal)
    if client.gone:  # gone before the server existed to hear of it
        on_gone(client.gone)
    try:
        await server.serve(sockets=[sock])
    finally:
        client.close()
    return server.exit_code


def run_frontend(
    index: int,
    settings: ServerSettings,
    sock: socket.socket,
    channel_sock: socket.socket,
    infos: list[ModelInfo],
    plan: Plan,
    connection_slots: Any,
) -> None:
    """A front-end process (`index`): the app over `RemoteEngine`s, on the shared socket, until drained or
    orphaned; `connection_slots`: every front end's open connections (`SharedCount`)."""
    observability.configure(settings.log_level, settings.log_format, settings.otlp_endpoint)
    # uvicorn's own loop (uvloop where installed), as `uvicorn.Server.run` would choose it
    with asyncio.Runner(loop_factory=uvicorn_config(None, settings).get_loop_factory()) as runner:
        sys.exit(
            runner.run(
                _serve(settings, sock, channel_sock, infos, plan, SharedCount(connection_slots, index))
            )
        )
