"""uvicorn as the server runs it, in one process or in each HTTP front end (frontends/): its config from the
settings, SIGTERM as a drain, and the exit soon after a fatal failure. Below both server.py and frontends/.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from types import FrameType

import uvicorn

from embed_service.api.http_limits import uvicorn_options
from embed_service.config import ServerSettings

log = logging.getLogger("embed_service")

FATAL_EXIT_DELAY_S = 2.0  # long enough for the 503s of failed requests to go out
FATAL_GRACE_S = 5  # then at most this long for open connections to finish


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM turned into a drain instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, app_state, drain_timeout: float):
        super().__init__(config)
        self.app_state = app_state
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets and self.started:  # uvicorn says where it listens only for sockets it bound itself
            self._log_started_message(sockets)
        if self.started:
            # What start-up built (the app, its routes, models' configs and tokenizers, imported modules)
            # lives as long as the process: out of the collector's reach, a collection walks only what
            # requests allocate since (reference counting still frees what is let go of).
            gc.collect()
            gc.freeze()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self.should_exit:
            self.force_exit = sig == signal.SIGINT
            self.should_exit = True
            return
        # Runs in the signal handler on the loop's thread: schedule the drain.
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        log.info("received %s: draining (no new requests; finishing admitted ones)", signal.Signals(sig).name)
        self.app_state.begin_drain()
        engines = self.app_state.models.engines
        results = await asyncio.gather(*(e.wait_idle(self.drain_timeout) for e in engines))
        if not all(results):
            log.warning("drain timed out after %.0fs; exiting with requests in flight", self.drain_timeout)
        log.info("drained; shutting down")
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        """A model cannot serve any more (it did not load, or its restarts keep failing): exit 1 soon."""
        if self.exit_code:
            return  # reported already (a model and the app may both report one failure)
        log.error(
            "fatal: %s; exiting in %.0fs so the orchestrator restarts the server", reason, FATAL_EXIT_DELAY_S
        )
        self.exit_code = 1
        # Every waiting request has failed already: bound the wait for open connections, so the exit
        # comes within seconds of the failure whatever the clients do.
        self.config.timeout_graceful_shutdown = FATAL_GRACE_S
        asyncio.get_event_loop().call_later(FATAL_EXIT_DELAY_S, setattr, self, "should_exit", True)


def uvicorn_config(app, settings: ServerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout) + 5,
        **uvicorn_options(settings, "" if app is None else app.state.server.models.default.name),
    )
