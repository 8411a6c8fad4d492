"""Several HTTP processes in front of one set of engines (``--http-processes N``, N > 1).

One HTTP process tops out at a few thousand requests a second per core (docs/performance.md, "The front
end's ceiling"): less than a fast GPU serves. Here the server's first process keeps the engines (their
tokenizers, admission, batchers, replicas, workers and the engine's metrics) and starts N front-end
processes that share the listening socket it bound first; each runs the same app (HTTP, auth, validation,
response encoding) over `RemoteEngine`s, which pass each call's arguments (the inputs and their
`EmbedOptions`) to the engine process and get its result back (an `EmbedResult`, token ids, scores). An
embedding request of texts that does not chunk is checked and tokenized in the front end, with the
engine's own code (engine.py's `TextSide`), and goes as token ids (`Engine.embed_tokenized`): long inputs'
tokenization, most of their cost, is spread over the front ends; the engine process admits and batches.

The channel is one Unix socket pair per front end, length-prefixed pickles both ways over asyncio streams
(never a blocking send, so two large messages crossing cannot deadlock). Messages, front end -> engines:
``("call", id, model, method, args)``, ``("cancel", id)`` (the client went away: the engine's task is
cancelled, as in one process), ``("http", samples)`` (this front end's HTTP series, cumulative, when asked);
engines -> front end: ``("ok", id, value)``, ``("err", id, exception)``, ``("state", models, fatal)`` (each
model's state, failure and /info, sent whenever they change), ``("report",)``.

/metrics is answered by the engine process: its own registry with the HTTP series (requests, durations)
summed over the front ends, each asked for its series at the scrape. SIGTERM to the first process: it stops admitting and passes SIGTERM on to every front
end, which drains as one server does (503 to new requests, admitted ones answered); once they are gone the
engines close and it exits 0. A front end that dies, or an engine that fails, takes the server down (exit 1)
so that an orchestrator restarts it; a front end whose engine process is gone exits.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from embed_service import metrics, observability
from embed_service.config import ServerSettings, Settings
from embed_service.engine.engine import EmbedOptions, EmbedResult, TextSide
from embed_service.engine.tokenizer import Tokenizer
from embed_service.models.spec import ModelSpec
from embed_service.plan import ModelPlan, Plan

log = logging.getLogger("embed_service")

STATE_POLL_S = 0.1  # how often the engine process looks for a changed model state to send
REPORT_WAIT_S = 1.0  # how long a scrape waits for the front ends' HTTP series (one that is stuck: its last)
# recorded by the front ends (tokenization: of the texts they tokenize; the engine process records the rest)
HTTP_FAMILIES = ("embed_requests", "embed_request_duration_seconds", "embed_tokenization_duration_seconds")
# the engine methods a front end may call
CALLS = ("embed", "embed_tokenized", "tokenize", "rerank", "classify", "wait_idle")
_LENGTH = struct.Struct("!I")


# --- the channel: length-prefixed pickles over asyncio streams ---------------------------------------------


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next message; EOFError when the other side is gone."""
    try:
        (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        raise EOFError from None


def send(writer: asyncio.StreamWriter, message: Any) -> None:
    if writer.is_closing():
        return
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(data)) + data)


def pack_error(exc: BaseException) -> tuple[type[BaseException], tuple, dict]:
    """An exception as its class, args and attributes: the engine's errors take constructor arguments that
    are not their args (a model name, a list of names), so plain pickling would not rebuild them."""
    return type(exc), exc.args, dict(vars(exc))


def unpack_error(packed: tuple[type[BaseException], tuple, dict]) -> BaseException:
    cls, args, attrs = packed
    exc = cls.__new__(cls)
    exc.args = args
    vars(exc).update(attrs)
    return exc


# --- HTTP series summed over the front ends ------------------------------------------------------------------


def http_samples() -> list[tuple[str, tuple, float]]:
    """This process's HTTP series as (sample name, labels, value): cumulative, so the latest report is all."""
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in (metrics.REQUESTS, metrics.REQUEST_DURATION, metrics.TOKENIZATION_DURATION)
        for m in family.collect()
        for s in m.samples
    ]


