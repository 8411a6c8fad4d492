"""What the API needs of an engine, as a `Protocol`: the routes, the app's lifespan and /health use only
this. Two classes implement it: `Engine` (engine/engine.py), which runs the model in this process, and
`RemoteEngine` (frontends/frontend.py), which passes calls to the engine process over the channel. No
torch here, so a front-end process that imports the API does not load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from embed_service.config import Settings
from embed_service.engine.image_side import MixedInputs
from embed_service.engine.scoring import ScoreResult
from embed_service.engine.text import EmbedOptions, EmbedResult, Inputs
from embed_service.engine.tokenizer import Tokenizer
from embed_service.models.spec import ModelSpec
from embed_service.outputs import OutputRequest
from embed_service.plan import ModelPlan


class ServingEngine(Protocol):
    """One served model as the API sees it."""

    name: str
    served_names: list[str]
    settings: Settings
    spec: ModelSpec
    device: str
    plan: ModelPlan
    tokenizer: Tokenizer
    state: str
    """loading -> ready <-> restarting -> draining | failed"""
    failure: str | None
    on_fatal: list[Callable[[str], Any]]
    """Called (with the reason) when the model can no longer serve."""

    async def start(self) -> None: ...

    def begin_drain(self) -> None: ...

    async def wait_idle(self, timeout: float) -> bool: ...

    async def close(self) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def output_request(self, kinds: frozenset[str] | None) -> OutputRequest: ...

    async def embed(self, inputs: Inputs | MixedInputs, opts: EmbedOptions | None = None) -> EmbedResult: ...

    async def tokenize(self, inputs: Inputs, opts: EmbedOptions | None = None) -> list[list[int]]: ...

    async def rerank(
        self,
        query: str,
        documents: list[str],
        truncate: bool = True,
        doc_tokens: int | None = None,
        instruction: str | None = None,
    ) -> ScoreResult: ...

    async def classify(self, inputs: list[str], opts: EmbedOptions | None = None) -> ScoreResult: ...
