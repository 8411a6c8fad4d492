"""Where the CPU time of a loaded server goes: a bulk run and an online run split into stages.

Starts `python -m embed_service serve` (default model, default settings unless `--server-flags`), loads it
with `embed-service bench` (bulk: 32 inputs per request, 4 in flight; online: 1 input per request, 32 in
flight), and samples the HTTP process and every worker with py-spy meanwhile (raw stacks, no native frames,
without pausing the processes). Each process's CPU seconds over the run come from the kernel (psutil); each
process's samples split its CPU time into stages by the innermost frame that one of RULES names, so the
shares add up to the server's CPU time (the load client's is not counted). Example:

    python benchmarks/profile_split.py --corpus ../shared/bench/corpus/passages.jsonl

writes benchmarks/results/profile_split.json (a list of runs, this one appended) and prints the table.
py-spy's samples are wall-clock samples of threads that were not idle: a runnable thread waiting for a core
counts as busy, which is why the split uses them only within a process and the kernel's CPU time between
processes. The matmul of the intermediate layer carries its GELU (a oneDNN post-op): "matmuls" includes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_cpu import Served, cpu_model, load, served  # noqa: E402

STAGES = (
    "HTTP/JSON",
    "tokenization",
    "admission and batching",
    "batch preparation",
    "matmuls",
    "attention",
    "norms and activations",
    "pooling",
    "response",
    "worker pipes",
    "other",
)

# (stage, file path fragment, function name fragment or ""): the innermost frame that matches decides.
RULES: tuple[tuple[str, str, str], ...] = (
    # workers
    ("matmuls", "ops/cpu_kernels.py", "small_linear"),  # the project's linear for short sequences
    ("attention", "ops/attention.py", ""),
    ("attention", "ops/cpu_kernels.py", ""),
    ("attention", "ops/scored_attention.py", ""),
    ("matmuls", "layers/activation.py", "_linear_gelu"),
    ("matmuls", "layers/linear.py", ""),
    ("norms and activations", "layers/norm.py", ""),
    ("norms and activations", "kernels/norm.py", ""),
    ("norms and activations", "layers/activation.py", ""),
    ("pooling", "ops/pooling.py", ""),
    ("pooling", "models/heads.py", ""),
    ("pooling", "embed_service/outputs.py", "pack"),
    ("batch preparation", "ops/batch.py", ""),
    ("batch preparation", "models/encoder.py", "AbsoluteEmbeddings"),
    ("batch preparation", "layers/embedding.py", ""),
    ("batch preparation", "workers/worker.py", "run"),
    ("worker pipes", "multiprocessing/connection.py", ""),
    ("worker pipes", "workers/group.py", ""),
    # the HTTP process
    ("tokenization", "engine/tokenizer.py", ""),
    ("tokenization", "engine/text.py", ""),
    ("tokenization", "tokenizers/", ""),
    ("response", "api/encodings.py", ""),
    ("response", "embed_service/outputs.py", ""),
    ("admission and batching", "batching/", ""),
    ("admission and batching", "engine/", ""),
    ("admission and batching", "frontends/", ""),
    ("HTTP/JSON", "embed_service/api/", ""),
    ("HTTP/JSON", "embed_service/metrics.py", ""),
    ("HTTP/JSON", "embed_service/observability.py", ""),
    ("HTTP/JSON", "uvicorn/", ""),
    ("HTTP/JSON", "starlette/", ""),
    ("HTTP/JSON", "fastapi/", ""),
    ("HTTP/JSON", "pydantic", ""),
    ("HTTP/JSON", "anyio/", ""),
    ("HTTP/JSON", "logging/", ""),
    ("HTTP/JSON", "prometheus_client/", ""),
    ("HTTP/JSON", "json/", ""),
    ("HTTP/JSON", "asyncio/", ""),  # the event loop itself (uvloop runs its I/O below these frames)
)


def stage_of(stack: str) -> str:
    """A raw py-spy stack (root first, `func (file:line)` frames joined by ';') -> its stage."""
    for frame in reversed(stack.split(";")):
        func, _, where = frame.rpartition(" (")
        for stage, path, name in RULES:
            if path in where and name in func:
                return stage
    return "other"


def split(raw: str) -> Counter:
    """py-spy's raw output -> samples per stage."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stage_of(stack)] += int(n)
    return counts


