"""Every supported architecture, served in float32, equals its reference on tiny random weights.

Each tiny model is written with transformers' save_pretrained (plus sentence-transformers' own save where it
has sentence-transformers files), served by a real server, and compared over 56 varied texts with
SentenceTransformer.encode on the same folder, or, for folders without sentence-transformers files, with the
transformers model plus the documented default pooling (last token, normalized, for decoders).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers as T

from tests.models.tiny import Tiny, build, cosines, embed, hf_reference, st_reference, texts
from tests.server import ServerProcess

ENCODER = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=3)
# head_dim 24 with 4 query heads on a 64-wide model; 2 key/value heads (grouped-query attention).
DECODER = dict(
    ENCODER, num_key_value_heads=2, head_dim=24, vocab_size=49152, max_position_embeddings=256, pad_token_id=0
)
# Gemma-style: hidden 56 (not a multiple of 64), head_dim 24, grouped-query attention, a query scaling of its own.
GEMMA = dict(
    hidden_size=56,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=92,
    num_hidden_layers=4,
    vocab_size=49152,
    max_position_embeddings=256,
    pad_token_id=0,
    query_pre_attn_scalar=20,
)
# EmbeddingGemma's prompts (config_sentence_transformers.json), a few of them.
EMBEDDINGGEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Clustering": "task: clustering | query: ",
}
QWEN3_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages\nQuery: ",
    "document": "",
}

CASES = [
    Tiny(
        "roberta",
        "RobertaForMaskedLM",
        lambda: T.RobertaConfig(
            **ENCODER, vocab_size=30522, pad_token_id=0, max_position_embeddings=130, type_vocab_size=1
        ),
        tokenizer="wordpiece",
        pooling="mean",
        normalize=True,
        max_seq_length=128,
    ),
    Tiny(
        "xlm-roberta",
        "XLMRobertaModel",
        lambda: T.XLMRobertaConfig(
            **ENCODER, vocab_size=49152, pad_token_id=3, max_position_embeddings=300, type_vocab_size=1
        ),
        tokenizer="bpe-template",
        pooling="cls",
        max_seq_length=96,
    ),
    Tiny(
        "modernbert",
        "ModernBertForMaskedLM",
        lambda: T.ModernBertConfig(
            **ENCODER,
            vocab_size=30522,
            pad_token_id=0,
            cls_token_id=101,
            sep_token_id=102,
            bos_token_id=101,
            eos_token_id=102,
            max_position_embeddings=512,
            local_attention=16,  # local layers see 8 tokens either side: long texts cross the window
            global_attn_every_n_layers=2,
            global_rope_theta=20000.0,
            local_rope_theta=3000.0,
            attention_bias=True,
            norm_bias=True,
        ),
        tokenizer="wordpiece",
        pooling="mean",
        normalize=True,
        max_seq_length=200,
    ),
    Tiny(
        "qwen2-bidirectional",  # gte-Qwen2 style: is_causal false, honoured by transformers itself
        "Qwen2ForCausalLM",
        lambda: T.Qwen2Config(**DECODER, rope_theta=20000.0, is_causal=False),
        tokenizer="bpe",
        pooling="lasttoken",
        normalize=True,
        max_seq_length=160,
    ),
    Tiny(
        "qwen3",  # Qwen3-Embedding style: causal, last token, prompts
        "Qwen3ForCausalLM",
        lambda: T.Qwen3Config(**DECODER, rope_theta=50000.0),
        tokenizer="bpe",
        pooling="lasttoken",
        normalize=True,
        max_seq_length=128,
        prompts=QWEN3_PROMPTS,
    ),
    Tiny(
        "llama",  # no sentence-transformers files: the default last-token pooling, normalized
        "LlamaForCausalLM",
        lambda: T.LlamaConfig(
            **{**DECODER, "max_position_embeddings": 192},
            rope_theta=3000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
        tokenizer="bpe",
    ),
    Tiny(
        "mistral-bidirectional",  # use_bidirectional_attention, which transformers ignores
        "MistralForCausalLM",
        lambda: T.MistralConfig(
            **DECODER, rope_theta=30000.0, sliding_window=24, use_bidirectional_attention=True
        ),
        tokenizer="bpe",
        reference_config={"is_causal": False},  # the same weights, bidirectional in transformers
    ),
    Tiny(
        "distilbert",  # msmarco-distilbert style: mean pooling
        "DistilBertForMaskedLM",
        lambda: T.DistilBertConfig(
            dim=56, n_heads=4, hidden_dim=92, n_layers=3, vocab_size=30522, max_position_embeddings=160
        ),
        tokenizer="wordpiece",
        pooling="mean",
        max_seq_length=150,
    ),
    Tiny(
        "camembert",  # a RoBERTa under another name: mapped to the RoBERTa implementation
        "CamembertForMaskedLM",
        lambda: T.CamembertConfig(
            **{**ENCODER, "hidden_size": 56},
            vocab_size=49152,
            pad_token_id=5,
            max_position_embeddings=200,
            type_vocab_size=1,
        ),
        tokenizer="bpe-template",
        pooling="mean",
        max_seq_length=180,
    ),
    Tiny(
        "mpnet",  # all-mpnet-base-v2 style: mean pooling, normalized; texts longer than the 128 max distance
        "MPNetForMaskedLM",
        lambda: T.MPNetConfig(
            **{**ENCODER, "hidden_size": 56}, vocab_size=30522, max_position_embeddings=300, pad_token_id=0
        ),
        tokenizer="wordpiece",
        pooling="mean",
        normalize=True,
        max_seq_length=280,
        # At N(0, 0.08) the bias hides among the scores (dropping it still gave cosine 0.99984).
        weight_scale={"relative_attention_bias": 25.0},
    ),
    Tiny(
        "gemma2",  # causal, soft-capped logits, local layers of 16; no sentence-transformers files
        "Gemma2ForCausalLM",
        lambda: T.Gemma2Config(**GEMMA, rope_theta=30000.0, sliding_window=16, attn_logit_softcapping=3.0),
        tokenizer="bpe",
        norm_mean=0.0,
    ),
    Tiny(
        "embeddinggemma",  # EmbeddingGemma's layout: bidirectional Gemma 3, mean, two Dense, Normalize, prompts
        "Gemma3TextModel",
        lambda: T.Gemma3TextConfig(
            **GEMMA,
            sliding_window=20,  # bidirectional: keys within 10 positions either side
            use_bidirectional_attention=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 200000.0},
            },
        ),
        tokenizer="bpe",
        pooling="mean",
        normalize=True,
        max_seq_length=200,
        prompts=EMBEDDINGGEMMA_PROMPTS,
        dense=((96, False), (40, False)),
        norm_mean=0.0,
    ),
]


@dataclass
class Served:
    tiny: Tiny
    path: Path
    server: ServerProcess
    texts: list[str]
    ours: np.ndarray
    body: dict
    info: dict


class Launcher:
    """Builds and starts the next case's server while the current one is tested: start-up is mostly imports,
    which leave the second core idle. At most two servers run at once."""

    def __init__(self, tmp_path_factory, sources):
        self.tmp, self.sources = tmp_path_factory, sources
        self.started: dict[str, tuple[Path, ServerProcess]] = {}

    def start(self, tiny: Tiny) -> tuple[Path, ServerProcess]:
        if tiny.name not in self.started:
            path = build(tiny, self.tmp.mktemp(tiny.name), self.sources)
            self.started[tiny.name] = (path, ServerProcess("--model", str(path), "--dtype", "float32"))
        return self.started[tiny.name]

    def stop(self, name: str) -> None:
        if name in self.started:
            self.started.pop(name)[1].stop()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, tokenizer_sources):
    launcher = Launcher(tmp_path_factory, tokenizer_sources)
    yield launcher
    for name in list(launcher.started):
        launcher.stop(name)


@pytest.fixture(scope="module", params=CASES, ids=lambda t: t.name)
def served(request, launcher):
    tiny: Tiny = request.param
    path, server = launcher.start(tiny)
    following = CASES.index(tiny) + 1
    if following < len(CASES):
        launcher.start(CASES[following])
    try:
        server.wait_healthy()
        inputs = texts()
        ours, body = embed(server.url, inputs)
        info = httpx.get(server.url + "/info").json()
        yield Served(tiny, path, server, inputs, ours, body, info)
    finally:
        launcher.stop(tiny.name)


def reference(s: Served, inputs: list[str], prompt_name: str | None = None) -> np.ndarray:
    if s.tiny.pooling is not None and not s.tiny.reference_config:
        return st_reference(s.path, inputs, prompt_name=prompt_name)
    from transformers import AutoTokenizer

    max_length = s.tiny.config().max_position_embeddings  # the documented default without other limits
    tok = AutoTokenizer.from_pretrained(str(s.path))
    ids = [tok(t, truncation=True, max_length=max_length).input_ids for t in inputs]
    return hf_reference(s.path, ids, s.tiny.default_pooling, normalize=True, **s.tiny.reference_config)


def test_matches_reference(served):
    ref = reference(served, served.texts)
    assert served.ours.shape == ref.shape
    cos = cosines(served.ours, ref)
    worst = int(cos.argmin())
    print(f"\n{served.tiny.name}: min cosine vs reference over {len(cos)} texts = {cos.min():.8f}")
    assert cos.min() >= 0.99999, f"text {worst} ({served.texts[worst][:60]!r}) has cosine {cos[worst]}"


def test_prompts_match_reference(served):
    """Named prompts from config_sentence_transformers.json, as SentenceTransformer.encode(prompt_name=...)."""
    for name in served.tiny.prompts or {}:
        ours, body = embed(served.server.url, served.texts, prompt_name=name)
        ref = reference(served, served.texts, prompt_name=name)
        cos = cosines(ours, ref)
        print(f"\n{served.tiny.name} prompt {name!r}: min cosine = {cos.min():.8f}")
        assert cos.min() >= 0.99999


def test_dimension_and_norm(served):
    hidden = served.tiny.dense[-1][0] if served.tiny.dense else served.tiny.config().hidden_size
    assert served.ours.shape == (len(served.texts), hidden)
    assert served.info["dimension"] == hidden
    # Not one feature is zero across every text (the symptom of a mis-strided or half-filled vector).
    assert np.abs(served.ours).max(axis=0).min() > 0
    norms = np.linalg.norm(served.ours, axis=1)
    if served.info["normalize"]:
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    else:
        assert np.abs(norms - 1).max() > 1e-2  # raw vectors really are raw


def test_detected(served):
    expected_pooling = {None: served.tiny.default_pooling, "lasttoken": "last"}.get(
        served.tiny.pooling, served.tiny.pooling
    )
    assert served.info["pooling"] == expected_pooling
    assert served.info["normalize"] == (served.tiny.normalize or served.tiny.pooling is None)
    config = json.loads((served.path / "config.json").read_text())
    assert served.info["architecture"] == config["architectures"][0]


def test_batch_invariance(served):
    """A text alone gives the vector it gets inside the mixed batch of all the texts."""
    for i in (0, 23, len(served.texts) - 12, len(served.texts) - 7):
        alone, _ = embed(served.server.url, served.texts[i])
        np.testing.assert_allclose(alone[0], served.ours[i], atol=1e-5, err_msg=f"text {i}")
