"""--quantization int8 against bfloat16 and float32, in one process: fidelity on both corpora and forward speed.

For the served model (default: the packaged all-MiniLM-L6-v2) on `--texts` texts of each shared corpus:

- min and mean cosine to the float32 model of the bfloat16 model, of the int8 one as served (layers/quantize.py:
  attention output and MLP in int8, activations bfloat16) and with query/key/value in int8 too, each corpus
  in batches of up to `--batch-tokens`;
- which layers cost fidelity: every kind of layer in int8 but one (leave one out), and one kind alone;
- forward throughput (texts/s) of bfloat16 and int8 on the same batches, `--rounds` interleaved rounds with
  `--threads` threads, medians; the ratio per round.

    python benchmarks/int8.py [--model PATH] [--json benchmarks/results/int8.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import SHARED  # noqa: E402
from benchmarks.result_file import ResultFile  # noqa: E402
from embed_service.layers.linear import mark_int8  # noqa: E402
from embed_service.models.loader import EmbeddingModel  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops import fused  # noqa: E402
from embed_service.ops.batch import FlatBatch  # noqa: E402
from embed_service.outputs import DENSE_ONLY  # noqa: E402
from embed_service.server import default_model_path  # noqa: E402

CORPORA = ("queries", "passages")


def read(corpus: str, n: int) -> list[str]:
    import json

    lines = (SHARED / "bench" / "corpus" / f"{corpus}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines[:n]]


def batches(ids: list[list[int]], budget: int) -> list[list[list[int]]]:
    out: list[list[list[int]]] = [[]]
    for seq in ids:
        if out[-1] and sum(map(len, out[-1])) + len(seq) > budget:
            out.append([])
        out[-1].append(seq)
    return out


def forward(model: EmbeddingModel, groups: list[list[list[int]]]) -> np.ndarray:
    vectors = []
    with torch.inference_mode():
        for group in groups:
            flat = torch.tensor([t for seq in group for t in seq])
            batch = FlatBatch.from_lengths(flat, [len(s) for s in group])
            vectors += [o.dense for o in model(batch, [DENSE_ONLY] * len(group))]
    return np.stack(vectors).astype(np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def kind(name: str) -> str:
    """A linear module's name without its layer index: encoder.layer.3.attention.qkv -> ...layer.N...."""
    return re.sub(r"\.\d+\.", ".N.", name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    record = ResultFile()
    torch.set_num_threads(args.threads)
    fused.configure("cpu")
    path = args.model or str(default_model_path())
    spec = load_spec(path, args.max_length)
    tok = AutoTokenizer.from_pretrained(str(spec.path))
    cpu = torch.device("cpu")
    reference = EmbeddingModel(spec, torch.float32, cpu).eval()
    bf16 = EmbeddingModel(spec, torch.bfloat16, cpu).eval()
    int8 = EmbeddingModel(spec, torch.bfloat16, cpu).eval()
    print(f"int8 layers: {mark_int8(int8)}", flush=True)
    every = EmbeddingModel(spec, torch.bfloat16, cpu).eval()  # the query/key/value projections in int8 too
    mark_int8(every, keep=lambda name, module: False)
    kinds = sorted(
        {kind(n) for n, m in every.named_modules() if getattr(getattr(m, "weight", None), "int8", False)}
    )
    figures: dict = {
        "model": str(spec.path.name),
        "threads": args.threads,
        "texts": args.texts,
        "corpora": {},
    }
    for corpus in CORPORA:
        texts = read(corpus, args.texts)
        ids = tok(texts, truncation=True, max_length=spec.max_input_length)["input_ids"]
        groups = batches(ids, args.batch_tokens)
        ref = forward(reference, groups)
        fid: dict = {}
        for label, model in (("bfloat16", bf16), ("int8", int8), ("int8 with query/key/value", every)):
            cos = cosines(forward(model, groups), ref)
            fid[label] = {"min": round(float(cos.min()), 6), "mean": round(float(cos.mean()), 6)}
        layers: dict = {}
        for k in kinds:
            for mode in ("all but this", "this alone"):
                model = EmbeddingModel(spec, torch.bfloat16, cpu).eval()
                if mode == "all but this":
                    mark_int8(model, keep=lambda n, m, k=k: kind(n) == k)
                else:
                    mark_int8(model, keep=lambda n, m, k=k: kind(n) != k)
                cos = cosines(forward(model, groups), ref)
                layers.setdefault(k, {})[mode] = round(float(cos.min()), 6)
        speed: dict = {"bfloat16": [], "int8": []}
        for _ in range(args.rounds):
            for label, model in (("bfloat16", bf16), ("int8", int8)):
                forward(model, groups[:1])  # warm
                t0 = time.perf_counter()
                forward(model, groups)
                speed[label].append(len(texts) / (time.perf_counter() - t0))
        ratios = [i / b for i, b in zip(speed["int8"], speed["bfloat16"])]
        figures["corpora"][corpus] = {
            "mean_tokens": round(float(np.mean([len(s) for s in ids])), 1),
            "batches": len(groups),
            "min_cosine_vs_float32": fid,
            "min_cosine_int8_by_layer": layers,
            "texts_per_s": {k: [round(v, 1) for v in vs] for k, vs in speed.items()},
            "texts_per_s_median": {k: round(statistics.median(vs), 1) for k, vs in speed.items()},
            "int8_over_bfloat16": {
                "rounds": [round(r, 3) for r in ratios],
                "median": round(statistics.median(ratios), 3),
            },
        }
        print(corpus, figures["corpora"][corpus], flush=True)
    if args.json:
        record.write(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
