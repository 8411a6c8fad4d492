"""Tiny random models of each supported family, written the way real checkpoints are, with a real tokenizer.

A tiny model is a weak reference unless its weights and settings matter: 2-D weights are drawn from
N(0, 0.08) (at the default init a wrong rope theta still passes a 0.99999 cosine), norms and biases are
random too, and configs use non-default values (pad_token_id other than 1, head_dim other than
hidden / heads, fewer key/value heads than query heads, rope thetas other than the default, small sliding
windows so that long texts cross them).

Tokenizers are real ones available offline: all-MiniLM-L6-v2's WordPiece ([CLS] ... [SEP]) and SmolLM2's
byte-level BPE (no special tokens added; or wrapped in a <|im_start|> ... <|im_end|> template).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from tests.server import read_corpus

STD = 0.08

# Hand-picked texts beside the corpus: scripts, emoji, whitespace, one character, far past the max length.
EDGE_TEXTS = [
    "🙂🚀 emoji 👩‍👩‍👧 mixed with text ✨",
    "向量检索服务的嵌入模型",
    "日本語のテキスト埋め込み",
    "Ünïcödé àçcénts ß œ ø",
    "   lots\t\tof \n\n whitespace    between\u3000words   ",
    "a",
    "?",
    "def f(x):\n    return x ** 2  # code",
    "https://example.com/path?query=1&b=2",
    "3.14159 2.71828 1.41421 and 42",
    " ".join(["token"] * 600),
    "Привет, как дела? Γειά σου κόσμε. مرحبا بالعالم",
]


def texts() -> list[str]:
    """56 varied texts: short queries, long passages (truncated by every tiny model), edge cases."""
    return read_corpus("queries.jsonl", 22) + read_corpus("passages.jsonl", 22) + EDGE_TEXTS


def randomize(
    model: torch.nn.Module, seed: int = 0, scale: dict[str, float] | None = None, norm_mean: float = 1.0
) -> None:
    """2-D weights ~ N(0, STD); biases ~ N(0, STD); 1-D scales ~ norm_mean + N(0, 0.1). `scale` multiplies
    the draws of parameters whose name contains a key (a table that would otherwise hide among the scores)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            factor = next((f for key, f in (scale or {}).items() if key in name), 1.0)
            if p.dim() >= 2 or name.endswith("bias"):
                p.copy_(noise * STD * factor)
            else:
                p.copy_(norm_mean + noise * 0.1 * factor)


@dataclass(frozen=True)
class Tiny:
    """One tiny model: a transformers config and class, a tokenizer, and its sentence-transformers files."""

    name: str
    model_class: str
    config: Callable[[], Any]
    tokenizer: str  # "wordpiece", "bpe" or "bpe-template"
    pooling: str | None = None  # sentence-transformers pooling mode; None: no sentence-transformers files
    normalize: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    reference_config: dict[str, Any] = field(default_factory=dict)
    """Config overrides for the transformers reference (e.g. is_causal=False)."""
    default_pooling: str = "last"
    """For folders without sentence-transformers files: the documented default the server applies."""
    weight_scale: dict[str, float] = field(default_factory=dict)
    """Parameter-name fragment -> factor on its random draw (see randomize)."""
    norm_mean: float = 1.0
    """The centre of the random norm scales as stored: 0 for Gemma, whose checkpoints store scale - 1 (at 1
    every norm of a Gemma would double its input, and the tiny model would be far more fragile than a real
    one: bf16 weight rounding alone moved its vectors to cosine 0.9990)."""
    dense: tuple[tuple[int, bool], ...] = ()
    """sentence-transformers Dense modules after pooling (EmbeddingGemma's layout): (out_features, bias),
    identity activation, random weights."""


def load_tokenizer(kind: str, sources: dict[str, Path]):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    if kind == "wordpiece":
        return AutoTokenizer.from_pretrained(str(sources["wordpiece"]))
    tok = AutoTokenizer.from_pretrained(str(sources["bpe"]))
    if kind == "bpe-template":
        # RoBERTa-style <s> ... </s> around every text, with SmolLM2's chat markers as <s> and </s>.
        bos, eos = "<|im_start|>", "<|im_end|>"
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A {eos}",
            pair=f"{bos} $A {eos} {eos} $B {eos}",
            special_tokens=[(bos, tok.convert_tokens_to_ids(bos)), (eos, tok.convert_tokens_to_ids(eos))],
        )
    return tok


def build(tiny: Tiny, path: Path, sources: dict[str, Path]) -> Path:
    """Write config, weights (save_pretrained), tokenizer and, when asked, the sentence-transformers files."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, tiny.model_class)(tiny.config()).eval()
    randomize(model, scale=tiny.weight_scale, norm_mean=tiny.norm_mean)
    model.save_pretrained(str(path))
    tok = load_tokenizer(tiny.tokenizer, sources)
    # Embedding models are fed plain text. sentence-transformers 6 renders every text through the
    # tokenizer's chat template when there is one; SmolLM2's would wrap each text in a system prompt.
    tok.chat_template = None
    pad = model.config.pad_token_id
    if pad is not None:
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    tok.save_pretrained(str(path))
    if tiny.pooling is not None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

        modules: list[Any] = [
            Transformer(str(path), max_seq_length=tiny.max_seq_length),
            Pooling(model.config.hidden_size, tiny.pooling),
        ]
        width = model.config.hidden_size
        for out_features, bias in tiny.dense:
            dense = Dense(width, out_features, bias=bias, activation_function=torch.nn.Identity())
            randomize(dense, seed=len(modules))
            modules.append(dense)
            width = out_features
        if tiny.normalize:
            modules.append(Normalize())
        SentenceTransformer(
            modules=modules, prompts=tiny.prompts, default_prompt_name=tiny.default_prompt_name, device="cpu"
        ).save(str(path))
    return path


def set_tokenizer_config(path: Path, **values: Any) -> None:
    file = path / "tokenizer_config.json"
    cfg = json.loads(file.read_text())
    cfg.update(values)
    file.write_text(json.dumps(cfg, indent=2))


# --- references -------------------------------------------------------------------------------------------


def st_reference(path: Path, inputs: list[str], **encode_kwargs: Any) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(inputs, batch_size=16, convert_to_numpy=True, **encode_kwargs).astype(np.float32)


def hf_reference(
    path: Path, ids: list[list[int]], pooling: str, normalize: bool, **config: Any
) -> np.ndarray:
    """The transformers model on the given id sequences (right-padded batches with an attention mask), then
    the given pooling over each sequence's real tokens, in float32."""
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.from_pretrained(str(path))
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModel.from_pretrained(str(path), config=cfg, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), 16):
            chunk = ids[start : start + 16]
            width = max(len(seq) for seq in chunk)
            input_ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in chunk])
            mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in chunk])
            hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, L, H)
            for row, seq in enumerate(chunk):
                h = hidden[row, : len(seq)]
                pooled = {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[pooling]
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                out.append(pooled.numpy())
    return np.stack(out).astype(np.float32)


# --- talking to the server --------------------------------------------------------------------------------


def embed(url: str, inputs: Any, **kw: Any) -> tuple[np.ndarray, dict]:
    r = httpx.post(url + "/v1/embeddings", json={"input": inputs, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32), body


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
