"""A short query's latency while bulk passages saturate the server, for source trees side by side.

Each tree's server runs at default settings (`python -m embed_service serve`, the tree on PYTHONPATH);
every round measures, for each tree in turn, single short queries one at a time for `--duration` seconds
on an idle server, then the same while bulk requests (32 passages a request, 4 in flight) saturate it, as
`benchmarks/compare.py` does in `make bench`. Reported: medians over rounds of idle and loaded p50/p99,
loaded p99 over idle p99 (the target: at most 5x), the bulk texts/s meanwhile, and the short queries/s
answered meanwhile (one at a time: the sooner each is answered, the more of them there are). Example, this tree
against an older commit checked out with `git worktree add /tmp/old <rev>`:

    python benchmarks/latency_under_bulk.py --tree before=/tmp/old/src --tree after=src \\
        --json benchmarks/results/latency_under_bulk.json

Reads the shared corpora (`$EMBED_SHARED`, default ../shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402

from embed_service import bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    corpus = {
        c: bench.read_texts(compare.SHARED / "bench" / "corpus" / f"{c}.jsonl", args.texts)
        for c in ("queries", "passages")
    }
    load_start = os.getloadavg()
    servers: dict[str, compare.Server] = {}
    trees = dict(t.split("=", 1) for t in args.tree)
    try:
        for name, src in trees.items():
            port = compare.free_port()
            cmd = [sys.executable, "-m", "embed_service", "serve", "--port", str(port)]
            env = {"PYTHONPATH": str(Path(src).resolve())}
            servers[name] = compare.Server(f"latency-{name}", cmd, port, env=env)
        for name, server in servers.items():
            if not server.wait(300):
                raise SystemExit(f"{name} did not start (see {server.log_path})")
        runs: dict[str, dict[str, list]] = {n: {"idle": [], "loaded": [], "bulk": []} for n in servers}
        one = argparse.Namespace(rounds=1, duration=args.duration)
        for _ in range(args.rounds):
            for name, server in servers.items():
                out = compare.latency_runs({"ours": server}, corpus, one)["ours"]
                for kind, values in out.items():
                    runs[name][kind] += values
    finally:
        for server in servers.values():
            server.stop()
    summary = {}
    for name, r in runs.items():

        def med(kind: str, field: str, r: dict = r) -> float:
            return statistics.median(x["latency_ms"][field] for x in r[kind])

        idle99, loaded99 = med("idle", "p99"), med("loaded", "p99")
        summary[name] = {
            "idle_p50_ms": round(med("idle", "p50"), 2),
            "idle_p99_ms": round(idle99, 2),
            "loaded_p50_ms": round(med("loaded", "p50"), 2),
            "loaded_p99_ms": round(loaded99, 2),
            "loaded_over_idle_p99": round(loaded99 / idle99, 2),
            "bulk_texts_per_s": round(statistics.median(x["texts_per_s"] for x in r["bulk"]), 1),
            # the probe is closed-loop: a faster answer is a sooner next query, so this moves with latency
            "loaded_queries_per_s": round(statistics.median(x["requests_per_s"] for x in r["loaded"]), 1),
        }
        print(name, summary[name])
    if args.json:
        result = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": compare.cpu_info(),
            "host": platform.node(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "rounds": args.rounds,
            "duration_s": args.duration,
            "trees": trees,
            "summary": summary,
            "runs": runs,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
