"""Scoring requests (rerank, classify): their budgets, pair tokenization, and logits made scores.

Pairs are tokenized as sentence-transformers' CrossEncoder has the model's fast tokenizer do it:
``tokenizer(query, document, truncation=True)``, i.e. the pair template ([CLS] A [SEP] B [SEP], or
<s> A </s></s> B </s>) and ``longest_first`` truncation to the max input length (a token at a time off the
longer text). Token types come from the same encoding: the first position of type 1 is all the worker
needs (outputs.OutputRequest.second_segment).

Budgets, before anything is tokenized: documents per request (``--max-client-batch-size``, as inputs on
every route), characters per pair (``--max-input-chars``: the tokenizer reads both texts whole, so a pair
longer is refused, not cut), characters per request (``--max-request-chars``, the query counted with each
document).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from embed_service.engine.admission import Limits
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.tokenizer import InputTooLongError
from embed_service.models.spec import ModelSpec


@dataclass
class ScoreResult:
    """scores: (n, labels) float32 after the activation asked for; tokens: the tokens run."""

    scores: np.ndarray
    tokens: int


def check_pairs(query: str, documents: list[str], limits: Limits) -> None:
    """Refuse a rerank request past a budget (400), before anything is tokenized."""
    n = len(documents)
    if not n:
        raise InvalidInputError("documents must hold at least one document", param="documents")
    if n > limits.max_inputs:
        raise InvalidInputError(
            f"{n} documents in one request; the limit is {limits.max_inputs} (--max-client-batch-size)",
            param="documents",
        )
    longest = max(range(n), key=lambda i: len(documents[i]))
    if len(query) + len(documents[longest]) > limits.max_input_chars:
        raise InvalidInputError(
            f"the query and document {longest} have {len(query) + len(documents[longest])} characters; a "
            f"pair may have at most {limits.max_input_chars} (--max-input-chars)",
            param="documents",
        )
    total = n * len(query) + sum(map(len, documents))
    if total > limits.max_request_chars:
        raise InvalidInputError(
            f"the {n} pairs make {total} characters to tokenize (the query counted with each document), "
            f"more than the limit of {limits.max_request_chars} per request (--max-request-chars)",
            param="documents",
        )


class PairTokenizer:
    """The model's fast tokenizer on (query, document) pairs; thread-safe (two copies, never mutated)."""

    def __init__(self, backend_json: str, max_length: int, use_token_types: bool):
        from tokenizers import Tokenizer

        self.max_length = max_length
        self.use_token_types = use_token_types
        self.plain = Tokenizer.from_str(backend_json)
        self.plain.no_truncation()
        self.plain.no_padding()
        self.truncating = Tokenizer.from_str(backend_json)
        self.truncating.no_padding()
        self.truncating.enable_truncation(max_length, strategy="longest_first")

    def encode(
        self, query: str, documents: list[str], truncate: bool, doc_tokens: int | None = None, first: int = 0
    ) -> list[tuple[list[int], int]]:
        """(token ids, where token type 1 starts or 0) per pair. The query is tokenized once; each document
        is cut to `doc_tokens` tokens first when asked (Cohere's max_tokens_per_doc), then the pair gets its
        template and truncation, as ``tokenizer(query, document)`` does (encode each text, post-process
        the two). `first`: documents[0]'s index, for messages; a pair too long with truncation off is
        InputTooLongError."""
        tok = self.truncating if truncate else self.plain
        q = tok.encode(query, add_special_tokens=False)
        out = []
        for i, d in enumerate(tok.encode_batch(documents, add_special_tokens=False)):
            if doc_tokens is not None and len(d.ids) > doc_tokens:
                d.truncate(doc_tokens)
            enc = tok.post_process(q, d)
            ids = enc.ids
            if len(ids) > self.max_length:
                raise InputTooLongError(first + i, len(ids), self.max_length)
            second = 0
            if self.use_token_types:
                types = enc.type_ids
                second = types.index(1) if 1 in types else 0
                if second and any(t != 1 for t in types[second:]):
                    raise InvalidInputError(
                        "the tokenizer's pair template has token types other than A then B", param="model"
                    )
            out.append((ids, second))
        return out


# Qwen3-Reranker's documented prompt (its model card): a system turn, the user turn with the instruction,
# query and document, and an assistant turn opened with an empty think block; the answer's first token is
# scored, `yes` against `no`.
QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


