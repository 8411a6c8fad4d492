"""Embedding a request with image inputs (engine/image_side.py prepares it): each input one sequence, texts
and images batched together, their vectors finished as a text request's are. Not cached: an image's
sequence is placeholder ids, so the output cache (keyed by ids) cannot tell two images apart."""

from __future__ import annotations

from typing import Any

import numpy as np

from embed_service.engine.admission import run_piecewise
from embed_service.engine.image_side import ImageSide
from embed_service.engine.serving.base import EngineBase, Run
from embed_service.engine.text import EmbedOptions, EmbedResult, finish
from embed_service.outputs import OutputRequest


class ImageServing(EngineBase, ImageSide):
    async def embed_prepared(
        self, ids: list[list[int]], outputs: list[OutputRequest], opts: EmbedOptions
    ) -> EmbedResult:
        """A request's sequences as ImageSide.prepare_items gives them (here or in a front end), admitted,
        batched, run and finished."""
        self._check_ready()
        with Run(self, self.admission.admit(len(ids)), use_cache=False) as run:

            async def start(first: int, k: int) -> list[Any]:
                return run.submit(ids[first : first + k], outputs[first : first + k])

            results = await run_piecewise(run.permit, len(ids), start)
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        return EmbedResult(
            finish(np.stack([r.dense for r in results]), opts.dimensions, normalize), run.tokens
        )

    async def _embed_images(self, inputs: list[Any], opts: EmbedOptions) -> EmbedResult:
        ids, outputs = await self.prepare_items(inputs, opts)
        return await self.embed_prepared(ids, outputs, opts)
