"""The GPU path in one command (benchmarks/gpu_check.sh): what a lent CUDA device proves in 8 minutes.

Steps, each with a hard time limit (gpu_run.STEP_LIMITS, capped by what is left of --budget-s) and each recorded
in `steps` (ok, failed, timeout or skipped, with its seconds); the JSON summary is rewritten to --out after
every step, so a run killed at its limit still returns what it measured:
  environment  torch, the device, the attention kernel chosen and the varlen_attn signature, and whether
             each runtime requirement is installed at a version it allows
  kernels    the Triton kernel tests (tests/kernels/test_kernels.py) compiled on CUDA, each kernel against
             its layer's reference
  attention  every CUDA attention kernel there is (torch-varlen, flash-attn, sdpa) against each other and
             the per-sequence float32 reference, on a mixed-length flat batch: bidirectional encoder, causal
             GQA decoder, causal sliding window; milliseconds each
  models.<kind>  a bge-base-shaped encoder and a Qwen2-7B-shaped decoder (its layers cut to
             --decoder-layers, 4 of 28 by default, to fit the time; random weights written here, nothing
             downloaded):
    cuda_graphs  every step the worker captures, each replayed against the eager body (workers/graphs.py
             replay_check), the start-up fidelity check through the replays and eagerly, then short
             batches replayed against the eager forward with their milliseconds
    in_process   the forward alone: tokens/s, embeddings/s and model FLOPs utilization per batch budget,
             32- and 512-token inputs
    http     the server (--cuda-graphs on) with the project's load client (embed_service/bench.py): the
             fidelity check and graphs from /info, tokens/s, embeddings/s, latency percentiles and MFU

--cpu-dry-run runs the same steps on the CPU at toy sizes (the kernels under Triton's interpreter, the
attention backends the CPU has, the graph layout run eagerly), so that the script is known to work before a
device is lent. --prepare DIR makes the set that travels to a device without registries (gpu_prepare.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import gpu_models
from benchmarks.gpu_models import (
    DECODER,
    ENCODER,
    PEAK_FLOPS,
    TOY,
    corpus,
    flops_per_token,
    load_embedder,
    write_model,
)
from benchmarks.gpu_run import Run

ROOT = Path(__file__).resolve().parents[1]

# --- the steps --------------------------------------------------------------------------------------------


def step_environment(device: str) -> dict[str, Any]:
    """What this run stands on: versions, the attention choice, and each runtime requirement's status."""
    from importlib import metadata

    from packaging.requirements import Requirement

    from benchmarks.gpu_prepare import project_requirements
    from embed_service.ops import attention

    requirements = {}
    for line in project_requirements():
        req = Requirement(line)
        if req.marker and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
            requirements[req.name] = (
                version
                if req.specifier.contains(version, prereleases=True)
                else (f"{version} (needs {req.specifier})")
            )
        except metadata.PackageNotFoundError:
            requirements[req.name] = "missing"
    native = attention.torch_varlen()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "attention": attention.backend_name(device, torch.bfloat16),
        "torch_varlen_keywords": sorted(native[1] - {"query", "key", "value"}) if native else None,
        "flash_attn": attention.flash_attn_varlen_func is not None,
        "requirements": requirements,
        "requirements_ok": all(v[0].isdigit() and "needs" not in v for v in requirements.values()),
    }


