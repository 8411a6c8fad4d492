"""What a model folder is detected as: family, pooling, normalization, attention, prompts. JSON only, no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embed_service.models.registry import ARCHITECTURES, UnsupportedModelError
from embed_service.models.spec import load_spec

BASE = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512, "vocab_size": 100}


def folder(tmp_path: Path, config: dict, files: dict[str, object] | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **config}))
    for name, content in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def st_files(pooling: dict, normalize: bool = True, **extra: object) -> dict[str, object]:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    return {"modules.json": modules, "1_Pooling/config.json": pooling, **extra}


@pytest.mark.parametrize(
    "architecture, pooling, normalize",
    [
        ("BertModel", "cls", False),
        ("RobertaForMaskedLM", "cls", False),
        ("XLMRobertaModel", "cls", False),
        ("ModernBertForMaskedLM", "cls", False),
        ("LlamaForCausalLM", "last", True),
        ("MistralModel", "last", True),
        ("Qwen2ForCausalLM", "last", True),
        ("Qwen3Model", "last", True),
    ],
)
def test_defaults_without_sentence_transformers_files(tmp_path, architecture, pooling, normalize):
    spec = load_spec(folder(tmp_path, {"architectures": [architecture]}))
    assert (spec.architecture, spec.pooling, spec.normalize) == (architecture, pooling, normalize)
    assert spec.causal == (pooling == "last")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    with pytest.raises(UnsupportedModelError) as exc:
        load_spec(folder(tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    message = str(exc.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in ARCHITECTURES)


def test_model_type_decides_without_architectures(tmp_path):
    spec = load_spec(folder(tmp_path, {"model_type": "qwen3"}))
    assert (spec.architecture, spec.pooling, spec.normalize) == ("qwen3", "last", True)


@pytest.mark.parametrize(
    "flags, causal",
    [({}, True), ({"is_causal": False}, False), ({"use_bidirectional_attention": True}, False)],
)
def test_bidirectional_decoders(tmp_path, flags, causal):
    assert load_spec(folder(tmp_path, {"architectures": ["Qwen2ForCausalLM"], **flags})).causal is causal


def test_roberta_positions_start_after_padding(tmp_path):
    spec = load_spec(folder(tmp_path, {"architectures": ["XLMRobertaModel"], "pad_token_id": 3}))
    assert spec.position_offset == 4
    assert spec.position_limit == spec.max_input_length == 512 - 4


@pytest.mark.parametrize(
    "pooling_config, expected",
    [
        ({"pooling_mode": "lasttoken", "include_prompt": True}, "last"),
        ({"pooling_mode": "mean"}, "mean"),
        ({"pooling_mode": ["cls"]}, "cls"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"word_embedding_dimension": 64}, "mean"),  # no mode set: sentence-transformers' default
        ({"pooling_mode": "lasttoken", "include_prompt": False}, "last"),
    ],
)
def test_sentence_transformers_pooling_overrides_the_default(tmp_path, pooling_config, expected):
    spec = load_spec(folder(tmp_path, {"architectures": ["BertModel"]}, st_files(pooling_config)))
    assert spec.pooling == expected and spec.normalize


def test_without_normalize_module_vectors_stay_raw(tmp_path):
    files = st_files({"pooling_mode": "lasttoken"}, normalize=False)
    spec = load_spec(folder(tmp_path, {"architectures": ["Qwen2ForCausalLM"]}, files))
    assert (spec.pooling, spec.normalize) == ("last", False)


@pytest.mark.parametrize(
    "pooling_config, match",
    [
        ({"pooling_mode": ["cls", "mean"]}, "exactly one"),
        ({"pooling_mode": "weightedmean"}, "exactly one"),
        ({"pooling_mode_weightedmean_tokens": True}, "exactly one"),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt"),
    ],
)
def test_unsupported_pooling_fails_at_start_up(tmp_path, pooling_config, match):
    with pytest.raises(ValueError, match=match):
        load_spec(folder(tmp_path, {"architectures": ["BertModel"]}, st_files(pooling_config)))


def test_prompts(tmp_path):
    prompts = {"query": "Instruct: find\nQuery: ", "document": ""}
    files = {"config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": "query"}}
    spec = load_spec(folder(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}, files))
    assert spec.prompts == prompts and spec.default_prompt_name == "query"


def test_default_prompt_must_exist(tmp_path):
    files = {"config_sentence_transformers.json": {"prompts": {"query": "q: "}, "default_prompt_name": "doc"}}
    with pytest.raises(ValueError, match="default_prompt_name"):
        load_spec(folder(tmp_path, {"architectures": ["BertModel"]}, files))


def dense_module(config: dict) -> dict[str, object]:
    files = st_files({"pooling_mode": "mean"}, normalize=False)
    files["modules.json"] = [  # type: ignore[operator]
        *files["modules.json"],  # type: ignore[misc]
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    return {**files, "2_Dense/config.json": config}


@pytest.mark.parametrize(
    "dense, match",
    [
        ({"in_features": 64}, "out_features is missing"),
        ({"out_features": 32}, "in_features is missing"),
        ({"in_features": 64, "out_features": "32"}, "out_features is '32', not a positive integer"),
        ({"in_features": 64, "out_features": 32, "bias": "yes"}, "bias is 'yes'"),
        ({"in_features": 100, "out_features": 32}, "in_features is 100, but its input has 64 features"),
    ],
)
def test_a_broken_dense_config_names_its_file_and_key(tmp_path, dense, match):
    with pytest.raises(ValueError, match=match) as exc:
        load_spec(folder(tmp_path, {"architectures": ["BertModel"]}, dense_module(dense)))
    assert "2_Dense" in str(exc.value)


def test_a_good_dense_config(tmp_path):
    spec = load_spec(
        folder(
            tmp_path, {"architectures": ["BertModel"]}, dense_module({"in_features": 64, "out_features": 32})
        )
    )
    assert spec.dimension == 32 and spec.dense[0].activation == "tanh"


@pytest.mark.parametrize("pad", [None, "1", -1, True])
def test_roberta_positions_need_a_pad_token_id(tmp_path, pad):
    with pytest.raises(ValueError, match="pad_token_id"):
        load_spec(folder(tmp_path, {"architectures": ["RobertaModel"], "pad_token_id": pad}))


def test_token_ids_are_bounded_by_the_embedding_table(tmp_path, default_model_path):
    """The bound is the table's rows (vocab_size), never the tokenizer's size when that is larger."""
    from embed_service.engine.tokenizer import InvalidTokenError, Tokenizer

    def tokenizer(vocab_size: int) -> Tokenizer:
        path = tmp_path / str(vocab_size)
        path.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            (path / name).write_bytes((default_model_path / name).read_bytes())
        return Tokenizer(load_spec(folder(path, {"architectures": ["BertModel"], "vocab_size": vocab_size})))

    padded = tokenizer(30600)  # a table with spare rows past the tokenizer's 30,522 ids
    padded.check_ids([[101, 30599, 102]])
    with pytest.raises(InvalidTokenError, match="0..30599"):
        padded.check_ids([[101, 30600, 102]])
    with pytest.raises(ValueError, match="30522 tokens but the embedding table only 30000 rows"):
        tokenizer(30000)
