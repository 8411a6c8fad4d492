"""Offline embedding, side by side in one run on the same texts: `embed-service encode` (the job, in this
process), the server's bulk throughput (HTTP, 32 inputs per request, 4 in flight), SentenceTransformer.encode
in process, and the Ray Data job (`EmbedBatches` on a local 2-CPU cluster, two actors).

    python benchmarks/offline.py                    # ~10 min on 2 busy cores
    python benchmarks/offline.py --texts 200 --rounds 1 --duration 10   # a smoke run
    python benchmarks/offline.py --update-docs      # and the table into docs/performance.md

Every round runs every contender once, in an order that rotates from round to round (the machine is shared
and noisy); the table gives medians over rounds. The engines are started once, before the rounds (start-up
is reported apart: it is paid once per job). Writes benchmarks/results/offline.json and offline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.compare import (
    BULK,
    MODEL_NAME,
    RESULTS,
    ROOT,
    SHARED,
    Server,
    free_port,
    load_run,
    log,
    model_path,
)
from embed_service import bench

DOC = ROOT / "docs" / "performance.md"
START, END = "<!-- offline:start -->", "<!-- offline:end -->"


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return f"{name}, {os.cpu_count()} cores" + (f" ({', '.join(extras)})" if extras else "")


def encode_job(embedder: Any, source: Path, out: Path, dtype: str) -> dict[str, Any]:
    """`embed-service encode SOURCE OUT` on a started Embedder: read, embed, write, join."""
    from embed_service import cli, offline

    argv = ["encode", str(source), str(out), "--overwrite", "--no-progress", "--dtype", dtype]
    args = cli.build_parser().parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k in cli.ENCODE_SETTINGS}
    t = time.perf_counter()
    offline.run(args, settings, embedder)
    return {"seconds": time.perf_counter() - t}


def ray_job(source: Path, out: Path, actors: int) -> dict[str, Any]:
    """The Ray Data job, actors' start-up included (Ray starts a pool per execution)."""
    import ray
    from ray.data import ActorPoolStrategy

    from embed_service.ray import EmbedBatches

    t = time.perf_counter()
    ds = ray.data.read_json(str(source)).map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"data_parallel_size": 1, "num_threads": 1},
        compute=ActorPoolStrategy(size=actors),
        batch_size=256,
        # Half a logical CPU each: two actors holding both of the cluster's CPUs would leave none for the
        # read and write tasks, and the job would wait forever. Each actor's worker takes one core anyway.
        num_cpus=0.5,
    )
    ds.write_parquet(str(out))
    return {"seconds": time.perf_counter() - t}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of each server load run")
    parser.add_argument("--corpus", default=str(SHARED / "bench" / "corpus" / "passages.jsonl"))
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()

    texts = bench.read_texts(args.corpus, args.texts)
    tmp = Path(tempfile.mkdtemp(prefix="embed-offline-bench-"))
    source = tmp / "in.jsonl"
    with open(source, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")

    from embed_service import Embedder

    log("starting the engines")
    t = time.perf_counter()
    ours = Embedder()
    startup = time.perf_counter() - t
    exact = Embedder(dtype="float32")
    tokens = sum(len(ids) for ids in ours.tokenize(texts))
    port = free_port()
    server = Server(
        "offline-server", [sys.executable, "-m", "embed_service", "serve", "--port", str(port)], port
    )
    if not server.wait(300):
        raise SystemExit(f"the server did not come up: {server.log_path}")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_path()), device="cpu")
    st.encode(texts[:64], batch_size=32)
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    def st_run() -> dict[str, Any]:
        t = time.perf_counter()
        st.encode(texts, batch_size=32, convert_to_numpy=True)
        return {"seconds": time.perf_counter() - t}

    contenders = {
        "encode": lambda: encode_job(ours, source, tmp / "out.parquet", "auto"),
        "encode-float32": lambda: encode_job(exact, source, tmp / "out-exact.parquet", "float32"),
        "server-bulk": lambda: load_run(server.url, texts, BULK, "base64", args.duration),
        "sentence-transformers": st_run,
    }
    if not args.no_ray:
        contenders["ray-data"] = lambda: ray_job(source, tmp / "ray-out", 2)
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        for r in range(args.rounds):
            names = list(contenders)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                result = contenders[name]()
                rate = result["texts_per_s"] if "texts_per_s" in result else len(texts) / result["seconds"]
                runs[name].append(rate)
                log(f"round {r + 1} {name}: {rate:.1f} texts/s")
    finally:
        server.stop()
        ours.close()
        exact.close()
        if not args.no_ray:
            ray.shutdown()

    per_text = tokens / len(texts)
    table = {name: statistics.median(v) for name, v in runs.items()}
    report = {
        "cpu": cpu(),
        "python": platform.python_version(),
        "texts": len(texts),
        "tokens_per_text": per_text,
        "rounds": args.rounds,
        "embedder_startup_s": startup,
        "runs_texts_per_s": runs,
        "median_texts_per_s": table,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "offline.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (RESULTS / "offline.md").write_text(md)
    print(md)
    if args.update_docs:
        doc = DOC.read_text()
        head, rest = doc.split(START, 1) if START in doc else (doc.rstrip() + "\n\n", END)
        tail = rest.split(END, 1)[1] if END in rest else ""
        DOC.write_text(f"{head}{START}\n{md}{END}{tail}")
    return 0


LABELS = {
    "encode": "`embed-service encode` (default dtype)",
    "encode-float32": "`embed-service encode --dtype float32`",
    "server-bulk": "server, bulk over HTTP (default dtype; 32 inputs a request, 4 in flight)",
    "sentence-transformers": "`SentenceTransformer.encode` in process (float32, batch 32)",
    "ray-data": "Ray Data job: 2 actors x 1 replica, local cluster (`ray.init(num_cpus=2)`), start-up included",
}


def markdown(report: dict[str, Any]) -> str:
    base = report["median_texts_per_s"].get("server-bulk")
    lines = [
        f"{report['texts']} passages of `{Path(MODEL_NAME).name}` (~{report['tokens_per_text']:.0f} tokens each), "
        f"medians of {report['rounds']} rounds, on {report['cpu']}, shared with other work. Embedder start-up "
        f"(load and warm up): {report['embedder_startup_s']:.1f} s, paid once per job.",
        "",
        "| contender | texts/s | tokens/s | vs server bulk |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, rate in report["median_texts_per_s"].items():
        ratio = f"{rate / base:.2f}x" if base else "-"
        lines.append(f"| {LABELS[name]} | {rate:.1f} | {rate * report['tokens_per_text']:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
