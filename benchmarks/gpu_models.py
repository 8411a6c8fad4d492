"""The models gpu_check measures (benchmarks/gpu_check.py): configs shaped as real ones, random weights
written here, the tokenizers carried with them, corpora cut to a token count, and the FLOPs per token."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

# Dense bfloat16 peak FLOP/s by device name (SXM parts), for the utilization figure.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}

ENCODER = {  # BAAI/bge-base-en-v1.5's shape
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "vocab_size": 30522,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
}
DECODER = {  # Qwen/Qwen2-7B's shape
    "architectures": ["Qwen2Model"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
TOY = {
    "encoder": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    },
    "decoder": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 8192,  # the byte-level BPE written by gpu_prepare.write_tokenizers
        "max_position_embeddings": 2048,
    },
}


# --- models: configs and random weights ------------------------------------------------------------------


TOKENIZERS: Path | None = None  # set by gpu_check.main: the carried tokenizers, or ones written for the run


def tokenizer_dir(kind: str = "encoder") -> Path:
    """The tokenizer of each model kind (gpu_prepare.write_tokenizers): the default model's WordPiece for the
    encoder, a byte-level BPE for the decoder."""
    assert TOKENIZERS is not None, "main sets the tokenizers' folder"
    return TOKENIZERS / kind


def write_model(path: Path, kind: str, config: dict[str, Any], device: str, dtype: torch.dtype) -> Path:
    """config.json, random weights in one safetensors file (std 0.02; norms 1, biases 0) and a tokenizer
    whose ids fit the vocabulary (tokenizer_dir)."""
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        shapes = {
            k: v.shape for k, v in getattr(transformers, config["architectures"][0])(cfg).state_dict().items()
        }
    g = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            t = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 1:
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()
        state[name] = t.contiguous()
    save_file(state, str(path / "model.safetensors"))
    source = tokenizer_dir(kind)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path


def flops_per_token(config: dict[str, Any], length: int) -> float:
    """Forward FLOPs per token: 2 x the layers' weights (embeddings are a lookup), plus attention's two
    matmuls over `length` keys (halved when causal)."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    d = config.get("head_dim", h // heads)
    inter = config["intermediate_size"]
    gated = config["model_type"] != "bert"
    weights = h * heads * d + 2 * h * kv * d + heads * d * h + (3 if gated else 2) * h * inter
    attention = 2 * 2 * heads * d * length * (0.5 if gated else 1.0)
    return n * (2 * weights + attention)


def corpus(path: Path, model_dir: Path, tokens: int, n: int) -> Path:
    """`n` texts of about `tokens` tokens each by the model's own tokenizer (specials included): English
    words of the WordPiece vocabulary, added until the count is reached."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    words = [w for w in (tokenizer_dir() / "vocab.txt").read_text().split("\n") if w.isalpha() and len(w) > 2]
    rng = random.Random(tokens)
    with path.open("w") as f:
        for _ in range(n):
            text = [rng.choice(words) for _ in range(max(1, tokens - 2))]
            while len(text) > 1 and len(tok.encode(" ".join(text)).ids) > tokens:  # a word can be several
                del text[-max(1, (len(tok.encode(" ".join(text)).ids) - tokens) // 3) :]
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return path


def load_embedder(model_dir: Path, device: str, max_len: int):
    """(EmbeddingModel, spec, dtype) as a worker builds it: the kernels and dtype it would choose."""
    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.ops import fused
    from embed_service.workers.device import DTYPES, cuda_dtype_for, resolve_dtype

    fused.configure(device)
    dtype = resolve_dtype("auto", device)
    if dtype == "auto":
        dtype = cuda_dtype_for(torch.cuda.get_device_capability())
    spec = load_spec(model_dir, max_len)
    return EmbeddingModel(spec, DTYPES[dtype], torch.device(device)).eval(), spec, DTYPES[dtype]
