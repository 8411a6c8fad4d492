"""Draw docs/performance.png from benchmarks/results/compare.json (one run of compare.py).

Left: online throughput (1 input per request, queries.jsonl) against concurrency, with
sentence-transformers' in-process encode as a line for reference. Right: latency p50 and p99 at the
same points.

    python benchmarks/plot.py [compare.json] [out.png]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LABELS = {
    "ours": "embed-service (auto: bf16)",
    "ours-exact": "embed-service (float32)",
    "infinity": "Infinity",
}
COLORS = {"ours": "#1f77b4", "ours-exact": "#17becf", "infinity": "#d62728"}


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "compare.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "performance.png"
    result = json.loads(src.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_c in result["sweep"].items():
        levels = sorted(by_c, key=int)
        xs = [int(c) for c in levels]
        tput = [statistics.median(r["texts_per_s"] for r in by_c[c]) for c in levels]
        p50 = [statistics.median(r["latency_ms"]["p50"] for r in by_c[c]) for c in levels]
        p99 = [statistics.median(r["latency_ms"]["p99"] for r in by_c[c]) for c in levels]
        color = COLORS.get(name)
        left.plot(xs, tput, "o-", label=LABELS.get(name, name), color=color)
        right.plot(xs, p50, "o-", label=f"{LABELS.get(name, name)} p50", color=color)
        right.plot(xs, p99, "s--", label=f"{LABELS.get(name, name)} p99", color=color, alpha=0.6)
    st = [r["texts_per_s"] for r in result["runs"].get("st|encode|queries", [])]
    if st:
        left.axhline(statistics.median(st), color="gray", ls=":", label="sentence-transformers encode")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (1 input each)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel("texts/s (queries.jsonl)")
    left.set_title("Online throughput")
    right.set_yscale("log")
    right.set_ylabel("latency, ms")
    right.set_title("Latency")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    meta = result["meta"]
    fig.suptitle(
        f"all-MiniLM-L6-v2 on {meta['cpus']} CPU cores, {meta['texts']} texts, one run of benchmarks/compare.py",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
