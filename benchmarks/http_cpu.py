"""CPU seconds the HTTP process spends per request, for two source trees side by side.

Starts `python -m embed_service serve` from each tree in turn (rounds interleaved), drives it with
`embed-service bench` (one query per request by default), and divides the server process's own CPU time
(its workers excluded) by the requests answered. CPU per request is steadier than throughput on a shared
machine. Example, this tree against an older commit checked out with `git worktree add /tmp/old <rev>`:

    python benchmarks/http_cpu.py --tree old=/tmp/old/src --tree new=src \\
        --corpus ../shared/bench/corpus/queries.jsonl

`--null-model` runs the workers without a model (workers/null_model.py): the HTTP process is then what
limits the server, its figure depends less on how fast the workers are (which moves with whatever else the
machine runs), and the texts/s printed is the front end's ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil


@dataclass(frozen=True)
class Load:
    """One load run's figures; `cores`: the CPU seconds of the server processes per second of load."""

    us_per_request: float
    requests_per_s: float
    texts_per_s: float
    tokens_per_s: float
    cores: float


@dataclass
class Served:
    url: str
    processes: list[psutil.Process]  # whose CPU time is the server's (the HTTP processes, not workers)

    def cpu(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.processes))


@contextlib.contextmanager
def served(src: str, port: int, extra: list[str], null_model: bool, poll_s: float = 0.3) -> Iterator[Served]:
    """A server from source tree `src` on `port`, healthy (/health polled every `poll_s`), stopped on exit."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    if null_model:
        env["EMBED_NULL_MODEL"] = "1"
    with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "embed_service", "serve", "--port", str(port), *extra],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"{src}: the server exited ({server.returncode}); see its log")
                time.sleep(poll_s)
            else:
                raise SystemExit(f"{src}: the server did not become healthy")
            yield Served(url, [psutil.Process(server.pid)])
        finally:
            server.terminate()
            server.wait(60)


def load(
    target: Served, corpus: str, inputs_per_request: int, concurrency: int, duration: float, texts: int = 1000
) -> Load:
    """Drive the server with `embed-service bench` and divide its CPU time by the requests answered."""
    before = target.cpu()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "embed_service",
                "bench",
                "--url",
                target.url,
                "--corpus",
                corpus,
                "--texts",
                str(texts),
                "--inputs-per-request",
                str(inputs_per_request),
                "--concurrency",
                str(concurrency),
                "--duration",
                str(duration),
                "--no-ceiling",
                "--json",
                out.name,
            ],
            check=False,
            capture_output=True,
        )
        text = Path(out.name).read_text()
        if not text:
            raise SystemExit(f"embed-service bench failed:\n{run.stdout.decode()}{run.stderr.decode()}")
        report = json.loads(text)
    cpu = target.cpu() - before
    if report["errors"]:
        raise SystemExit(f"{report['errors']} requests failed")
    return Load(
        cpu / max(1, report["requests"]) * 1e6,
        report["requests_per_s"],
        report["texts_per_s"],
        report["tokens_per_s"] or 0.0,
        cpu / report["seconds"],
    )


def parse_trees(specs: list[str]) -> list[tuple[str, str, list[str]]]:
    """`--tree NAME=SRC_DIR[:extra server flags]` arguments -> (name, source folder, flags)."""
    trees = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        src, _, flags = rest.partition(":")
        trees.append((name, src, flags.split()))
    return trees


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")


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
    parser.add_argument("--json", help="append this run to a JSON file (a list of runs)")
    args = parser.parse_args()
    trees = parse_trees(args.tree)
    runs: dict[str, list[Load]] = {name: [] for name, _, _ in trees}
    for _ in range(args.rounds):
        for name, src, extra in trees:
            with served(src, args.port, extra, args.null_model) as target:
                runs[name].append(
                    load(target, args.corpus, args.inputs_per_request, args.concurrency, args.duration)
                )
    first = trees[0][0]
    for name, values in runs.items():
        us = statistics.median(v.us_per_request for v in values)
        # Each round's ratio to the first tree in the same round, then their median: steadier than a
        # ratio of medians on a machine whose speed moves between rounds.
        paired = statistics.median(v.us_per_request / f.us_per_request for v, f in zip(values, runs[first]))
        tps = statistics.median(v.texts_per_s for v in values)
        cores = statistics.median(v.cores for v in values)
        each = " ".join(f"{v.us_per_request:.0f}" for v in values)
        print(
            f"{name:12s} {us:7.0f} us CPU per request (median of {len(values)}: {each}), "
            f"{tps:7.1f} texts/s, {cores:.2f} cores busy; {paired:.3f}x {first} (median of round ratios)"
        )
    if args.json:
        out = Path(args.json)
        history = json.loads(out.read_text()) if out.exists() else []
        history.append(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cpu": cpu_model(),
                "load_average": os.getloadavg(),
                "args": {k: v for k, v in vars(args).items() if k != "json"},
                "runs": {name: [vars(v) for v in values] for name, values in runs.items()},
            }
        )
        out.write_text(json.dumps(history, indent=1) + "\n")


if __name__ == "__main__":
    main()
