"""Embedding: the token ids of a request (tokenize), and its vectors when it is not chunked: each input one
sequence, batched, run, pooled and finished; a front end's tokenized texts (embed_tokenized) the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from embed_service.engine.admission import Permit, run_piecewise
from embed_service.engine.serving.base import EngineBase, Run
from embed_service.engine.text import EmbedOptions, EmbedResult, Inputs, finish
from embed_service.engine.tokenizer import Truncation
from embed_service.outputs import COLBERT, DENSE, SPARSE, OutputRequest, Sparse


class EmbedServing(EngineBase):
    """tokenize, embed (unchunked) and embed_tokenized."""

    async def tokenize(self, inputs: Inputs, opts: EmbedOptions | None = None) -> list[list[int]]:
        """The token ids embed() would run, after prompting and truncation; admitted like embed()."""
        opts = opts or EmbedOptions()
        rule = self.truncation(opts)
        prompt = self._prompt(inputs, opts)
        permit = self._admit(inputs, prompt)
        try:
            ids: list[list[int]] = []
            while len(ids) < len(inputs):
                k = max(1, permit.free())
                permit.take(k)
                ids += await self._tokenize_piece(inputs, len(ids), k, rule, prompt)
                permit.done(k)
            return ids
        finally:
            permit.close()

    async def _embed_plain(
        self, inputs: Inputs, opts: EmbedOptions, output: OutputRequest, rule: Truncation, prompt: str | None
    ) -> EmbedResult:
        """embed() of a request that does not chunk: each input one sequence, truncated as `rule` says."""

        async def piece(first: int, k: int) -> list[list[int]]:
            return await self._tokenize_piece(inputs, first, k, rule, prompt)

        return await self._embed_run(self._admit(inputs, prompt), len(inputs), piece, opts, output)

    async def embed_tokenized(self, ids: list[list[int]], opts: EmbedOptions | None = None) -> EmbedResult:
        """embed() of texts that a front-end process has checked and tokenized (frontends/, with
        `TextSide.tokenize_texts`): their budgets, prompt and truncation are done, so `ids` are admitted and
        batched as they are, as embed() would batch the same texts' ids."""
        opts = opts or EmbedOptions()
        output = self._output_checks(opts)

        async def piece(first: int, k: int) -> list[list[int]]:
            return ids[first : first + k]

        return await self._embed_run(self.admission.admit(len(ids)), len(ids), piece, opts, output)

    async def _embed_run(
        self,
        permit: Permit,
        n: int,
        piece: Callable[[int, int], Awaitable[list[list[int]]]],
        opts: EmbedOptions,
        output: OutputRequest,
    ) -> EmbedResult:
        """An admitted request's `n` sequences (`piece(first, k)`: the ids of k of them) batched, run and
        finished."""
        with Run(self, permit, opts.cache) as run:

            async def start(first: int, k: int) -> list[asyncio.Future[Any]]:
                return run.submit(await piece(first, k), output)

            results = await run_piecewise(run.permit, n, start)
            run.answered()
        normalize = self.spec.normalize if opts.normalize is None else opts.normalize
        kinds = output.kinds
        dense = (
            np.stack([r.dense for r in results])
            if DENSE in kinds
            else np.zeros((len(results), 0), np.float32)
        )
        return EmbedResult(
            finish(dense, opts.dimensions, normalize),
            run.tokens,
            sparse=[self._sparse(r.sparse, opts) for r in results] if SPARSE in kinds else None,
            colbert=[r.colbert for r in results] if COLBERT in kinds else None,
        )

    def _sparse(self, s: Sparse, opts: EmbedOptions) -> Sparse:
        """bge-m3's lexical weights without the special tokens (a SPLADE vector keeps every vocabulary
        entry, as sentence-transformers does); then the request's threshold and top-k."""
        if self.spec.splade is None:
            keep = ~np.isin(s.indices, self.tokenizer.lexical_skip_ids)
            s = Sparse(s.indices[keep], s.values[keep])
        if opts.sparse_threshold is not None:
            keep = s.values >= opts.sparse_threshold
            s = Sparse(s.indices[keep], s.values[keep])
        if opts.max_active_dims is not None and s.values.size > opts.max_active_dims:
            top = np.sort(np.argpartition(-s.values, opts.max_active_dims - 1)[: opts.max_active_dims])
            s = Sparse(s.indices[top], s.values[top])  # ascending ids still
        return s
