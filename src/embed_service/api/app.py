"""The app factory. The lifespan owns the engines: it starts loading them in the background, so the socket
is open and /health answers 503 until the model is ready, and it tears them down after `yield`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI

from embed_service import __version__, observability
from embed_service.api import cohere, docs, openapi, rerank
from embed_service.api.access_log import AccessLogMiddleware, telemetry_config
from embed_service.api.auth import ApiKeys, load_api_keys
from embed_service.api.errors import install_handlers
from embed_service.api.hot_routes import HotRoutes, hot_endpoints
from embed_service.api.routes import check_api_key, router
from embed_service.config import ServerSettings
from embed_service.engine.errors import ModelNotFoundError
from embed_service.engine.protocol import ServingEngine
from embed_service.plan import Plan

log = logging.getLogger(__name__)


class Models:
    """The served engines by name (canonical names and aliases); the first answers requests naming none."""

    def __init__(self, engines: list[ServingEngine]):
        self.engines = engines
        self.by_name = {name: e for e in engines for name in e.served_names}
        self.default = engines[0]

    def get(self, name: str | None) -> ServingEngine:
        if name is None:
            return self.default
        try:
            return self.by_name[name]
        except KeyError:
            raise ModelNotFoundError(name, list(self.by_name)) from None

    @property
    def ready(self) -> bool:
        return all(e.state == "ready" for e in self.engines)


class ServerState:
    """What the routes and the process runner share."""

    def __init__(self, settings: ServerSettings, models: Models, api_keys: ApiKeys, plan: Plan):
        self.settings = settings
        self.models = models
        self.plan = plan  # the machine as the models share it (plan.py)
        self.api_keys = api_keys
        self.draining = False
        self.fatal: str | None = None
        self.on_fatal: list[Any] = []
        # With several HTTP processes: a coroutine for the engine process's /metrics text (frontends/).
        self.metrics_text: Any = None

    def begin_drain(self) -> None:
        self.draining = True
        for e in self.models.engines:
            e.begin_drain()


def create_app(settings: ServerSettings, engines: Sequence[ServingEngine], plan: Plan) -> FastAPI:
    """The app serving `engines` (one per model); `plan`: the resource plan they were built from (/info
    shows it; server.local_plan for engines built one by one)."""
    state = ServerState(settings, Models(list(engines)), load_api_keys(settings), plan)

    def fatal(reason: str) -> None:
        state.fatal = reason
        for callback in state.on_fatal:
            callback(reason)

    for e in engines:
        e.on_fatal.append(fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            t0 = time.perf_counter()
            try:
                await asyncio.gather(*(e.start() for e in engines))
            except Exception as exc:
                log.error("loading failed: %s", exc)
                fatal(str(exc))
                return
            log.info(
                "serving %s on http://%s:%d (ready in %.1fs)",
                ", ".join(state.models.by_name),
                settings.host,
                settings.port,
                time.perf_counter() - t0,
            )

        task = asyncio.create_task(load())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)

    # FastAPI's own /docs, /redoc and /openapi.json are open to all and load their assets from a CDN:
    # docs.router serves them behind the key, with packaged assets.
    app = FastAPI(
        title="embed-service",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry=telemetry_config(),
    )
    app.state.server = state
    install_handlers(app)
    app.include_router(router)
    app.include_router(cohere.router)
    app.include_router(rerank.router)
    if settings.docs:
        app.include_router(docs.router)
    openapi.install(
        app,
        [router, cohere.router, rerank.router],
        check_api_key,
        bool(state.api_keys),
        rerank.REQUEST_MODELS,
    )
    if observability.tracer_provider() is None:  # traced requests take FastAPI's routing (http.route)
        endpoints = hot_endpoints(
            [*router.routes, *cohere.router.routes, *rerank.router.routes], check_api_key
        )
        app.add_middleware(HotRoutes, endpoints=endpoints, check=check_api_key)
    app.add_middleware(AccessLogMiddleware, default_model=engines[0].name)  # the metrics too: one layer
    return app
