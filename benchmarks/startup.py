"""Seconds from `python -m embed_service serve` to its first healthy /health, for source trees side by side.

Each round starts a server from every tree in turn (default model and settings unless extra flags follow the
tree's source folder), polls /health every 20 ms (`http_cpu.served`), and stops it. Medians over rounds;
the rounds' spread is printed beside them. Example, this tree against an older commit checked out with `git worktree add`:

    python benchmarks/startup.py --tree before=/tmp/old/src --tree after=src \\
        --json benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_cpu import parse_trees, served  # noqa: E402
from benchmarks.result_file import ResultFile  # noqa: E402


def seconds_to_healthy(src: str, extra: list[str], port: int) -> float:
    t0 = time.perf_counter()
    with served(src, port, extra, null_model=False, poll_s=0.02):
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR[:extra server flags]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=8128)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    trees = {name: (src, extra) for name, src, extra in parse_trees(args.tree)}
    rounds: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, (src, extra) in trees.items():
            rounds[name].append(round(seconds_to_healthy(src, extra, args.port), 3))
    figures = {name: {"median_s": statistics.median(r), "rounds_s": r} for name, r in rounds.items()}
    for name, f in figures.items():
        print(
            f"{name:16s} {f['median_s']:.2f} s to healthy (rounds {min(f['rounds_s']):.2f}-{max(f['rounds_s']):.2f})"
        )
    if args.json:
        record.write(args.json, {"trees": {n: " ".join([s, *e]) for n, (s, e) in trees.items()}, **figures})


if __name__ == "__main__":
    main()
