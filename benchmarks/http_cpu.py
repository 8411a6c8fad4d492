"""CPU seconds the HTTP process spends per request, for two source trees side by side.

Starts `python -m embed_service serve` from each tree in turn (rounds interleaved), drives it with
`embed-service bench` (one query per request by default), and divides the server process's own CPU time
(its workers excluded) by the requests answered. CPU per request is steadier than throughput on a shared
machine. Example, this tree against an older commit checked out with `git worktree add /tmp/old <rev>`:

    python benchmarks/http_cpu.py --tree old=/tmp/old/src --tree new=src \
        --corpus ../shared/bench/corpus/queries.jsonl

`--null-model` runs the workers without a model (workers/null_model.py): the HTTP process is then what
limits the server, its figure depends less on how fast the workers are (which moves with whatever else the
machine runs), and the texts/s printed is the front end's ceiling.
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

import httpx
import psutil


def measure(src: str, args: argparse.Namespace, extra: list[str]) -> tuple[float, float, float]:
    """(microseconds of server CPU per request, texts/s, cores the server process kept busy) for one run
    of one tree."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    if args.null_model:
        env["EMBED_NULL_MODEL"] = "1"
    with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "embed_service", "serve", "--port", str(args.port), *extra],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{args.port}"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            else:
                raise SystemExit(f"{src}: the server did not become healthy")
            proc = psutil.Process(server.pid)
            before = proc.cpu_times()
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "embed_service",
                        "bench",
                        "--url",
                        url,
                        "--corpus",
                        args.corpus,
                        "--inputs-per-request",
                        str(args.inputs_per_request),
                        "--concurrency",
                        str(args.concurrency),
                        "--duration",
                        str(args.duration),
                        "--no-ceiling",
                        "--json",
                        out.name,
                    ],
                    check=False,
                    capture_output=True,
                )
                report = json.loads(Path(out.name).read_text())
            after = proc.cpu_times()
        finally:
            server.terminate()
            server.wait(60)
    cpu = (after.user + after.system) - (before.user + before.system)
    return cpu / max(1, report["requests"]) * 1e6, report["texts_per_s"], cpu / report["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR[:extra server flags]")
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--inputs-per-request", type=int, default=1)
    parser.add_argument("--port", type=int, default=8126)
    parser.add_argument(
        "--null-model", action="store_true", help="workers without a model (EMBED_NULL_MODEL)"
    )
    args = parser.parse_args()
    trees = []
    for spec in args.tree:
        name, _, rest = spec.partition("=")
        src, _, flags = rest.partition(":")
        trees.append((name, src, flags.split()))
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in trees}
    for _ in range(args.rounds):
        for name, src, extra in trees:
            runs[name].append(measure(src, args, extra))
    for name, values in runs.items():
        us = statistics.median(v[0] for v in values)
        tps = statistics.median(v[1] for v in values)
        cores = statistics.median(v[2] for v in values)
        each = " ".join(f"{v[0]:.0f}" for v in values)
        print(
            f"{name:12s} {us:7.0f} us CPU per request (median of {len(values)}: {each}), "
            f"{tps:7.1f} texts/s, {cores:.2f} cores busy"
        )


if __name__ == "__main__":
    main()