class PromptTokenizer:
    """An LLM reranker's pairs as its model card builds them: the prefix's tokens, the body's (instruction,
    query and document in one text, cut from the right so that the whole fits the max input length), the
    suffix's. Same `encode` as PairTokenizer; no token types."""

    def __init__(self, backend_json: str, max_length: int, instruction: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(backend_json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.prefix = self.tok.encode(QWEN3_PREFIX, add_special_tokens=False).ids
        self.suffix = self.tok.encode(QWEN3_SUFFIX, add_special_tokens=False).ids
        self.max_length = max_length
        self.body_tokens = max_length - len(self.prefix) - len(self.suffix)
        if self.body_tokens < 1:
            raise ValueError(f"the reranker's prompt template alone passes the max input length {max_length}")
        self.instruction = instruction

    def encode(
        self,
        query: str,
        documents: list[str],
        truncate: bool,
        doc_tokens: int | None = None,
        first: int = 0,
        instruction: str | None = None,
    ) -> list[tuple[list[int], int]]:
        documents = _first_tokens(self.tok, documents, doc_tokens)
        bodies = [
            QWEN3_BODY.format(instruction=instruction or self.instruction, query=query, document=d)
            for d in documents
        ]
        out = []
        for i, enc in enumerate(self.tok.encode_batch(bodies, add_special_tokens=False)):
            ids = enc.ids
            if len(ids) > self.body_tokens:
                if not truncate:
                    raise InputTooLongError(
                        first + i, len(ids) + len(self.prefix) + len(self.suffix), self.max_length
                    )
                ids = ids[: self.body_tokens]
            out.append((self.prefix + ids + self.suffix, 0))
        return out


def _first_tokens(tok: Any, documents: list[str], doc_tokens: int | None) -> list[str]:
    """Each document cut to its first `doc_tokens` tokens, as text (before it joins a prompt)."""
    if doc_tokens is None:
        return documents
    cut = []
    for d, enc in zip(documents, tok.encode_batch(documents, add_special_tokens=False)):
        cut.append(d[: enc.offsets[doc_tokens - 1][1]] if len(enc.ids) > doc_tokens else d)
    return cut


# Texts the chat template must carry into its render (sentence-transformers' pair-role probe) and the two
# fillers whose renders' common token tail is the template's suffix.
_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))
_FILLERS = ("0", "1 2 3 4")


class ChatPairTokenizer:
    """A LogitScore model's pairs as sentence-transformers 6 feeds them when its tokenizer has a chat template
    (the message modality): a ``query`` and a ``document`` message rendered by the template (transformers'
    apply_chat_template, no generation prompt), tokenized without special tokens, cut from the right to the
    max input length, and then, on a row that reached the max length, the template's suffix (the common
    token tail of two renders with different contents) written back over its last tokens, so that the last
    token is still the template's. Same `encode` as PairTokenizer; no token types."""

    def __init__(self, path: str, backend_json: str, max_length: int, chat_format: str):
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)  # its apply_chat_template renders the messages
        self.tok = Tokenizer.from_str(backend_json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.max_length = max_length
        self.chat_format = chat_format
        base, *varied = (self._render(q, d) for q, d in _PROBES)
        dropped = [role for role, render in zip(("query", "document"), varied) if render == base]
        if dropped:
            raise ValueError(
                f"{path}: the chat template does not carry the {' and '.join(dropped)} message into its "
                "render (sentence-transformers refuses it too)"
            )
        first, second = (self._ids(self._render(f, f)) for f in _FILLERS)
        common = 0
        for a, b in zip(reversed(first), reversed(second)):
            if a != b:
                break
            common += 1
        self.suffix = first[len(first) - common :] if 0 < common < min(len(first), len(second)) else []

    def _render(self, query: str, document: str) -> str:
        def message(role: str, text: str) -> dict[str, Any]:
            content: Any = text if self.chat_format == "flat" else [{"type": "text", "text": text}]
            return {"role": role, "content": content}

        return str(
            self.hf.apply_chat_template(
                [message("query", query), message("document", document)], tokenize=False
            )
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode(
        self, query: str, documents: list[str], truncate: bool, doc_tokens: int | None = None, first: int = 0
    ) -> list[tuple[list[int], int]]:
        documents = _first_tokens(self.tok, documents, doc_tokens)
        renders = [self._render(query, d) for d in documents]
        out = []
        for i, enc in enumerate(self.tok.encode_batch(renders, add_special_tokens=False)):
            ids = list(enc.ids)
            if len(ids) > self.max_length and not truncate:
                raise InputTooLongError(first + i, len(ids), self.max_length)
            if len(ids) >= self.max_length:
                ids = ids[: self.max_length]
                keep = min(len(self.suffix), len(ids))
                if keep:
                    ids[len(ids) - keep :] = self.suffix[len(self.suffix) - keep :]
            out.append((ids, 0))
        return out


def pair_tokenizer(
    spec: ModelSpec, backend_json: str, instruction: str
) -> PairTokenizer | PromptTokenizer | ChatPairTokenizer:
    """How a scoring model's (query, document) pairs are tokenized: the Qwen3-Reranker prompt
    (--llm-reranker), a LogitScore model's chat template, else the tokenizer's pair template."""
    score = spec.score
    if score is not None and score.head == "yes_no":
        return PromptTokenizer(backend_json, spec.max_input_length, instruction)
    if score is not None and score.chat_format is not None:
        return ChatPairTokenizer(str(spec.path), backend_json, spec.max_input_length, score.chat_format)
    types = int(spec.config.get("type_vocab_size", 0)) > 1  # RoBERTa's table has one row
    return PairTokenizer(backend_json, spec.max_input_length, types)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """(n, L) logits -> scores: sigmoid, softmax, tanh, identity; yes_no: softmax over [no, yes], the
    probability of yes (Qwen3-Reranker's score), as (n, 1)."""
    logits = logits.astype(np.float32, copy=False)
    if activation == "sigmoid":
        return _sigmoid(logits)
    if activation == "softmax":
        return _softmax(logits)
    if activation == "tanh":
        return np.tanh(logits)
    if activation == "yes_no":
        return _softmax(logits)[:, 1:2]
    return logits