class SummedHTTP:
    """The engine registry's families, the HTTP ones with each sample summed over the front ends' reports
    (``_created`` timestamps: the earliest)."""

    def __init__(self, reports: dict[int, list[tuple[str, tuple, float]]]):
        self.reports = reports

    def collect(self) -> Any:
        total: dict[tuple[str, tuple], float] = {}
        for samples in self.reports.values():
            for name, labels, value in samples:
                key = (name, labels)
                if name.endswith("_created"):
                    total[key] = min(total.get(key, value), value)
                else:
                    total[key] = total.get(key, 0.0) + value
        for family in metrics.REGISTRY.collect():
            if family.name not in HTTP_FAMILIES:
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in sorted(total.items()):
                if name.startswith(family.name):
                    out.add_sample(name, dict(labels), value)
            yield out


# --- the engine process -----------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """What a front end needs to build one model's `RemoteEngine`."""

    name: str
    served_names: list[str]
    settings: Settings
    spec: ModelSpec
    device: str
    plan: ModelPlan


class EngineHost:
    """The first process with N > 1: it runs the engines and answers the front ends' calls."""

    def __init__(self, settings: ServerSettings, sock: socket.socket, engines: list[Any], plan: Plan):
        self.settings = settings
        self.sock = sock
        self.engines = {e.name: e for e in engines}
        self.plan = plan
        self.fatal: str | None = None
        self.draining = False
        self.reports: dict[int, list[tuple[str, tuple, float]]] = {}
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.reported: dict[int, asyncio.Event] = {}
        self.procs: list[Any] = []
        self.exit_code = 0
        self.connections: Any = None  # every front end's open connections, one shared count

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            log.error("fatal: %s; the server exits so the orchestrator restarts it", reason)
            self.fatal = reason
            self.exit_code = 1

    def snapshot(self) -> tuple:
        return (
            {name: (e.state, e.failure, e.info()) for name, e in self.engines.items()},
            self.fatal,
        )

    async def metrics_text(self) -> bytes:
        asking = [i for i, w in self.writers.items() if not w.is_closing()]
        for i in asking:
            self.reported[i].clear()
            send(self.writers[i], ("report",))
        try:
            await asyncio.wait_for(asyncio.gather(*(self.reported[i].wait() for i in asking)), REPORT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("a scrape got no HTTP series from a front end in %.0fs: its last ones", REPORT_WAIT_S)
        registry = CollectorRegistry(auto_describe=False)
        # This process's own (zero) series too: every model's appear before its first request, as in one.
        registry.register(SummedHTTP({**self.reports, -1: http_samples()}))
        return generate_latest(registry)

    async def _call(self, writer: asyncio.StreamWriter, call_id: int, model: str, method: str, args: tuple):
        try:
            if method == "metrics":
                value: Any = await self.metrics_text()
            elif method in CALLS:
                value = await getattr(self.engines[model], method)(*args)
            else:
                raise ValueError(f"no such engine call: {method}")
            send(writer, ("ok", call_id, value))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            send(writer, ("err", call_id, pack_error(exc)))

    async def _serve_frontend(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        tasks: dict[int, asyncio.Task] = {}

        def forget(call_id: int, _task: asyncio.Task) -> None:
            tasks.pop(call_id, None)

        send(writer, ("state", *self.snapshot()))
        try:
            while True:
                message = await receive(reader)
                kind = message[0]
                if kind == "call":
                    _, call_id, model, method, args = message
                    task = asyncio.create_task(self._call(writer, call_id, model, method, args))
                    tasks[call_id] = task
                    task.add_done_callback(functools.partial(forget, call_id))
                elif kind == "cancel":
                    if (running := tasks.get(message[1])) is not None:
                        running.cancel()
                elif kind == "http":
                    self.reports[index] = message[1]
                    self.reported[index].set()
        except EOFError:
            pass
        finally:
            for task in list(tasks.values()):  # its clients are gone with it
                task.cancel()

    async def _push_state(self) -> None:
        last = None
        while True:
            now = self.snapshot()
            if now != last:
                for writer in self.writers.values():
                    send(writer, ("state", *now))
                last = now
            await asyncio.sleep(STATE_POLL_S)

    async def _load(self) -> None:
        try:
            await asyncio.gather(*(e.start() for e in self.engines.values()))
            log.info(
                "serving %s on http://%s:%d with %d HTTP processes",
                ", ".join(n for e in self.engines.values() for n in e.served_names),
                self.settings.host,
                self.settings.port,
                self.settings.http_processes,
            )
        except Exception as exc:
            log.error("loading failed: %s", exc)
            self._fail(str(exc))

    def _on_signal(self, sig: int) -> None:
        if self.draining:
            return
        log.info("received %s: draining (no new requests; finishing admitted ones)", signal.Signals(sig).name)
        self.draining = True
        for e in self.engines.values():
            e.begin_drain()
        for p in self.procs:  # each front end drains its own clients, as one server does
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for e in self.engines.values():
            e.on_fatal.append(self._fail)
        ctx = mp.get_context("spawn")
        self.connections = ctx.Value("i", 0)
        infos = [
            ModelInfo(e.name, e.served_names, e.settings, e.spec, e.device, e.plan)
            for e in self.engines.values()
        ]
        serving = []
        for i in range(self.settings.http_processes):
            ours, theirs = socket.socketpair()
            proc = ctx.Process(
                target=run_frontend,
                args=(i, self.settings, self.sock, theirs, infos, self.plan, self.connections),
                name=f"embed-http-{i}",
                daemon=True,  # never outlives this process
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            self.writers[i] = writer
            self.reported[i] = asyncio.Event()
            serving.append(asyncio.create_task(self._serve_frontend(i, reader, writer)))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        load = asyncio.create_task(self._load())
        pusher = asyncio.create_task(self._push_state())
        # Until every front end has exited: after a drain, that is the end; before it, a failure.
        while any(p.is_alive() for p in self.procs):
            if self.fatal is not None or not all(p.is_alive() for p in self.procs):
                if not self.draining and not all(p.is_alive() for p in self.procs):
                    self._fail("an HTTP process exited")
                await asyncio.sleep(2.0)  # the front ends answer what they can, then go
                for p in self.procs:
                    if p.is_alive():
                        p.terminate()
                break
            await asyncio.sleep(0.1)
        for p in self.procs:
            await loop.run_in_executor(None, p.join, 10)
            if p.is_alive():
                p.kill()
        for task in (load, pusher, *serving):
            task.cancel()
        await asyncio.gather(load, pusher, *serving, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)
        for writer in self.writers.values():
            writer.close()
        return self.exit_code


def serve_frontends(settings: ServerSettings, sock: socket.socket, engines: list[Any], plan: Plan) -> int:
    """Serve with `settings.http_processes` HTTP processes in front of `engines`; the exit status."""
    from embed_service.server import uvicorn_config

    with asyncio.Runner(loop_factory=uvicorn_config(None, settings).get_loop_factory()) as runner:
        return runner.run(EngineHost(settings, sock, engines, plan).run())


# --- a front-end process -------------------------------------------------------------------------------------


class Channel:
    """A front end's side of its socket pair: calls by id, their results routed back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_state: Any):
        self.reader = reader
        self.writer = writer
        self.on_state = on_state
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()

    async def call(self, model: str | None, method: str, *args: Any) -> Any:
        call_id = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        send(self.writer, ("call", call_id, model, method, args))
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: so does the engine's work for it
            send(self.writer, ("cancel", call_id))
            raise
        finally:
            self.pending.pop(call_id, None)

    async def listen(self) -> None:
        """Route the engine process's messages until it is gone."""
        try:
            while True:
                message = await receive(self.reader)
                if message[0] == "state":
                    self.on_state(message[1], message[2])
                    continue
                if message[0] == "report":
                    send(self.writer, ("http", http_samples()))
                    continue
                kind, call_id, value = message
                future = self.pending.get(call_id)
                if future is None or future.done():
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(unpack_error(value))
        except EOFError:
            pass
        gone = ConnectionError("the engine process is gone")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(gone)
        self.on_state(None, "the engine process is gone")


class RemoteEngine(TextSide):
    """An `Engine` as the routes use it, in a front-end process: its calls run in the engine process, but
    for embed() of texts without chunking, which it checks and tokenizes here (with the engine's own code,
    `TextSide`, on threads of its own) and sends as token ids: tokenization, most of the work of long
    inputs, is then spread over the front ends. Chunked requests go as texts (the engine plans windows on
    the texts)."""

    def __init__(self, info: ModelInfo, channel: Channel):
        self.name = info.name
        self.served_names = info.served_names
        self.settings = info.settings
        self.spec = info.spec
        self.device = info.device
        self.plan = info.plan
        self.tokenizer = Tokenizer(info.spec)
        self._start_text_side()
        self.channel = channel
        self.state = "loading"
        self.failure: str | None = None
        self._info: dict[str, Any] = {}
        self.on_fatal: list[Any] = []
        self.loaded = asyncio.Event()

    def update(self, state: str, failure: str | None, info: dict[str, Any]) -> None:
        if self.state != "draining" or state in ("failed",):
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

    async def embed(self, inputs: Any, opts: EmbedOptions | None = None) -> EmbedResult:
        opts = opts or EmbedOptions()
        if not inputs or not isinstance(inputs[0], str):  # token ids: the engine checks them
            return await self.channel.call(self.name, "embed", inputs, opts)
        # The engine's refusals in its order: its checks, then the budgets, then tokenization; its 429
        # comes after (the tokenizing here is bounded by the budgets, as the engine's is).
        _output, rule, prompt, chunk_rule = self._embed_checks(inputs, opts)
        if chunk_rule is not None:
            return await self.channel.call(self.name, "embed", inputs, opts)
        ids = await self.tokenize_texts(inputs, rule, prompt)
        return await self.channel.call(self.name, "embed_tokenized", ids, opts)

    async def tokenize(self, inputs: Any, opts: Any = None) -> Any:
        return await self.channel.call(self.name, "tokenize", inputs, opts)

    async def rerank(self, *args: Any) -> Any:
        return await self.channel.call(self.name, "rerank", *args)

    async def classify(self, inputs: Any, opts: Any = None) -> Any:
        return await self.channel.call(self.name, "classify", inputs, opts)

    async def wait_idle(self, timeout: float) -> bool:
        return bool(await self.channel.call(self.name, "wait_idle", timeout))


def run_frontend(
    index: int,
    settings: ServerSettings,
    sock: socket.socket,
    channel_sock: socket.socket,
    infos: list[ModelInfo],
    plan: Plan,
    connections: Any,
) -> None:
    """A front-end process: the app over `RemoteEngine`s, on the shared socket, until drained or orphaned;
    `connections`: the open connections of every front end, counted together (http_limits.py's
    `server_wide`)."""
    import sys

    from embed_service.api.app import create_app
    from embed_service.api.http_limits import server_wide
    from embed_service.server import DrainingServer, uvicorn_config

    observability.configure(settings.log_level, settings.log_format, settings.otlp_endpoint)

    async def main() -> int:
        reader, writer = await asyncio.open_unix_connection(sock=channel_sock)
        engines: list[RemoteEngine] = []
        server: DrainingServer | None = None

        def on_state(models: dict | None, fatal: str | None) -> None:
            for e in engines:
                if models and e.name in models:
                    e.update(*models[e.name])
            if fatal and server is not None:
                server.app_state.fatal = fatal
                server.fatal(fatal)

        channel = Channel(reader, writer, on_state)
        engines.extend(RemoteEngine(info, channel) for info in infos)
        app = create_app(settings, engines, plan)  # type: ignore[arg-type]

        async def metrics_text() -> bytes:
            return await channel.call(None, "metrics")

        app.state.server.metrics_text = metrics_text
        config = uvicorn_config(app, settings)
        config.http = server_wide(config.http, connections)  # type: ignore[arg-type]
        server = DrainingServer(config, app.state.server, settings.drain_timeout)
        app.state.server.on_fatal.append(server.fatal)
        listening = asyncio.create_task(channel.listen())
        await server.serve(sockets=[sock])
        listening.cancel()
        writer.close()
        return server.exit_code

    # uvicorn's own loop (uvloop where installed), as `uvicorn.Server.run` would choose it
    loop_factory = uvicorn_config(None, settings).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        sys.exit(runner.run(main()))
