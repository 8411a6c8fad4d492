"""The files a model folder must hold, checked in the HTTP process before any worker starts (no torch).

A folder the workers could not load, or would serve wrongly, is refused here with one line naming the
file: config.json without the sizes the model code reads, a missing fast tokenizer (without
tokenizer.json, transformers builds a tokenizer that maps every word to [UNK]), no weights, or weights
whose headers do not parse (a truncated or corrupt download). Reading a safetensors header reads a few
kilobytes, so the check costs nothing at start-up.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from embed_service.models.spec import ModelSpec, positive_int

# The config.json keys every family's model code reads, as positive integers.
REQUIRED_CONFIG = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
)


def weight_files(path: Path) -> list[Path]:
    """The checkpoint files the loader reads: the safetensors files, else pytorch_model*.bin."""
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    return files


def check_weights(path: Path) -> list[Path]:
    """Every weights file exists and its header parses (offsets within the file); the files."""
    files = weight_files(path)
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(file), framework="numpy") as f:
                    f.keys()
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"{file}: corrupt or truncated weights ({exc})") from None
        elif zipfile.is_zipfile(file):  # torch.save's format: the central directory sits at the end
            try:
                with zipfile.ZipFile(file) as z:
                    z.namelist()
            except (zipfile.BadZipFile, OSError) as exc:
                raise ValueError(f"{file}: corrupt or truncated weights ({exc})") from None
        elif file.stat().st_size == 0:
            raise ValueError(f"{file}: empty weights file")
    return files


def check_tokenizer_file(path: Path) -> None:
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"no tokenizer.json in {path} (a fast tokenizer is needed); write one with "
            "transformers.AutoTokenizer.from_pretrained(<source>).save_pretrained(<folder>)"
        )


def check_model_files(spec: ModelSpec) -> None:
    """The config's sizes, the tokenizer and every weights file, the Dense modules' included."""
    for key in REQUIRED_CONFIG:
        positive_int(spec.config, key, spec.path / "config.json")
    check_tokenizer_file(spec.path)
    check_weights(spec.path)
    for dense in spec.dense:
        check_weights(dense.path)
