"""A server with ``--http-processes 2`` whose engine process serves a stand-in engine: the real channel,
front ends, app and HTTP, with an engine that fails on demand in the ways a real one cannot be made to
(an exception that cannot be pickled, a pydantic ValidationError, an answer that cannot be pickled).

`python tests/stub_engine.py PORT` serves the default model's spec and tokenizer; an embedding request's
first text says what the engine does with it: "unpicklable error", "validation error", "unpicklable
answer", "refusal" (an InvalidInputError with a param), anything else: zero vectors.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from embed_service import observability
from embed_service.config import ServerSettings, Settings
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.text import EmbedOptions, EmbedResult, TextSide
from embed_service.engine.tokenizer import Tokenizer
from embed_service.frontends.host import serve_frontends
from embed_service.models.spec import load_spec
from embed_service.plan import Machine, ModelPlan, Plan
from embed_service.server import bind_socket, default_model_path


class Unpicklable(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()  # no pickle for this


class _Strict(BaseModel):
    n: int


class StubEngine(TextSide):
    """A `ServingEngine` that answers embed calls by the first text's words (see the module docstring)."""

    def __init__(self, settings: Settings, path: Path):
        self.settings = settings
        self.spec = load_spec(path, None)
        self.name = "stub"
        self.served_names = ["stub"]
        self.device = "cpu"
        self.plan = ModelPlan("stub", "cpu", 1, 1, 1, (("cpu",),))
        self.tokenizer = Tokenizer(self.spec)
        self._start_text_side()
        self.state = "loading"
        self.failure: str | None = None
        self.on_fatal: list[Any] = []

    async def start(self) -> None:
        self.state = "ready"

    def begin_drain(self) -> None:
        self.state = "draining"

    async def wait_idle(self, timeout: float) -> bool:
        return True

    async def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False)

    def info(self) -> dict[str, Any]:
        return {"model": self.name, "state": self.state}

    async def embed_tokenized(self, ids: list[list[int]], opts: EmbedOptions | None = None) -> Any:
        what = self.tokenizer.backend.decode(ids[0])
        if "unpicklable error" in what:
            raise Unpicklable("an error that cannot be pickled")
        if "validation error" in what:
            try:
                _Strict(n="not a number")  # type: ignore[arg-type]
            except ValidationError as exc:
                raise exc from None
        if "unpicklable answer" in what:
            return threading.Lock()
        if "refusal" in what:
            raise InvalidInputError("the stub refuses this", param="dimensions")
        return EmbedResult(np.zeros((len(ids), self.spec.dimension), np.float32), sum(map(len, ids)))

    embed = embed_tokenized


def main(port: int) -> int:
    settings = ServerSettings(port=port, host="127.0.0.1", http_processes=2)
    observability.configure(settings.log_level, settings.log_format, None)
    sock = bind_socket(settings.host, settings.port)
    engine = StubEngine(Settings(), default_model_path())
    return serve_frontends(settings, sock, [engine], Plan(Machine(1), (engine.plan,)))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
