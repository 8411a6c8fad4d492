"""The front end's ceiling: how many inputs one HTTP process can tokenize, batch and answer per second
when the model costs nothing, per core it keeps busy.

Starts the server with workers that compute nothing (``EMBED_NULL_MODEL=1``, workers/null_model.py:
constant outputs of the right shapes, no weights) and drives it with `embed-service bench` at a few
shapes: short inputs (~10 tokens) and long ones (512 tokens), one per request (online) and 32 per
request (bulk). Texts are cut from a corpus with the model's tokenizer to the token count asked, so the
tokenizer does the work it does on real text. For each shape it prints requests/s, inputs/s, tokens/s,
the cores the server's HTTP process(es) kept busy, and inputs/s per busy core; the median over rounds.

    python benchmarks/front_end_ceiling.py --corpus ../shared/bench/corpus/passages.jsonl

`--http-processes 1,2` serves each count (`serve --http-processes N`) at once, on ports of their own, and
interleaves their rounds, so that both see the same machine; "cores" is then the CPU of every process that
listens on the port (the engine process and its front ends; the workers are not counted).

`--baseline-src DIR` serves every count from a second source tree as well (another checkout), its rounds
interleaved with the rest, rows marked "before": a change's effect measured on the same machine at once.
With N > 1 it also prints where the CPU went: each listening process's CPU seconds per second of load,
the engine process first, then the front ends.

Read the per-core figures: on a machine shared with other work, the cores the load gets vary, and the
load client (wrk) takes a share of them too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil  # noqa: E402
from http_cpu import Load, Served, load, served  # noqa: E402
from result_file import ResultFile  # noqa: E402

# (name, content tokens per input, inputs per request, requests in flight)
SHAPES = [
    ("short, 1/request", 10, 1, 32),
    ("short, 32/request", 10, 32, 8),
    ("512 tokens, 1/request", 512, 1, 32),
    ("512 tokens, 32/request", 512, 32, 4),
]


def cut_texts(tokenizer: Tokenizer, corpus: list[str], tokens: int, count: int) -> list[str]:
    """`count` texts of about `tokens` tokens each (special tokens included), taken in turn from the
    corpus (joined end to end where one text is too short)."""
    ids = [i for text in corpus for i in tokenizer.encode(text, add_special_tokens=False).ids]
    content = tokens - 2  # [CLS] ... [SEP]
    out: list[str] = []
    at = 0
    while len(out) < count:
        if at + content > len(ids):
            at = 0
        text = tokenizer.decode(ids[at : at + content]).strip()
        if text:  # a run of special or unknown tokens decodes to nothing
            out.append(text)
        at += content
    return out


def listening(target: Served, port: int) -> list[psutil.Process]:
    """The server's processes that hold its listening socket: the HTTP process(es), not the workers."""
    root = target.processes[0]
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                out.append(p)
        except psutil.Error:
            continue
    return out or [root]


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", default="src", help="the source tree to serve")
    parser.add_argument("--corpus", required=True, help='JSONL, one {"text": ...} per line')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--texts", type=int, default=1000, help="distinct texts per shape")
    parser.add_argument("--port", type=int, default=8127)
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))), help="indices")
    parser.add_argument("--server-flags", default="", help="extra `serve` flags, one string")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this file")
    parser.add_argument(
        "--http-processes", default="1", help="`serve --http-processes` counts to compare, e.g. 1,2"
    )
    parser.add_argument("--baseline-src", help="a second source tree, served the same way (rows: before)")
    args = parser.parse_args()
    record = ResultFile()
    sys.path.insert(0, str(Path(args.src).resolve()))
    from embed_service.server import default_model_path

    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tokenizer.no_truncation()  # the file's own settings (128, padded) would cut the corpus's texts
    tokenizer.no_padding()
    corpus = [json.loads(line)["text"] for line in Path(args.corpus).read_text().splitlines() if line]
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    # The default model stops at 256 tokens; its position table holds 512.
    extra = ["--max-input-length", "512", *args.server_flags.split()]
    counts = [int(n) for n in args.http_processes.split(",")]
    trees = {"": args.src, **({"before": args.baseline_src} if args.baseline_src else {})}
    servers = [(tree, n) for tree in trees for n in counts]
    runs: dict[tuple[str, str, int], list[Load]] = {
        (name, *key): [] for name, *_ in shapes for key in servers
    }
    split: dict[tuple[str, str, int], list[list[float]]] = {key: [] for key in runs}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for _name, tokens, _, _ in shapes:
            path = Path(tmp) / f"{tokens}.jsonl"
            if tokens not in files:
                texts = cut_texts(tokenizer, corpus, tokens, args.texts)
                path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
                files[tokens] = str(path)
        with contextlib.ExitStack() as stack:
            targets = {}
            for i, (tree, n) in enumerate(servers):
                port = args.port + i
                flags = [*extra, "--http-processes", str(n)]
                targets[tree, n] = stack.enter_context(served(trees[tree], port, flags, null_model=True))
                targets[tree, n].processes = listening(targets[tree, n], port)
            for _ in range(args.rounds):
                for name, tokens, per_request, concurrency in shapes:
                    for key in servers:
                        procs = targets[key].processes
                        before = [cpu_seconds(p) for p in procs]
                        run = load(targets[key], files[tokens], per_request, concurrency, args.duration)
                        runs[(name, *key)].append(run)
                        split[(name, *key)].append(
                            [(cpu_seconds(p) - b) / args.duration for p, b in zip(procs, before)]
                        )
    rows = []
    print(
        f"{'shape':24s} {'tree':>6s} {'http':>4s} {'requests/s':>10s} {'inputs/s':>9s} {'tokens/s':>10s} "
        f"{'cores':>6s} {'inputs/s/core':>13s}  cores per process (engine process first)"
    )
    for (name, tree, n), values in runs.items():
        per_process = [statistics.median(col) for col in zip(*split[name, tree, n])]
        row = {
            "shape": name,
            "tree": tree or "after",
            "http_processes": n,
            "cores_per_process": per_process,
            "requests_per_s": statistics.median(v.requests_per_s for v in values),
            "inputs_per_s": statistics.median(v.texts_per_s for v in values),
            "tokens_per_s": statistics.median(v.tokens_per_s for v in values),
            "cores": statistics.median(v.cores for v in values),
            "inputs_per_s_per_core": statistics.median(v.texts_per_s / max(v.cores, 1e-9) for v in values),
            "us_per_request": statistics.median(v.us_per_request for v in values),
        }
        rows.append(row)
        print(
            f"{name:24s} {tree or 'after':>6s} {n:4d} {row['requests_per_s']:10,.0f} {row['inputs_per_s']:9,.0f} "
            f"{row['tokens_per_s']:10,.0f} {row['cores']:6.2f} {row['inputs_per_s_per_core']:13,.0f}  "
            + " ".join(f"{c:.2f}" for c in per_process)
        )
    if args.json_path:
        figures = {"rounds": args.rounds, "duration_s": args.duration, "null_model": True, "client": "wrk"}
        record.write(args.json_path, {**figures, "rows": rows})


if __name__ == "__main__":
    main()
