"""Draw docs/performance.png from benchmarks/results/compare.json (one run of compare.py).

Left: every contender's throughput on both corpora as a multiple of OpenVINO's (sentence-transformers'
OpenVINO backend, the fastest CPU peer), with the bf16 matmul bound of the model's shapes as the top line.
Middle: online throughput (1 input per request, queries.jsonl) against concurrency, with
sentence-transformers' torch float32 encode as a line for reference. Right: latency p50 and p99 at the
same points. The title names the CPU (lscpu) and the run's load average.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LABELS = {
    "ours": "embed-service (auto: bf16)",
    "ours-exact": "embed-service (float32)",
    "ours-int8": "embed-service (int8)",
    "infinity": "Infinity",
}
COLORS = {"ours": "#1f77b4", "ours-exact": "#17becf", "ours-int8": "#9467bd", "infinity": "#d62728"}


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "compare.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "performance.png"
    result = json.loads(src.read_text())
    fig, (bars, left, right) = plt.subplots(
        1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]}
    )
    draw_bars(bars, compare_report.Figures(result))
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
    st = [r["texts_per_s"] for r in result["runs"].get("st-torch-fp32|encode|queries", [])]
    if st:
        left.axhline(statistics.median(st), color="gray", ls=":", label="sentence-transformers torch float32")
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
    cpu = meta.get("cpu", {})
    load = meta.get("load_average", {})
    fig.suptitle(
        f"all-MiniLM-L6-v2, {meta['texts']} texts per corpus, one run of benchmarks/compare.py on {cpu.get('model')}, "
        f"{meta['cpus']} cores ({' '.join(f for f in cpu.get('flags', []) if 'bf16' in f or 'amx' in f or 'vnni' in f)}"
        f"), load average {load.get('start', ['?'])[0]} -> {load.get('end', ['?'])[0]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def draw_bars(ax, f: compare_report.Figures) -> None:
    """Throughput as a multiple of OpenVINO's, per contender and corpus (bulk and online for the server)."""
    rows = [(n if m.startswith("in process") else f"{n.replace('embed-service ', '')} {m.split(':')[0]}", k)
            for n, m, k, _ in compare_report.ENCODER_ROWS if "base64" not in m]  # fmt: skip
    ref = {c: f.rate("st-openvino|encode", c) for c in compare_report.CORPORA}
    width = 0.4
    for j, (c, color) in enumerate(zip(compare_report.CORPORA, ("#1f77b4", "#ff7f0e"))):
        ys = [(f.rate(k, c) or 0) / ref[c] if ref[c] else 0 for _, k in rows]
        ax.barh([i + j * width for i in range(len(rows))], ys, height=width, color=color, label=c)
        b = f.bound_texts("encoder", c)
        if b and ref[c]:
            ax.axvline(b / ref[c], color=color, ls="--", lw=1, label=f"bf16 matmul bound ({c})")
    ax.set_yticks([i + width / 2 for i in range(len(rows))])
    ax.set_yticklabels([n.replace("sentence-transformers, ", "ST ") for n, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("texts/s, multiple of sentence-transformers OpenVINO")
    ax.set_title("Side by side (medians of rounds)")
    ax.legend(fontsize=7)
    ax.grid(True, axis="x", alpha=0.3)


if __name__ == "__main__":
    sys.exit(main())
