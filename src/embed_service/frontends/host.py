"""The engine process with ``--http-processes N``: it runs the engines, starts N front-end processes
(frontend.py) on the listening socket it bound, answers their calls over one channel each (channel.py),
and supervises them.

A front end that dies (killed, crashed) is restarted with the same index while the others serve; the
requests in flight on it are lost with their TCP connections (their clients see the connection close),
and its calls' work in the engine is cancelled. Front ends that keep dying (RESTART_LIMIT within
RESTART_WINDOW_S) make the server exit 1 so that an orchestrator restarts it, as does a model that fails.
An unexpected error answering one call fails that call (a 500, logged here once); the channel serves on.

SIGTERM: stop admitting, pass SIGTERM on to every front end, which drains as one server does (503 to new
requests, admitted ones answered); once they are gone the engines close and the process exits 0.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import signal
import socket
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from embed_service.config import ServerSettings
from embed_service.engine.protocol import ServingEngine
from embed_service.frontends.channel import (
    Call,
    Cancel,
    Channel,
    HttpSeries,
    Ok,
    Report,
    State,
    error_message,
    traced_as,
)
from embed_service.frontends.frontend import ModelInfo, run_frontend
from embed_service.frontends.series import SummedHTTP, http_samples
from embed_service.http_server import FATAL_EXIT_DELAY_S, uvicorn_config
from embed_service.plan import Plan

log = logging.getLogger("embed_service")

STATE_POLL_S = 0.1  # how often the engine process looks for a changed model state to send
REPORT_WAIT_S = 1.0  # how long a scrape waits for the front ends' HTTP series (one that is stuck: its last)
RESTART_LIMIT = 5  # front-end restarts within RESTART_WINDOW_S before the server gives up (exit 1)
RESTART_WINDOW_S = 60.0
# the engine methods a front end may call
CALLS = ("embed", "embed_tokenized", "embed_prepared", "tokenize", "rerank", "classify", "wait_idle")


def _forget(tasks: dict[int, asyncio.Task], call_id: int, _done: asyncio.Task) -> None:
    tasks.pop(call_id, None)


class FrontEnd:
    """One front-end process and the engine's end of its channel; its calls' tasks, by id."""

    def __init__(self, host: EngineHost, index: int):
        self.index = index
        self.tasks: dict[int, asyncio.Task] = {}
        self.reported = asyncio.Event()
        ours, theirs = socket.socketpair()
        self.proc = mp.get_context("spawn").Process(
            target=run_frontend,
            args=(index, host.settings, host.sock, theirs, host.infos, host.plan, host.connections),
            name=f"embed-http-{index}",
            daemon=True,  # never outlives this process
        )
        self.proc.start()
        theirs.close()
        self.channel = Channel(ours, functools.partial(host.receive, self), self._closed, f"http-{index}")
        self.channel.post(State(*host.snapshot()))

    def _closed(self, reason: str) -> None:
        for task in list(self.tasks.values()):  # its clients are gone with it
            task.cancel()


class EngineHost:
    """The first process with N > 1: it runs the engines and answers the front ends' calls."""

    def __init__(
        self, settings: ServerSettings, sock: socket.socket, engines: list[ServingEngine], plan: Plan
    ):
        self.settings = settings
        self.sock = sock
        self.engines = {e.name: e for e in engines}
        self.plan = plan
        self.infos = [
            ModelInfo(e.name, e.served_names, e.settings, e.spec, e.device, e.plan, e.tokenizer.files())
            for e in engines
        ]
        self.fatal: str | None = None
        self.draining = False
        self.reports: dict[int, list[tuple[str, tuple, float]]] = {}
        self.frontends: dict[int, FrontEnd] = {}
        self.restarts: deque[float] = deque()
        self.exit_code = 0
        self.changed = asyncio.Event()  # a front end exited, a model failed, or a signal came
        # every front end's open connections, a slot each (frontend.SharedCount: --max-connections is the server's)
        self.connections = mp.get_context("spawn").Array("i", settings.http_processes)

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            log.error("fatal: %s; the server exits so the orchestrator restarts it", reason)
            self.fatal = reason
            self.exit_code = 1
            self.changed.set()

    def snapshot(self) -> tuple:
        return (
            {name: (e.state, e.failure, e.info()) for name, e in self.engines.items()},
            self.fatal,
        )

    # --- answering calls -------------------------------------------------------------------------------

    def receive(self, frontend: FrontEnd, message: Any) -> None:
        if isinstance(message, Call):
            task = asyncio.create_task(self._answer(frontend.channel, message))
            frontend.tasks[message.id] = task
            task.add_done_callback(functools.partial(_forget, frontend.tasks, message.id))
        elif isinstance(message, Cancel):
            if (running := frontend.tasks.get(message.id)) is not None:
                running.cancel()
        elif isinstance(message, HttpSeries):
            self.reports[frontend.index] = message.samples
            frontend.reported.set()
        else:
            raise TypeError(f"no such message from a front end: {type(message).__name__}")

    async def _answer(self, channel: Channel, call: Call) -> None:
        try:
            with traced_as(call.trace):
                if call.method == "metrics":
                    value: Any = await self.metrics_text()
                elif call.method in CALLS and call.model in self.engines:
                    value = await getattr(self.engines[call.model], call.method)(*call.args)
                else:
                    raise ValueError(f"no such engine call: {call.model}.{call.method}")
            answer: Any = Ok(call.id, value)
            await channel.send(answer)
            return
        except asyncio.CancelledError:
            raise
        except OSError:  # the front end is gone: nobody to answer
            return
        except Exception as exc:  # the engine's refusal, or anything else (an unpicklable value too)
            answer = error_message(call.id, exc)
            if answer.kind == "internal":
                log.error("%s failed on an unexpected error", call.method, exc_info=exc)
        try:
            await channel.send(answer)
        except OSError:
            pass

    async def metrics_text(self) -> bytes:
        asking = [f for f in self.frontends.values() if not f.channel.closed]
        for f in asking:
            f.reported.clear()
            f.channel.post(Report())
        try:
            await asyncio.wait_for(asyncio.gather(*(f.reported.wait() for f in asking)), REPORT_WAIT_S)
        except TimeoutError:
            log.warning("a scrape got no HTTP series from a front end in %.0fs: its last ones", REPORT_WAIT_S)
        registry = CollectorRegistry(auto_describe=False)
        # This process's own (zero) series too: every model's appear before its first request, as in one.
        registry.register(SummedHTTP({**self.reports, -1: http_samples()}))
        return generate_latest(registry)

    # --- the life cycle --------------------------------------------------------------------------------

    async def _push_state(self) -> None:
        last = None
        while True:
            now = self.snapshot()
            if now != last:
                for f in self.frontends.values():
                    f.channel.post(State(*now))
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
        for f in self.frontends.values():  # each front end drains its own clients, as one server does
            if f.proc.is_alive():
                f.proc.terminate()  # SIGTERM
        self.changed.set()

    def _start(self, index: int) -> None:
        frontend = FrontEnd(self, index)
        self.frontends[index] = frontend
        asyncio.get_running_loop().add_reader(frontend.proc.sentinel, self._exited, frontend)

    def _exited(self, frontend: FrontEnd) -> None:
        """A front end's process ended: restart it, unless the server is stopping or restarts keep failing."""
        asyncio.get_running_loop().remove_reader(frontend.proc.sentinel)
        frontend.proc.join()
        frontend.channel.close("the HTTP process exited")
        self.changed.set()
        if self.draining or self.fatal is not None:
            return
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and self.restarts[0] < now - RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) > RESTART_LIMIT:
            self._fail(f"HTTP processes exited {len(self.restarts)} times in {RESTART_WINDOW_S:.0f}s")
            return
        log.error(
            "HTTP process %d (pid %d) exited with %s; its open connections are lost; restarting it",
            frontend.index,
            frontend.proc.pid,
            frontend.proc.exitcode,
        )
        with self.connections.get_lock():  # its connections died with it
            self.connections[frontend.index] = 0
        self._start(frontend.index)
        log.info(
            "HTTP process %d restarted (pid %d)", frontend.index, self.frontends[frontend.index].proc.pid
        )

    def _alive(self) -> list[FrontEnd]:
        return [f for f in self.frontends.values() if f.proc.exitcode is None]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for e in self.engines.values():
            e.on_fatal.append(self._fail)
        for i in range(self.settings.http_processes):
            self._start(i)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        load = asyncio.create_task(self._load())
        pusher = asyncio.create_task(self._push_state())
        while self._alive() and self.fatal is None:
            self.changed.clear()
            await self.changed.wait()
        if self.fatal is not None:  # the front ends were told (State): they answer what they can, then go
            await asyncio.sleep(FATAL_EXIT_DELAY_S)
            for f in self._alive():
                f.proc.terminate()
        for f in list(self.frontends.values()):
            await loop.run_in_executor(None, f.proc.join, self.settings.drain_timeout + 10)
            if f.proc.is_alive():
                f.proc.kill()
        for task in (load, pusher):
            task.cancel()
        await asyncio.gather(load, pusher, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)
        for f in self.frontends.values():
            f.channel.close("the server is stopping")
        return self.exit_code


def serve_frontends(settings: ServerSettings, sock: socket.socket, engines: list[Any], plan: Plan) -> int:
    """Serve with `settings.http_processes` HTTP processes in front of `engines`; the exit status."""
    with asyncio.Runner(loop_factory=uvicorn_config(None, settings).get_loop_factory()) as runner:
        return runner.run(EngineHost(settings, sock, engines, plan).run())