def worker_processes(server: psutil.Process) -> list[psutil.Process]:
    return [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]


def profile(url: str, server: psutil.Process, args: argparse.Namespace, shape: tuple[int, int]) -> dict:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    processes = {"http": server} | {f"worker{i}": p for i, p in enumerate(worker_processes(server))}
    with tempfile.TemporaryDirectory() as tmp:
        spies = {
            name: subprocess.Popen(
                [py_spy, "record", "--pid", str(p.pid), "--rate", str(args.rate), "--format", "raw"]
                + ["--nonblocking", "--duration", str(int(args.duration)), "-o", f"{tmp}/{name}.txt"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, p in processes.items()
        }
        time.sleep(0.5)  # py-spy attaches
        before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
        result = load(Served(url, []), args.corpus, shape[0], shape[1], args.duration)
        cpu = {name: sum(p.cpu_times()[:2]) - before[name] for name, p in processes.items()}
        for spy in spies.values():
            spy.wait(60)
        samples = {name: split(Path(f"{tmp}/{name}.txt").read_text()) for name in processes}
    total_cpu = sum(cpu.values())
    shares: Counter = Counter()
    by_process = {}
    for name, counts in samples.items():
        n = sum(counts.values()) or 1
        by_process[name] = {
            "cpu_s": round(cpu[name], 3),
            "samples": sum(counts.values()),
            "stages": {s: round(c / n, 4) for s, c in counts.most_common()},
        }
        for s, c in counts.items():
            shares[s] += cpu[name] * c / n
    return {
        "inputs_per_request": shape[0],
        "concurrency": shape[1],
        "texts_per_s": result.texts_per_s,
        "server_cpu_s": round(total_cpu, 3),
        "server_cores": round(total_cpu / args.duration, 3),
        "cpu_us_per_text": round(total_cpu / max(1e-9, result.texts_per_s * args.duration) * 1e6, 1),
        "shares": {s: round(shares[s] / total_cpu, 4) for s in STAGES if shares[s]},
        "processes": by_process,
    }


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    lines = ["| stage | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in STAGES:
        if any(s in r["shares"] for r in runs.values()):
            lines.append(
                f"| {s} | " + " | ".join(f"{100 * r['shares'].get(s, 0):.1f}%" for r in runs.values()) + " |"
            )
    lines.append("| texts/s | " + " | ".join(f"{r['texts_per_s']:.0f}" for r in runs.values()) + " |")
    lines.append(
        "| server CPU per text | "
        + " | ".join(f"{r['cpu_us_per_text']:.0f} us" for r in runs.values())
        + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--server-flags", default="", help="extra `serve` flags, one string")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--port", type=int, default=8127)
    parser.add_argument("--label", default="", help="a name for this run in the result file")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "profile_split.json")
    )
    args = parser.parse_args()
    shapes = {"bulk (32/request, c=4)": (32, 4), "online (1/request, c=32)": (1, 32)}
    runs = {}
    with served(args.src, args.port, args.server_flags.split(), False) as target:
        server = target.processes[0]
        load(target, args.corpus, 32, 4, 4.0)  # warm: every shape's first oneDNN primitives
        for name, shape in shapes.items():
            runs[name] = profile(target.url, server, args, shape)
    record = {
        "label": args.label,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "corpus": args.corpus,
        "server_flags": args.server_flags,
        "duration_s": args.duration,
        "runs": runs,
    }
    out = Path(args.out)
    history = json.loads(out.read_text()) if out.exists() else []
    history.append(record)
    out.write_text(json.dumps(history, indent=1) + "\n")
    print(f"{record['cpu']}, {record['cores']} cores, load average {record['load_average'][0]:.1f}")
    print(table(runs))


if __name__ == "__main__":
    main()
