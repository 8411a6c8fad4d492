"""Why a text costs more online than in bulk: the batches each load forms, and a forward's cost per text there.

1. A server (default model and settings) under online load (1 query per request, 32 in flight) and bulk load
   (32 per request, 4 in flight), `--duration` seconds each: the batches it formed (mean texts and tokens per
   batch, from its /metrics: `embed_batch_size`, `embed_batch_tokens`), and its throughput.
2. In one process with one thread (a worker's on 2 cores): the bf16 forward of the corpus's first N texts,
   N = 1 .. 128, thread CPU time per text; and the model's linear layers alone (`layers.linear.dense`, the
   served path, weights of their own) at the same token counts, their time and GFLOP/s. Medians of calls,
   rounds interleaved, medians of rounds.

    python benchmarks/online_batches.py --corpus ../shared/bench/corpus/queries.jsonl \\
        --json benchmarks/results/online_batches.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_paths import batch_of  # noqa: E402
from benchmarks.http_cpu import load, served  # noqa: E402
from benchmarks.result_file import ResultFile  # noqa: E402
from benchmarks.small_batch import layer_shapes, median_ms  # noqa: E402
from embed_service.layers.linear import dense  # noqa: E402
from embed_service.models.loader import EmbeddingModel  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops import fused  # noqa: E402
from embed_service.ops.batch import FlatBatch  # noqa: E402
from embed_service.outputs import DENSE_ONLY  # noqa: E402
from embed_service.server import default_model_path  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"  # this tree's server, whatever the working folder
SIZES = (1, 2, 4, 8, 10, 16, 32, 64, 128)
LOADS = {"online (1/request, c=32)": (1, 32), "bulk (32/request, c=4)": (32, 4)}


def batch_sums(url: str) -> dict[str, float]:
    """The server's running sums and counts of texts and tokens per batch."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("embed_batch_size_sum", "embed_batch_size_count", "embed_batch_tokens_sum"):
            if line.startswith(name + "{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def served_batches(corpus: str, duration: float, port: int) -> dict[str, dict[str, float]]:
    figures = {}
    with served(str(SRC), port, [], null_model=False) as target:
        for name, (per_request, concurrency) in LOADS.items():
            load(target, corpus, per_request, concurrency, 2.0)  # warm
            before = batch_sums(target.url)
            run = load(target, corpus, per_request, concurrency, duration)
            after = batch_sums(target.url)
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            batches = max(1.0, d["embed_batch_size_count"])
            figures[name] = {
                "texts_per_s": run.texts_per_s,
                "batches": int(batches),
                "texts_per_batch": round(d["embed_batch_size_sum"] / batches, 1),
                "tokens_per_batch": round(d["embed_batch_tokens_sum"] / batches, 1),
            }
    return figures


def in_process(corpus: str, rounds: int) -> dict[str, dict[str, float]]:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    spec = load_spec(default_model_path())
    fused.configure("cpu")
    model = EmbeddingModel(spec, torch.bfloat16, torch.device("cpu")).eval()
    seqs = batch_of(AutoTokenizer.from_pretrained(str(spec.path)), Path(corpus), 10**6, 256)
    shapes = layer_shapes(spec.config)
    weights = [(torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()) for n, k in shapes]
    flops_per_row = sum(2 * n * k for n, k in shapes)
    times: dict[int, dict[str, list[float]]] = {n: {"forward": [], "linear": []} for n in SIZES}
    with torch.inference_mode():
        for _ in range(rounds):
            for n in SIZES:
                lengths = [len(s) for s in seqs[:n]]
                flat = torch.tensor([t for s in seqs[:n] for t in s])
                rows = {k: torch.randn(len(flat), k).bfloat16() for _, k in shapes}

                def forward(flat=flat, lengths=lengths):
                    model(
                        FlatBatch.from_lengths(flat, lengths, [0] * len(lengths)), [DENSE_ONLY] * len(lengths)
                    )

                def linears(rows=rows):
                    for w, b in weights:
                        dense(rows[w.shape[1]], w, b)

                calls = max(5, 96 // n)
                times[n]["forward"].append(median_ms(forward, calls, time.thread_time))
                times[n]["linear"].append(median_ms(linears, calls))
    figures = {}
    for n in SIZES:
        tokens = sum(len(s) for s in seqs[:n])
        fwd, lin = (statistics.median(times[n][k]) for k in ("forward", "linear"))
        figures[str(n)] = {
            "tokens": tokens,
            "forward_ms": round(fwd, 3),
            "forward_us_per_text": round(fwd / n * 1e3, 1),
            "linear_ms": round(lin, 3),
            "linear_share_of_forward": round(lin / fwd, 3),
            "linear_GFLOP_per_s": round(flops_per_row * tokens / lin / 1e6, 1),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8127)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    server = served_batches(args.corpus, args.duration, args.port)
    for name, f in server.items():
        print(
            f"{name}: {f['texts_per_s']:.1f} texts/s, {f['batches']} batches, "
            f"{f['texts_per_batch']} texts / {f['tokens_per_batch']} tokens per batch"
        )
    forward = in_process(args.corpus, args.rounds)
    print("one thread, bf16: texts  tokens  forward us/text  linear layers' share  their GFLOP/s")
    for n, f in forward.items():
        print(
            f"{n:>5} {f['tokens']:>7} {f['forward_us_per_text']:>10.0f} "
            f"{f['linear_share_of_forward']:>14.0%} {f['linear_GFLOP_per_s']:>12.0f}"
        )
    if args.json:
        record.write(args.json, {"corpus": args.corpus, "served": server, "one_thread": forward})


if __name__ == "__main__":
    main()