def step_kernels(dry_run: bool, limit_s: float) -> dict[str, Any]:
    """tests/kernels/test_kernels.py with pytest: compiled on CUDA (TRITON_INTERPRET=0), a subset
    interpreted on a CPU. (test_models_with_kernels.py needs the default model's weights, which stay here.)"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "tests/kernels/test_kernels.py", "-q", "-p", "no:cacheprovider"]
    if dry_run:
        cmd += ["-k", "rms_norm and dtype1 or pool_normalize and lengths1 and mean"]
    else:
        env["TRITON_INTERPRET"] = "0"
    t0 = time.perf_counter()
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, limit_s - 5)
    )
    tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or [""]
    return {"passed": run.returncode == 0, "summary": tail[0], "seconds": round(time.perf_counter() - t0, 1)}


def _time(fn, device: str, repeat: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat * 1e3


def attention_backends(device: str) -> list[str]:
    """The kernels to compare: on CUDA each one installed (CUDA_BACKENDS); on a CPU the chosen one
    (`default`) and SDPA over length groups."""
    from embed_service.ops import attention

    if device != "cuda":
        return ["default", "sdpa"]
    available = {
        "torch-varlen": attention.torch_varlen() is not None,
        "flash-attn": attention.flash_attn_varlen_func is not None,
        "sdpa": True,
    }
    return [b for b in attention.CUDA_BACKENDS if available[b]]


def step_attention(device: str, dry_run: bool) -> list[dict[str, Any]]:
    """Every attention kernel there is against each other and the per-sequence float32 reference, on a
    mixed-length flat batch."""
    from embed_service.ops import attention
    from embed_service.ops.batch import FlatBatch

    dtype = torch.bfloat16
    lengths = [1, 17, 64, 33, 128, 5] if dry_run else [1, 32, 512, 300, 77, 512, 2048, 5] * 4
    heads, d = (4, 16) if dry_run else (28, 128)
    cases: list[tuple[str, int, bool, int | None]] = [
        ("encoder", heads, False, None),
        ("decoder-gqa-causal", heads // 4 or 1, True, None),
    ]
    cases.append(("sliding-window-causal", heads // 4 or 1, True, 16 if dry_run else 256))
    batch = FlatBatch.from_lengths(torch.zeros(sum(lengths), dtype=torch.long), lengths).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, kv, causal, window in cases:
        q = torch.randn(sum(lengths), heads, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(sum(lengths), kv, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(sum(lengths), kv, d, generator=g, device=device, dtype=dtype)
        scale = 1 / math.sqrt(d)
        ref = attention.varlen_attention_reference(q, k, v, batch.cu_seqlens, causal, scale, window).float()
        outputs: dict[str, torch.Tensor] = {}
        row: dict[str, Any] = {"case": name, "chosen": attention.backend_name(device, dtype), "backends": {}}
        for backend in attention_backends(device):
            fn = partial(
                attention.varlen_attention_torch if backend == "sdpa" else attention.varlen_attention,
                q, k, v, batch, causal, scale, window,
                **({"backend": backend} if backend not in ("sdpa", "default") else {}),
            )  # fmt: skip
            outputs[backend] = fn().float()
            row["backends"][backend] = {
                "max_abs_diff_vs_reference": float((outputs[backend] - ref).abs().max()),
                "ms": round(_time(fn, device, 3 if dry_run else 20), 3),
            }
        first = next(iter(outputs.values()))
        row["max_abs_diff_between_backends"] = max(float((o - first).abs().max()) for o in outputs.values())
        row["agree"] = all(r["max_abs_diff_vs_reference"] < 2e-2 for r in row["backends"].values())
        rows.append(row)
    return rows


# Short online batches (sequences x tokens each) for the CUDA graph step: steps 16, 128 and 1,024.
GRAPH_BATCHES = [(1, 16), (1, 100), (4, 32), (16, 64)]


GRAPH_MAX_LEN = 512  # the max input length the graph step's model is built with
DRY_GRAPH_STEPS = 128  # the steps a dry run lays out (eagerly): up to this many tokens


def step_cuda_graphs(model_dir: Path, device: str) -> dict[str, Any]:
    """The worker's graphs (workers/graphs.py): every step the server would capture, each replayed against
    the eager body (replay_check); the start-up fidelity check through the replays and eagerly; then short
    batches replayed against the eager forward (dense vectors: max abs difference, lowest cosine) with the
    latency of each. On a CPU nothing is captured (graphs.plan says why); the same runner then lays the
    steps out eagerly, so that everything but the capture is exercised."""
    from embed_service.ops import attention
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import DENSE, DENSE_ONLY, OutputRequest
    from embed_service.workers import fidelity, graphs

    model, spec, dtype = load_embedder(model_dir, device, GRAPH_MAX_LEN)
    backend = attention.backend_name(device, dtype)
    plan = graphs.choose_steps(True, device, backend, spec.family.module, 1, graphs.GRAPH_MAX_TOKENS)
    out: dict[str, Any] = {"attention": backend, "captured": bool(plan.steps), "skipped": plan.off}
    if not plan.steps:  # the same layout, run eagerly
        needed = {graphs.padded_tokens(b * n) for b, n in GRAPH_BATCHES}
        steps = tuple(sorted(set(graphs.graph_steps(DRY_GRAPH_STEPS)) | needed))
        plan = graphs.GraphSteps(steps, graphs.GRAPH_MAX_SEQUENCES, None)
    t0 = time.perf_counter()
    capture = graphs.cuda_graph if out["captured"] else graphs.eager
    runner = graphs.GraphRunner(model.model, plan, spec.max_input_length, torch.device(device), capture)
    if device == "cuda":
        torch.cuda.synchronize()
    out.update(steps=len(plan.steps), capture_s=round(time.perf_counter() - t0, 2))
    vocab = int(spec.config.get("vocab_size") or 1000)
    t0 = time.perf_counter()
    replay = graphs.replay_check(runner, model.model, spec.max_input_length, vocab, torch.device(device))
    out["replay_check"] = {**vars(replay), "seconds": round(time.perf_counter() - t0, 2)}

    dense = OutputRequest(frozenset({DENSE}))

    def vectors(replayed: bool):
        def run(ids, lengths):
            batch = FlatBatch.from_lengths(torch.from_numpy(ids), lengths.tolist())
            got = runner.forward(model, batch, [dense] * len(lengths)) if replayed else None
            got = got if got is not None else model(batch.to(device), [dense] * len(lengths))
            return np.stack([o.dense for o in got])

        return run

    check = partial(fidelity.measure, model, vocab_size=vocab, max_len=spec.max_input_length, threshold=0.999)
    out["fidelity_replayed"] = check(
        vectors(True), fast_is_reference=False, reference_run=vectors(False)
    ).info()
    out["fidelity_eager"] = check(vectors(False), fast_is_reference=False).info()
    out["batches"] = []
    g = torch.Generator().manual_seed(0)
    for seqs, length in GRAPH_BATCHES:
        batch = FlatBatch.from_lengths(
            torch.randint(1000, 8000, (seqs * length,), generator=g), [length] * seqs
        )
        requests = [DENSE_ONLY] * seqs

        def eager_forward(batch=batch, requests=requests):
            return model(batch.to(device), requests)

        def graph_forward(batch=batch, requests=requests):
            return runner.forward(model, batch, requests)

        want = np.stack([o.dense for o in eager_forward()]).astype(np.float64)
        got = np.stack([o.dense for o in graph_forward()]).astype(np.float64)
        cos = fidelity.cosines(want, got)
        repeat = 3 if device == "cpu" else 50
        eager_ms, graph_ms = _time(eager_forward, device, repeat), _time(graph_forward, device, repeat)
        out["batches"].append(
            {
                "sequences": seqs,
                "input_tokens": length,
                "step": graphs.padded_tokens(seqs * length),
                "max_abs_diff": float(np.abs(want - got).max()),
                "min_cosine": round(float(cos.min()), 6),
                "eager_ms": round(eager_ms, 3),
                "graph_ms": round(graph_ms, 3),
                "speedup": round(eager_ms / graph_ms, 2),
            }
        )
    out["agree"] = (
        replay.min_cosine >= 0.999
        and replay.steps_checked == len(plan.steps)
        and out["fidelity_replayed"]["passed"]
        and all(b["min_cosine"] >= 0.999 for b in out["batches"])
    )
    runner = model = None  # the graphs and weights go before the next model loads
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def in_process(
    model_dir: Path, config: dict, device: str, budgets: list[int], lengths: list[int], peak
) -> list:
    """The forward alone (no HTTP, no tokenizer, no queue): tokens/s at each batch budget and input length."""
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import DENSE_ONLY

    model, _, _ = load_embedder(model_dir, device, max(lengths))
    rows = []
    for budget in budgets:
        for length in lengths:
            n = max(1, budget // length)
            ids = torch.randint(1000, min(20000, config["vocab_size"]), (n * length,))
            batch = FlatBatch.from_lengths(ids, [length] * n).to(device)
            ms = _time(partial(model, batch, [DENSE_ONLY] * n), device, 2 if device == "cpu" else 5)
            tps = n * length / (ms / 1e3)
            rows.append(
                {
                    "budget": budget,
                    "input_tokens": length,
                    "batch_ms": round(ms, 2),
                    "tokens_per_s": round(tps),
                    "embeddings_per_s": round(n / (ms / 1e3), 1),
                    "mfu": round(tps * flops_per_token(config, length) / peak, 4) if peak else None,
                }
            )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def through_http(model_dir: Path, config: dict, device: str, budget: int, corpora: dict, args, peak) -> dict:
    from tests.server import ServerProcess

    from embed_service.bench import bench

    server = ServerProcess(
        "--model", str(model_dir), "--device", device, "--max-batch-tokens", str(budget), "--fidelity-warn-only",
        "--max-input-length", str(max(corpora)),  # the longest input measured (a 32k decoder's own is 32768)
        "--data-parallel-size", "1",  # one replica: one GPU measured
        "--cuda-graphs",  # the start-up path with graphs: capture, replay check, fidelity through them
    )  # fmt: skip
    try:
        server.wait_healthy(timeout=600)
        info = json.loads(_get(server.url + "/info"))
        out: dict[str, Any] = {
            "budget": budget,
            "dtype": info.get("dtype"),
            "kernels": info.get("kernels"),
            "attention": info.get("attention"),
            "fidelity": info.get("fidelity"),
            "cuda_graphs": info.get("cuda_graphs"),
            "loads": [],
        }
        for length, path in corpora.items():
            per_request, concurrency = (1, 64) if length <= 64 else (8, 16)
            if args.cpu_dry_run:
                concurrency = 4
            report = bench(
                server.url, path, texts=len(path.read_text().splitlines()), inputs_per_request=per_request, concurrency=concurrency,
                duration=args.duration, client="auto", ceiling=length == min(corpora) and not args.cpu_dry_run,
                model=None,
            )  # fmt: skip
            tps = report.tokens_per_s or 0.0
            out["loads"].append(
                {
                    "input_tokens": length,
                    "inputs_per_request": per_request,
                    "concurrency": concurrency,
                    "tokens_per_s": report.tokens_per_s,
                    "embeddings_per_s": report.texts_per_s,
                    "latency_ms": report.latency_ms,
                    "errors": report.errors,
                    "client": report.client,
                    "client_ceiling_embeddings_per_s": report.ceiling_texts_per_s,
                    "mfu": round(tps * flops_per_token(config, length) / peak, 4) if peak else None,
                }
            )
        return out
    finally:
        server.stop()


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def passed(summary: dict[str, Any]) -> bool:
    """Every step ran and finished, and every comparison in it agreed."""
    models = summary.get("models", {}).values()
    https = [h for m in models for h in m.get("http", [])]
    return bool(
        summary["steps"]
        and all(s["status"] == "ok" for s in summary["steps"])
        and summary.get("kernels", {}).get("passed")
        and all(r["agree"] for r in summary.get("attention", []))
        and all(m.get("cuda_graphs", {}).get("agree") for m in models)
        and all(h["fidelity"] and h["fidelity"]["passed"] for h in https)
        and all(load["errors"] == 0 for h in https for load in h["loads"])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    p.add_argument(
        "--prepare", metavar="DIR", help="make the set that travels to the device (gpu_prepare.py)"
    )
    p.add_argument("--no-download", action="store_true", help="--prepare without pip download (offline)")
    p.add_argument(
        "--carried", metavar="DIR", help="the prepared set, on the device (gpu_check.sh installs it)"
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="seconds for all steps (default 480; 900 dry)"
    )
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of each HTTP load (default 8; 3 dry)"
    )
    p.add_argument("--models", default="encoder,decoder")
    p.add_argument("--encoder-budgets", default=None, help="--max-batch-tokens values (default 16384)")
    p.add_argument("--decoder-budgets", default=None, help="default 16384")
    p.add_argument("--decoder-layers", type=int, default=None, help="of Qwen2-7B's 28 (default 4: the time)")
    p.add_argument("--out", help="the summary, rewritten after every step")
    args = p.parse_args(argv)
    if args.prepare:
        from benchmarks import gpu_prepare

        return gpu_prepare.main(args.prepare, not args.no_download)
    dry = args.cpu_dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-dry-run to check the script on a CPU)", file=sys.stderr)
        return 2
    args.duration = args.duration or (3.0 if dry else 8.0)
    budgets = {
        "encoder": [int(x) for x in (args.encoder_budgets or ("1024" if dry else "16384")).split(",")],
        "decoder": [int(x) for x in (args.decoder_budgets or ("1024" if dry else "16384")).split(",")],
    }
    lengths = [32, 128] if dry else [32, 512]
    name = "cpu" if dry else torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None) if not dry else None
    summary: dict[str, Any] = {"device": name, "dry_run": dry, "torch": torch.__version__, "peak_flops": peak}
    # A dry run's limits only catch a hang: a CPU shared with other work may be several times slower.
    out = Path(args.out) if args.out else None
    run = Run(summary, out, args.budget_s or (900.0 if dry else 480.0), 4.0 if dry else 1.0)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        if args.carried:
            gpu_models.TOKENIZERS = Path(args.carried) / "tokenizers"
        else:
            from benchmarks.gpu_prepare import write_tokenizers

            gpu_models.TOKENIZERS = write_tokenizers(work / "tokenizers")
        summary["environment"] = step_environment(device)
        summary["kernels"] = run.step("kernels", "kernels", step_kernels, dry)
        summary["attention"] = run.step("attention", "attention", step_attention, device, dry) or []
        summary["models"], dirs = {}, {}
        for kind in args.models.split(","):
            config = {**(ENCODER if kind == "encoder" else DECODER), **(TOY[kind] if dry else {})}
            if kind == "decoder" and not dry:
                config["num_hidden_layers"] = args.decoder_layers or 4
            weights_dtype = torch.float32 if dry else torch.bfloat16
            entry: dict[str, Any] = {
                "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers")},
                "layers_of_the_original": (ENCODER if kind == "encoder" else DECODER)["num_hidden_layers"],
            }
            summary["models"][kind] = entry
            dirs[kind] = run.step(
                f"{kind}: random weights",
                "write",
                write_model,
                work / kind,
                kind,
                config,
                device,
                weights_dtype,
            )
            if dirs[kind] is None:
                continue
            entry["cuda_graphs"] = run.step(
                f"{kind}: CUDA graphs and fidelity", "cuda_graphs", step_cuda_graphs, dirs[kind], device
            )
            in_budgets = [512] if dry else [2048, 8192, 32768]
            entry["in_process"] = run.step(
                f"{kind}: in-process throughput",
                "in_process",
                in_process,
                dirs[kind],
                config,
                device,
                in_budgets,
                lengths,
                peak,
            )
            entry["_config"] = config
        for kind, model_dir in dirs.items():
            if model_dir is None:
                continue
            entry = summary["models"][kind]
            config = entry.pop("_config")
            corpora = {
                n: corpus(work / f"{kind}-{n}.jsonl", model_dir, n, 100 if dry else 200) for n in lengths
            }
            entry["http"] = []
            for budget in budgets[kind]:
                got = run.step(
                    f"{kind}: HTTP at --max-batch-tokens {budget}",
                    "http",
                    through_http,
                    model_dir,
                    config,
                    device,
                    budget,
                    corpora,
                    args,
                    peak,
                )
                if got is not None:
                    entry["http"].append(got)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = passed(summary)
    run.write()
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
