"""Speed of late chunking: chunk vectors per second, late chunking against chunks embedded alone.

The documents of benchmarks/late_retrieval.py (``short``: about 75 tokens, 7 sentence chunks; ``long``:
about 380 tokens, 41 chunks, past MiniLM's 256-token window, so long late chunking with
``context_overlap`` 0), through the Python API (``Embedder``, in this process, the default model and
``--dtype``). Per round and set, both modes embed the same chunks:

- ``alone``: every chunk of every document as its own input, in one ``encode`` call (the engine batches
  them);
- ``late``: each document with its chunks' spans (``chunking: {"mode": "late", "spans": ...}``), all
  documents at once (``aencode`` in flight together, so the engine batches them).

Rounds alternate the order of the modes; the figure per mode is the median over rounds of chunk vectors
per second, with the tokens each mode ran through the model (``prompt_tokens``). Example (about 3 minutes on
2 cores; ``--quick``: 3 rounds):

    python benchmarks/late_speed.py --out benchmarks/results/late_speed.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.late_retrieval import SETS, Document, documents


def lscpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of the flags that matter to the kernels it has."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"]
    return fields.get("Model name", "?").strip(), [f for f in wanted if f in flags]


async def alone(embedder: Any, docs: list[Document]) -> int:
    chunks = [d.text[s:e] for d in docs for s, e in d.spans]
    return (await embedder.aembed(chunks)).prompt_tokens


async def late(embedder: Any, docs: list[Document]) -> int:
    async def one(d: Document) -> int:
        spans = [list(s) for s in d.spans]
        return (await embedder.aembed([d.text], chunking={"mode": "late", "spans": spans})).prompt_tokens

    return sum(await asyncio.gather(*(one(d) for d in docs)))


MODES = {"alone": alone, "late": late}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument(
        "--dtype", default="auto", help="the server's --dtype (auto: bfloat16 where the CPU has it)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/late_speed.json"))
    args = ap.parse_args()
    from embed_service import Embedder

    rounds = 3 if args.quick else args.rounds
    sets = {
        name: documents(count, facts, fillers, seed) for name, (count, facts, fillers, seed) in SETS.items()
    }
    rows = []
    with Embedder(dtype=args.dtype) as e:
        info = e.info
        for name, docs in sets.items():
            n = sum(len(d.spans) for d in docs)
            for mode in MODES.values():  # warm: the first batches of each shape
                asyncio.run(mode(e, docs))
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            tokens: dict[str, int] = {}
            for r in range(rounds):
                for m in list(MODES)[:: 1 if r % 2 == 0 else -1]:
                    t = time.perf_counter()
                    tokens[m] = asyncio.run(MODES[m](e, docs))
                    rates[m].append(n / (time.perf_counter() - t))
            for m in MODES:
                med = statistics.median(rates[m])
                rows.append(
                    {
                        "set": name,
                        "mode": m,
                        "documents": len(docs),
                        "chunks": n,
                        "tokens": tokens[m],
                        "chunk_vectors_per_s": round(med, 1),
                        "rounds": [round(x, 1) for x in rates[m]],
                    }
                )
                print(f"{name:6s} {m:6s} {med:8.1f} chunk vectors/s  ({tokens[m]} tokens)", flush=True)
    cpu, flags = lscpu()
    result = {
        "cpu": cpu,
        "flags": flags,
        "model": info["model"],
        "dtype": info.get("dtype"),
        "num_threads": info.get("num_threads"),
        "data_parallel_size": info.get("data_parallel_size"),
        "via": "Python API (Embedder), in process",
        "python": platform.python_version(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| documents | mode | chunks | tokens run | chunk vectors/s (median) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['mode']} | {r['chunks']} | {r['tokens']} | {r['chunk_vectors_per_s']} |"
        )
    args.out.with_suffix(".md").write_text(
        f"{cpu} ({', '.join(flags)}), {info['model']}, {result['dtype']}, "
        f"{result['data_parallel_size']} replicas x {result['num_threads']} threads\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
