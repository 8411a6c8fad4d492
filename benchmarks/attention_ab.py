"""The CPU attention kernel of another revision beside this tree's, in one process, on the same batches.

Both libraries are compiled here as the server compiles its own (ops/cpu_kernels: FLAGS, then LINK_FLAGS),
one from `git show REV:src/embed_service/ops/csrc/...`, one from this tree, and called in turn on the
served model's attention shapes (its heads and head size; random bf16 q, k, v) over ~4,096-token batches of
real texts from each corpus, bf16, on the path this CPU takes. Rounds interleave the two (the order
alternating); each round takes the best of 5 calls; the figure is the median of the rounds' ratios, at each
thread count asked for. Also the largest difference between the two outputs, which a change that is meant to
be exact should leave at 0.

    python benchmarks/attention_ab.py --base HEAD~1 [--threads 1 2] [--rounds 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_paths import SHARED, batch_of, best_ms  # noqa: E402
from benchmarks.result_file import ResultFile  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops.cpu_kernels import (  # noqa: E402
    CSRC,
    FLAGS,
    HEADERS,
    LINK_FLAGS,
    SOURCES,
    AttentionKernel,
    find_compiler,
)
from embed_service.server import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(sources: list[Path], out: Path, compiler: str) -> AttentionKernel:
    objs = []
    for src in sources:
        obj = out.with_name(f"{out.name}.{src.stem}.o")
        subprocess.run([compiler, *FLAGS, "-c", str(src), "-o", str(obj)], check=True)
        objs.append(str(obj))
    subprocess.run([compiler, *LINK_FLAGS, *objs, "-o", str(out), "-lm"], check=True)
    return AttentionKernel(out)


def sources_at(rev: str, into: Path) -> list[Path]:
    """The kernel's sources and headers as they are at `rev`, written into `into`."""
    for path in (*SOURCES, *HEADERS):
        rel = path.relative_to(ROOT).as_posix()
        text = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        (into / path.name).write_bytes(text)
    return [into / path.name for path in SOURCES]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the git revision to compare this tree against")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    compiler = find_compiler()
    if compiler is None:
        raise SystemExit("no C compiler here")
    from transformers import AutoTokenizer

    spec = load_spec(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(str(spec.path))
    heads = int(spec.config["num_attention_heads"])
    head_size = int(spec.config["hidden_size"]) // heads
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, tree_dir = Path(tmp, "base"), Path(tmp, "tree")
        base_dir.mkdir()
        tree_dir.mkdir()
        kernels = {
            "base": build(sources_at(args.base, base_dir), base_dir / "base.so", compiler),
            "tree": build(list(SOURCES), tree_dir / "tree.so", compiler),
        }
        path = kernels["tree"].path(torch.bfloat16, head_size)
        print(f"{base_rev} against this tree ({CSRC.relative_to(ROOT)}), path {path}")
        for corpus in ("queries", "passages"):
            seqs = batch_of(tokenizer, SHARED / "bench" / "corpus" / f"{corpus}.jsonl", args.tokens, 256)
            lengths = [len(s) for s in seqs]
            total = sum(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            gen = torch.Generator().manual_seed(0)
            qkv = (torch.randn(total, 3 * heads * head_size, generator=gen) * 2).bfloat16()
            q, k, v = qkv.view(total, 3 * heads, head_size).split(heads, dim=1)
            flops = sum(4 * n * n * head_size * heads for n in lengths)
            args_ = (q, k, v, cu, max(lengths), False, head_size**-0.5, None)
            calls = {name: (lambda kern=kern, a=args_: kern(*a)) for name, kern in kernels.items()}
            outs = {name: call().float() for name, call in calls.items()}
            diff = (outs["tree"] - outs["base"]).abs().max().item()
            for threads in args.threads:
                torch.set_num_threads(threads)
                ms: dict[str, list[float]] = {"base": [], "tree": []}
                for r in range(args.rounds):
                    for name in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
                        ms[name].append(best_ms(calls[name], 5))
                ratio = statistics.median(b / t for b, t in zip(ms["base"], ms["tree"]))
                entry = {
                    "sequences": len(seqs),
                    "tokens": total,
                    "mean_length": round(total / len(seqs), 1),
                    "base_ms": round(statistics.median(ms["base"]), 3),
                    "tree_ms": round(statistics.median(ms["tree"]), 3),
                    "base_gflops": round(flops / statistics.median(ms["base"]) / 1e6, 1),
                    "tree_gflops": round(flops / statistics.median(ms["tree"]) / 1e6, 1),
                    "speedup": round(ratio, 3),
                    "max_abs_diff": diff,
                    "per_round_ms": ms,
                }
                results[f"{corpus}/{threads}"] = entry
                print(
                    f"{corpus:9} {threads} thread(s): {entry['base_ms']:6.2f} -> {entry['tree_ms']:6.2f} ms "
                    f"({entry['base_gflops']:.0f} -> {entry['tree_gflops']:.0f} GFLOP/s), {ratio:.3f}x; "
                    f"max |diff| {diff:g}"
                )
    if args.json:
        record.write(
            args.json,
            {
                "base": base_rev,
                "path": path,
                "heads": heads,
                "head_size": head_size,
                "rounds": args.rounds,
                "cpu_count": os.cpu_count(),
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
