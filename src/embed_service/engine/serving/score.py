"""Scoring models: rerank and classify (the pair tokenizers and activations: engine/scoring.py); each
(query, document) pair or text one scoring sequence, admitted piecewise and batched by tokens."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np

from embed_service.engine.admission import check_request, run_piecewise
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.scoring import (
    ChatPairTokenizer,
    PairTokenizer,
    PromptTokenizer,
    ScoreResult,
    activate,
    check_pairs,
    pair_tokenizer,
)
from embed_service.engine.serving.base import EngineBase, Run
from embed_service.engine.text import EmbedOptions
from embed_service.engine.tokenizer import InputTooLongError
from embed_service.models.spec import ScoreSpec
from embed_service.outputs import SCORE, OutputRequest


class ScoreServing(EngineBase):
    """rerank and classify, for cross-encoders, sequence classifiers and LLM rerankers."""

    @functools.cached_property
    def _pairs(self) -> PairTokenizer | PromptTokenizer | ChatPairTokenizer:
        return pair_tokenizer(self.spec, self.tokenizer.backend.to_str(), self.settings.rerank_instruction)

    def _score_spec(self, route: str) -> ScoreSpec:
        if self.spec.score is None:
            raise InvalidInputError(
                f"model {self.name} is an embedding model: it does not {route} (serve a cross-encoder or a "
                "sequence classifier; see docs/models.md)",
                param="model",
            )
        return self.spec.score

    async def rerank(
        self,
        query: str,
        documents: list[str],
        truncate: bool = True,
        doc_tokens: int | None = None,
        instruction: str | None = None,
    ) -> ScoreResult:
        """One relevance score per (query, document), as CrossEncoder.predict gives it; (n, 1) scores."""
        self._check_ready()
        score = self._score_spec("rerank")
        if len(score.labels) != 1:
            raise InvalidInputError(
                f"model {self.name} has {len(score.labels)} labels; reranking needs one score per pair "
                "(use /classify)",
                param="model",
            )
        if not query:
            raise InvalidInputError("query must not be empty", param="query")
        pairs = self._pairs
        if instruction is not None and not isinstance(pairs, PromptTokenizer):
            raise InvalidInputError(
                "instruction applies to LLM rerankers (--llm-reranker); a cross-encoder scores the pair as it is",
                param="instruction",
            )
        check_pairs(query + (instruction or ""), documents, self.limits)

        def encode(piece: list[str], first: int) -> list[tuple[list[int], int]]:
            try:
                if isinstance(pairs, PromptTokenizer):
                    return pairs.encode(query, piece, truncate, doc_tokens, first, instruction)
                return pairs.encode(query, piece, truncate, doc_tokens, first)
            except InputTooLongError as exc:  # the route's fields are query and documents, not input
                raise InvalidInputError(
                    f"the query and document {exc.index} make more than the maximum of {exc.limit} tokens "
                    f"(at least {exc.length}); shorten them, or send truncate=true (the default) or "
                    "max_tokens_per_doc",
                    param="documents",
                ) from None

        logits, tokens = await self._score(documents, query, encode)
        return ScoreResult(activate(logits, score.rerank_activation), tokens)

    async def classify(self, inputs: list[str], opts: EmbedOptions | None = None) -> ScoreResult:
        """Label probabilities per text, as the transformers text-classification pipeline gives them."""
        opts = opts or EmbedOptions()
        self._check_ready()
        score = self._score_spec("classify")
        if score.head in ("yes_no", "logit_score"):
            raise InvalidInputError(f"model {self.name} is an LLM reranker: it reranks, it does not classify")
        rule = self.truncation(opts)
        check_request(inputs, None, self.limits)

        def encode(piece: list[str], first: int) -> list[tuple[list[int], int]]:
            return [(ids, 0) for ids in self._token_ids(piece, rule, None, first)]

        logits, tokens = await self._score(inputs, None, encode)
        return ScoreResult(activate(logits, score.classify_activation), tokens)

    async def _score(self, texts: list[str], query: str | None, encode: Any) -> tuple[np.ndarray, int]:
        """Admit, tokenize (`encode(piece, first)` on a tokenization thread), batch and run scoring
        sequences; their (n, labels) logits and token count. A request of thousands of documents is
        admitted piecewise and batched by tokens, like any other work."""
        kinds = frozenset({SCORE})
        with Run(self, self.admission.admit(len(texts))) as run:

            async def start(first: int, k: int) -> list[asyncio.Future[Any]]:
                with self._tokenizing():
                    encoded: list[tuple[list[int], int]] = await self._on_tokenizer(
                        texts, first, k, query, encode
                    )
                return run.submit(
                    [ids for ids, _ in encoded], [OutputRequest(kinds, second) for _, second in encoded]
                )

            results = await run_piecewise(run.permit, len(texts), start)
            run.answered()
        return np.stack([r.score for r in results]), run.tokens
