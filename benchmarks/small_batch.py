"""What one short sequence's forward costs on this CPU, and whether reading the weights bounds it.

In one process with 1 thread (a worker's default on 2 cores), for the served model's linear layers (every
layer's QKV, attention output and MLP shapes, each with weights of its own, as the model holds them):

- the bfloat16 matmuls through the layers' own entry point (`layers.linear.dense`: oneDNN with packed
  weights where the CPU multiplies bf16) and float32 `F.linear`, at 1, 14, 64 and 2,048 rows: milliseconds
  for all of them, the weights' bytes read per second, TFLOP/s;
- a plain read of a tensor as large as the bf16 weights (`Tensor.sum`): what one thread can stream;
- the whole bfloat16 forward of one 14-token sequence, back to back and after 20 ms asleep (as a server
  idle between requests runs it).

Medians of `--calls` calls per figure, over `--rounds` rounds interleaved, medians of rounds.

    python benchmarks/small_batch.py [--model PATH] [--json benchmarks/results/small_batch.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_file import ResultFile  # noqa: E402
from embed_service.layers import linear
from embed_service.layers.linear import dense  # noqa: E402
from embed_service.models.loader import EmbeddingModel  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops import fused  # noqa: E402
from embed_service.ops.batch import FlatBatch  # noqa: E402
from embed_service.outputs import DENSE_ONLY  # noqa: E402
from embed_service.server import default_model_path  # noqa: E402

ROWS = (1, 14, 64, 2048)


def median_ms(fn, calls: int, clock=time.perf_counter) -> float:
    """The median of `calls` timed calls after 3 untimed ones, in ms; `clock`: wall (default) or thread time."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of the encoder, in order."""
    h, i = int(config["hidden_size"]), int(config["intermediate_size"])
    return [(3 * h, h), (h, h), (i, h), (h, i)] * int(config["num_hidden_layers"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a model folder (default: the packaged default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    torch.set_num_threads(1)
    path = args.model or str(default_model_path())
    spec = load_spec(path)
    fused.configure("cpu")
    shapes = layer_shapes(spec.config)
    bf16 = [(torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()) for n, k in shapes]
    fp32 = [(w.float(), b.float()) for w, b in bf16]
    weight_bytes = {"bf16": sum(w.nbytes for w, _ in bf16), "fp32": sum(w.nbytes for w, _ in fp32)}
    weight_bytes["onednn"] = weight_bytes["bf16"]
    flops_per_row = sum(2 * n * k for n, k in shapes)
    inputs = {m: {k: torch.randn(m, k) for k in {k for _, k in shapes}} for m in ROWS}
    stream = torch.ones(weight_bytes["bf16"] // 4)

    model = EmbeddingModel(spec, torch.bfloat16, torch.device("cpu")).eval()
    ids = torch.randint(1000, 20000, (14,))

    served_rows = linear.SMALL_ROWS

    def choose(onednn_only: bool) -> None:
        linear.SMALL_ROWS = 0 if onednn_only else served_rows

    def forward() -> None:
        with torch.inference_mode():
            model(FlatBatch.from_lengths(ids, [14], [0]), [DENSE_ONLY])

    def forward_after_sleep() -> None:
        time.sleep(0.02)
        forward()

    def matmuls(weights, m: int, dtype: torch.dtype):
        xs = {k: x.to(dtype) for k, x in inputs[m].items()}
        if dtype == torch.bfloat16:
            return lambda: [dense(xs[w.shape[1]], w, b) for w, b in weights]
        return lambda: [F.linear(xs[w.shape[1]], w, b) for w, b in weights]

    rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        with torch.inference_mode():
            rounds.setdefault("stream_ms", []).append(median_ms(stream.sum, args.calls))
            for m in ROWS:
                calls = args.calls if m < 1000 else max(5, args.calls // 6)
                for name, onednn_only in (("bf16", False), ("onednn", True)):
                    choose(onednn_only)
                    rounds.setdefault(f"{name}_{m}_ms", []).append(
                        median_ms(matmuls(bf16, m, torch.bfloat16), calls)
                    )
                choose(False)
                rounds.setdefault(f"fp32_{m}_ms", []).append(
                    median_ms(matmuls(fp32, m, torch.float32), calls)
                )
        for name, onednn_only in (("", False), ("onednn_", True)):
            choose(onednn_only)
            rounds.setdefault(f"{name}forward_ms", []).append(median_ms(forward, args.calls))
            # timed with its sleep; the sleep is taken out
            rounds.setdefault(f"{name}forward_after_sleep_ms", []).append(
                median_ms(forward_after_sleep, args.calls) - 20.0
            )
        choose(False)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    gbs = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    figures = {
        "model": Path(path).name,
        "threads": 1,
        "linear_layers": len(shapes),
        "weight_bytes": weight_bytes,
        "stream": {"ms": med["stream_ms"], "GB_per_s": gbs(weight_bytes["bf16"], med["stream_ms"])},
        "matmuls": {
            str(m): {
                dt: {
                    "ms": med[f"{dt}_{m}_ms"],
                    "weights_GB_per_s": gbs(weight_bytes[dt], med[f"{dt}_{m}_ms"]),
                    "TFLOP_per_s": flops_per_row * m / med[f"{dt}_{m}_ms"] / 1e9,
                }
                for dt in ("bf16", "onednn", "fp32")
            }
            for m in ROWS
        },
        "small_kernel": linear.small_rows() > 0,
        "small_kernel_rows": linear.small_rows(),
        "forward_14_tokens_ms": {
            "back_to_back": med["forward_ms"],
            "after_20ms_asleep": med["forward_after_sleep_ms"],
            "onednn_back_to_back": med["onednn_forward_ms"],
            "onednn_after_20ms_asleep": med["onednn_forward_after_sleep_ms"],
        },
        "rounds": rounds,
    }
    print(f"{len(shapes)} linear layers, bf16 weights {weight_bytes['bf16'] / 1e6:.1f} MB, 1 thread")
    rows = figures["small_kernel_rows"]
    print(
        "the project's linear for short sequences: "
        + (f"up to {rows} rows" if rows else "no (oneDNN at every row count)")
    )
    print(f"stream a tensor of that size: {figures['stream']['GB_per_s']:.1f} GB/s")
    for m in ROWS:
        row = figures["matmuls"][str(m)]
        cells = [
            f"{label} {row[dt]['ms']:7.2f} ms ({row[dt]['weights_GB_per_s']:5.1f} GB/s, {row[dt]['TFLOP_per_s']:.2f} TFLOP/s)"
            for label, dt in (("served bf16", "bf16"), ("oneDNN", "onednn"), ("fp32", "fp32"))
        ]
        print(f"{m:5d} rows: " + "   ".join(cells))
    f = figures["forward_14_tokens_ms"]
    print(
        f"bf16 forward, 14 tokens: served {f['back_to_back']:.2f} ms back to back, {f['after_20ms_asleep']:.2f} ms "
        f"after 20 ms asleep; oneDNN alone {f['onednn_back_to_back']:.2f} / {f['onednn_after_20ms_asleep']:.2f} ms"
    )
    if args.json:
        record.write(args.json, figures)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
