"""Embedding with chunking: a long text as windows whose vectors are averaged (engine/chunking.py), and late
chunking (engine/late.py); both planned whole first, then run as windows (chunking.run_windowed)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from embed_service.engine import chunking, late
from embed_service.engine.admission import check_request
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.serving.base import EngineBase, Run
from embed_service.engine.text import EmbedOptions, EmbedResult, finish
from embed_service.engine.tokenizer import PromptError


class WindowedServing(EngineBase):
    """embed() of a request that chunks its inputs."""

    def _plan_windows(
        self,
        texts: list[str],
        prompt: str | None,
        rule: chunking.ChunkRule,
        first: int,
        tally: chunking.Tally,
    ) -> list[list[chunking.Window]]:
        """Runs on a tokenization thread (the prompt was checked before admission)."""
        try:
            return chunking.plan(self.tokenizer, texts, prompt, rule, first, tally)
        except chunking.ChunkError as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None

    async def _embed_windowed(
        self, inputs: list[str], opts: EmbedOptions, rule: chunking.ChunkRule, prompt: str | None
    ) -> EmbedResult:
        """embed() for a request that chunks its long texts: planned whole (and refused past its budget)
        first, then each window a sequence, admitted as one (chunking.run_windowed)."""
        check_request(inputs, prompt, self.limits)
        try:  # before admission: refusals that need no tokenizing of the texts
            self.tokenizer.check_prompt(prompt, rule.max_length)  # a prompt that fills the window first
            chunking.check_overlap(self.tokenizer, rule, prompt)
            chunking.check_chars(inputs, prompt, rule)
        except (chunking.ChunkError, PromptError) as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None
        planned: list[list[chunking.Window]] = []
        tally = chunking.Tally(rule)  # the request's windows and tokens, against its budget
        with Run(self, self.admission.admit(len(inputs))) as run:

            async def plan_piece(first: int, k: int) -> list[list[chunking.Window]]:
                with self._tokenizing():
                    done = await self._on_tokenizer(
                        inputs,
                        first,
                        k,
                        prompt,
                        lambda texts, at: self._plan_windows(texts, prompt, rule, at, tally),
                    )
                planned.extend(done)
                return done

            def submit(windows: list[chunking.Window]) -> list[asyncio.Future[Any]]:
                return run.submit([w.ids for w in windows])

            results = await chunking.run_windowed(run.permit, len(inputs), plan_piece, submit)
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        pooled = [np.stack([r.dense for r in rs]) for rs in results]  # per input (w, D)
        combined = np.stack([chunking.combine(v, [w.weight for w in ws]) for v, ws in zip(pooled, planned)])
        chunks = None
        if rule.return_chunks:
            chunks = [
                chunking.Chunks(
                    [(w.start, w.end, w.weight) for w in ws], finish(v, opts.dimensions, normalize)
                )
                for v, ws in zip(pooled, planned)
            ]
        return EmbedResult(finish(combined, opts.dimensions, normalize), run.tokens, chunks)

    async def _embed_late(
        self, inputs: list[str], opts: EmbedOptions, rule: chunking.ChunkRule, prompt: str | None
    ) -> EmbedResult:
        """embed() with late chunking (engine/late.py): each input one sequence asking for its plain vector
        and its chunks' pooled vectors, or a long one's macro-windows; planned whole first and run as the
        windows of chunking.run_windowed are (an input that fits is one window, as without chunking)."""
        asked = rule.late
        assert asked is not None
        check_request(inputs, prompt, self.limits)
        texts, spans = inputs, asked
        if asked.joined:  # Jina's late_chunking: the inputs are one document's chunks
            text, cut = late.joined(inputs)
            texts, spans = [text], dataclasses.replace(asked, spans=tuple(cut))
        try:
            self.tokenizer.check_prompt(prompt, rule.max_length)
            chunking.check_chars(texts, prompt, rule)
        except (chunking.ChunkError, PromptError) as exc:
            raise InvalidInputError(str(exc), param=exc.param) from None

        tally = chunking.Tally(rule)  # the request's sequences and tokens, against its budget
        combinable = not self.spec.dense  # a long input's chunks combine pieces: no Dense layers after

        def plan(piece: list[str], at: int) -> list[late.LatePlan]:
            try:
                out = []
                for i, t in enumerate(piece):
                    p = late.plan(
                        self.tokenizer, t, prompt, spans, rule.max_length, at + i, rule.max_chunks, combinable
                    )
                    tally.add(p.windows, at + i)
                    out.append(p)
                return out
            except chunking.ChunkError as exc:
                raise InvalidInputError(str(exc), param=exc.param) from None

        planned: list[late.LatePlan] = []
        with Run(self, self.admission.admit(len(texts))) as run:

            async def plan_piece(first: int, k: int) -> list[list[late.LateWindow]]:
                with self._tokenizing():
                    done = await self._on_tokenizer(texts, first, k, prompt, plan)
                planned.extend(done)
                return [p.windows for p in done]

            def submit(windows: list[late.LateWindow]) -> list[asyncio.Future[Any]]:
                return run.submit([w.ids for w in windows], [w.request for w in windows])

            results = await chunking.run_windowed(run.permit, len(texts), plan_piece, submit)  # type: ignore[arg-type]
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        pooled = [late.combine(p, r) for p, r in zip(planned, results)]
        chunks = [
            chunking.Chunks(p.spans, finish(v, opts.dimensions, normalize))
            for p, (v, _) in zip(planned, pooled)
        ]
        if asked.joined:  # one vector per input: the chunks' vectors
            return EmbedResult(chunks[0].vectors, run.tokens)
        dense = finish(np.stack([d for _, d in pooled]), opts.dimensions, normalize)
        return EmbedResult(dense, run.tokens, chunks)
