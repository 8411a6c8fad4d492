"""The CPU attention kernel's bf16 paths side by side: one layer's attention, and the whole forward.

In one process with 1 thread (a worker's default on 2 cores), on the served model's shapes (its heads and
head size) and ~4,096-token batches of real texts from each corpus (`queries.jsonl`, `passages.jsonl`),
every path the kernel can take on this CPU, chosen per call by environment (ops/csrc/varlen_attention.c
reads it on every call): `amx` (tiles, where the CPU has them), `avx512-bf16` (vdpbf16ps, where it has
AVX512-BF16; AMX off) and `float32` (FMAs; both off). For each: one layer's attention in ms and its GFLOP/s
(4 L^2 D per head), and the bf16 model's whole forward in tokens/s. Rounds interleave the paths; medians of
rounds, and the median of the rounds' ratios to the float32 path.

    python benchmarks/attention_paths.py [--rounds 5] [--json benchmarks/results/attention_paths.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_file import ResultFile  # noqa: E402
from embed_service.models.loader import EmbeddingModel  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops import fused  # noqa: E402
from embed_service.ops.batch import FlatBatch  # noqa: E402
from embed_service.ops.cpu_kernels import attention_kernel, cpu_flags  # noqa: E402
from embed_service.outputs import DENSE_ONLY  # noqa: E402
from embed_service.server import default_model_path  # noqa: E402

SHARED = Path(os.environ.get("EMBED_SHARED", Path(__file__).resolve().parents[2] / "shared"))
PATHS = {
    "amx": {"EMBED_CPU_AMX": "1", "EMBED_CPU_BF16_DOT": "0"},
    "avx512-bf16": {"EMBED_CPU_AMX": "0", "EMBED_CPU_BF16_DOT": "1"},
    "float32": {"EMBED_CPU_AMX": "0", "EMBED_CPU_BF16_DOT": "0"},
}


def batch_of(tokenizer, corpus: Path, budget: int, max_length: int) -> list[list[int]]:
    texts = [json.loads(line)["text"] for line in corpus.open()][:2000]
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    chosen, total = [], 0
    for seq in ids:
        if total + len(seq) > budget:
            break
        chosen.append(seq)
        total += len(seq)
    return chosen


def best_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    torch.set_num_threads(1)
    kernel = attention_kernel()
    if kernel is None:
        raise SystemExit("the compiled CPU attention kernel is unavailable here")
    from transformers import AutoTokenizer

    spec = load_spec(default_model_path())
    fused.configure("cpu")
    model = EmbeddingModel(spec, torch.bfloat16, torch.device("cpu")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(spec.path))
    heads = int(spec.config["num_attention_heads"])
    head_size = int(spec.config["hidden_size"]) // heads
    layers = int(spec.config["num_hidden_layers"])
    paths = []
    for name, env in PATHS.items():
        os.environ.update(env)
        if kernel.path(torch.bfloat16, head_size) == name:
            paths.append(name)
    print(f"paths on this CPU at head size {head_size}: {', '.join(paths)}")

    rounds: dict[str, dict[str, list[float]]] = {}
    shapes = {}
    with torch.inference_mode():
        for corpus in ("queries", "passages"):
            seqs = batch_of(tokenizer, SHARED / "bench" / "corpus" / f"{corpus}.jsonl", args.tokens, 256)
            lengths = [len(s) for s in seqs]
            total = sum(lengths)
            flat = torch.tensor([t for s in seqs for t in s])
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            qkv = torch.randn(total, 3 * heads * head_size).bfloat16()
            q, k, v = qkv.view(total, 3 * heads, head_size).split(heads, dim=1)
            flops = sum(4 * n * n * head_size * heads for n in lengths)
            shapes[corpus] = {
                "sequences": len(seqs),
                "tokens": total,
                "mean_length": round(total / len(seqs), 1),
            }

            def attend(q=q, k=k, v=v, cu=cu, longest=max(lengths)):
                kernel(q, k, v, cu, longest, False, head_size**-0.5, None)

            def forward(flat=flat, lengths=lengths):
                model(FlatBatch.from_lengths(flat, lengths, [0] * len(lengths)), [DENSE_ONLY] * len(lengths))

            for _ in range(args.rounds):
                for name in paths:
                    os.environ.update(PATHS[name])
                    ms = best_ms(attend, 5)
                    tokens_per_s = total / (best_ms(forward, 3) / 1e3)
                    figures = rounds.setdefault(f"{corpus}/{name}", {})
                    figures.setdefault("attention_ms", []).append(ms)
                    figures.setdefault("attention_gflops", []).append(flops / ms / 1e6)
                    figures.setdefault("forward_tokens_per_s", []).append(tokens_per_s)

    results = {}
    for corpus in ("queries", "passages"):
        base = rounds[f"{corpus}/float32"]
        for name in paths:
            r = rounds[f"{corpus}/{name}"]
            entry = {key: round(statistics.median(values), 2) for key, values in r.items()}
            entry["attention_speedup"] = round(
                statistics.median(b / a for a, b in zip(r["attention_ms"], base["attention_ms"])), 3
            )
            entry["forward_speedup"] = round(
                statistics.median(
                    a / b for a, b in zip(r["forward_tokens_per_s"], base["forward_tokens_per_s"])
                ),
                3,
            )
            results[f"{corpus}/{name}"] = entry
            print(
                f"{corpus:9} {name:12} attention {entry['attention_ms']:7.2f} ms/layer "
                f"({entry['attention_gflops']:5.0f} GFLOP/s, {entry['attention_speedup']:.2f}x float32), "
                f"forward {entry['forward_tokens_per_s']:7.0f} tokens/s ({entry['forward_speedup']:.3f}x)"
            )
    if args.json:
        record.write(
            args.json,
            {
                "threads": 1,
                "layers": layers,
                "heads": heads,
                "head_size": head_size,
                "cpu_flags": sorted(f for f in cpu_flags() if "bf16" in f or "amx" in f or "vnni" in f),
                "batches": shapes,
                "rounds": args.rounds,
                "results": results,
                "per_round": rounds,
            },
        )


if __name__ == "__main__":
    main()
