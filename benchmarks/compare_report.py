"""The tables of benchmarks/compare.py, from its result (benchmarks/results/compare.json).

Every figure is a median over the run's interleaved rounds; ratios are ratios of medians. A contender's
fraction of the bound is its tokens/s times the model's FLOPs per token over the median bf16 matmul rate of
the model's own layer shapes, measured in the same rounds (benchmarks/peers.py).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

CORPORA = ("queries", "passages")
PEER_FLOOR = 0.999  # a peer counts as the same model at this min cosine vs float32 and above

ENCODER_ROWS = [
    ("sentence-transformers, torch float32", "in process, batch 32", "st-torch-fp32|encode", "st-torch-fp32"),
    ("sentence-transformers, torch bfloat16", "in process, batch 32", "st-torch-bf16|encode", "st-torch-bf16"),
    ("sentence-transformers, ONNX Runtime", "in process, batch 32", "st-onnx|encode", "st-onnx"),
    ("sentence-transformers, ONNX Runtime O3", "in process, batch 32", "st-onnx-O3|encode", "st-onnx-O3"),
    ("sentence-transformers, ONNX Runtime dynamic int8 (avx512_vnni)", "in process, batch 32",
     "st-onnx-qint8|encode", "st-onnx-qint8"),
    ("sentence-transformers, OpenVINO", "in process, batch 32", "st-openvino|encode", "st-openvino"),
    ("embed-service (auto: bf16)", "bulk: 32/request, c=4, float", "ours|bulk-float", "ours"),
    ("embed-service (auto: bf16)", "bulk: 32/request, c=4, base64", "ours|bulk-base64", "ours"),
    ("embed-service (auto: bf16)", "online: 1/request, c=32, float", "ours|online-float", "ours"),
    ("embed-service (auto: bf16)", "online: 1/request, c=32, base64", "ours|online-base64", "ours"),
    ("embed-service (float32)", "bulk: 32/request, c=4, float", "ours-exact|bulk-float", "ours-exact"),
    ("embed-service (--quantization int8)", "bulk: 32/request, c=4, float", "ours-int8|bulk-float", "ours-int8"),
    ("embed-service (--quantization int8)", "online: 1/request, c=32, float", "ours-int8|online-float", "ours-int8"),
    ("Infinity", "bulk: 32/request, c=4, float", "infinity|bulk-float", None),
    ("Infinity", "online: 1/request, c=32, float", "infinity|online-float", None),
]  # fmt: skip
PEERS = [key for _, mode, key, _ in ENCODER_ROWS if key.startswith("st-")]
DECODER_ROWS = [
    ("sentence-transformers, torch bfloat16", "in process, batch 32", "dec-st-torch-bf16|encode", "dec-st-torch-bf16"),
    ("sentence-transformers, OpenVINO", "in process, batch 32", "dec-st-openvino|encode", "dec-st-openvino"),
    ("sentence-transformers, OpenVINO, f32 precision hint", "in process, batch 32", "dec-st-openvino-f32|encode",
     "dec-st-openvino-f32"),
    ("embed-service (auto: bf16)", "bulk: 32/request, c=4, float", "dec-ours|bulk-float", "dec-ours"),
]  # fmt: skip
DECODER_PEERS = [key for _, _, key, _ in DECODER_ROWS if key.startswith("dec-st-")]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def flops_per_token(config: dict[str, Any], mean_context: float) -> float:
    import peers

    return peers.flops_per_token(config, mean_context)


class Figures:
    """Medians, cosines and bound fractions of one result."""

    def __init__(self, result: dict):
        self.result = result
        self.med = {k: median([r["texts_per_s"] for r in v]) for k, v in result["runs"].items()}
        self.acc = result.get("accuracy", {})
        meta = result["meta"]
        self.tpt = {"encoder": meta["tokens_per_text"], "decoder": meta.get("decoder_tokens_per_text") or {}}
        self.configs = meta.get("configs", {})

    def rate(self, key: str, c: str) -> float | None:
        return self.med.get(f"{key}|{c}")

    def bound_tflops(self, model: str) -> float | None:
        return self.med.get(f"bound|{model}|tflops")

    def bound_texts(self, model: str, c: str) -> float | None:
        """Texts/s a forward at the bound would reach: the bound's FLOP/s over a text's FLOPs."""
        tf, tpt, cfg = self.bound_tflops(model), self.tpt[model].get(c), self.configs.get(model)
        if not (tf and tpt and cfg):
            return None
        return tf * 1e12 / (flops_per_token(cfg, tpt) * tpt)

    def fraction(self, model: str, key: str, c: str) -> float | None:
        v, b = self.rate(key, c), self.bound_texts(model, c)
        return v / b if v and b else None

    def cosine(self, name: str | None, c: str) -> float | None:
        return self.acc.get(name, {}).get(c) if name else None

    def best_peer(self, keys: list[str], c: str) -> tuple[str, float] | None:
        """The fastest peer whose min cosine vs float32 is at least PEER_FLOOR."""
        ok = [(k, self.rate(k, c)) for k in keys if (self.cosine(k.split("|")[0], c) or 0) >= PEER_FLOOR]
        ok = [(k, v) for k, v in ok if v]
        return max(ok, key=lambda kv: kv[1]) if ok else None


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def side_by_side(f: Figures, rows: list, model: str, ref_key: str) -> list[str]:
    lines = [
        "| contender | mode | queries texts/s | vs OpenVINO | passages texts/s | vs OpenVINO "
        "| min cosine vs float32 (queries / passages) | of the bf16 matmul bound (queries / passages) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, mode, key, acc in rows:
        cells = []
        for c in CORPORA:
            v, ref = f.rate(key, c), f.rate(ref_key, c)
            digits = ",.1f" if v is not None and v < 100 else ",.0f"
            cells += [fmt(v, digits), f"{v / ref:.2f}x" if v and ref else "n/a"]
        # NaN: the contender's vectors were NaN (not the same model, whatever its speed).
        cos = " / ".join(fmt(f.cosine(acc, c), ".5f").replace("nan", "NaN vectors") for c in CORPORA)
        frac = " / ".join(fmt(f.fraction(model, key, c), ".0%") for c in CORPORA)
        bold = "**" if key == ref_key else ""
        lines.append(f"| {bold}{name}{bold} | {mode} | {' | '.join(cells)} | {cos} | {frac} |")
    bt = [f.bound_texts(model, c) for c in CORPORA]
    lines.append(
        f"| bf16 matmul bound of the model's shapes | 2 threads, {fmt(f.bound_tflops(model), '.2f')} TFLOP/s "
        f"| {fmt(bt[0])} | | {fmt(bt[1])} | | | 100% |"
    )
    return lines


def render(result: dict) -> str:
    f = Figures(result)
    meta = result["meta"]
    cpu = meta.get("cpu", {})
    load = meta.get("load_average", {})
    rounds = result.get("matmul", {}).get("rounds", [])
    lines = [
        f"CPU: {cpu.get('model', '?')}, {cpu.get('cpus', meta.get('cpus'))} cores (lscpu flags: "
        f"{' '.join(cpu.get('flags', []))}). Load average (1, 5, 15 min) at the start {load.get('start')}, "
        f"at the end {load.get('end')}; the run took {meta.get('wall_s', 0) / 60:.0f} min.",
        "",
        f"Medians over {meta['rounds']} interleaved rounds, {meta['texts']} texts per corpus "
        f"({meta['tokens_per_text']['queries']:.1f} and {meta['tokens_per_text']['passages']:.1f} tokens per "
        f"text), {meta['duration_s']:g} s per load run. Min cosine: every text, against sentence-transformers "
        "torch float32 (the peers, the float32 server) or the float32 server (the default server). The bound: "
        f"the bf16 matmuls of one layer at 4,096 tokens, measured in every round ("
        + ", ".join(f"{b.get('encoder', 0):.2f}" for b in rounds)
        + " TFLOP/s).",
        "",
        *side_by_side(f, ENCODER_ROWS, "encoder", "st-openvino|encode"),
        "",
    ]
    if any(k.startswith("dec-") for k in f.med):
        dt = meta["decoder_tokens_per_text"]
        lines += [
            f"Decoder: SmolLM2-135M-Instruct (last token, normalized), the first {meta['decoder_texts']} texts of "
            f"each corpus ({dt.get('queries', 0):.1f} and {dt.get('passages', 0):.1f} tokens per text), cut at "
            "256 tokens on both sides; min cosine against sentence-transformers torch float32; bound rounds "
            + ", ".join(f"{b.get('decoder', 0):.2f}" for b in rounds)
            + " TFLOP/s.",
            "",
            *side_by_side(f, DECODER_ROWS, "decoder", "dec-st-openvino|encode"),
            "",
        ]
    lines += targets(f)
    lines += latency_lines(result)
    ceil = meta["client_ceiling"]
    lines += [
        "",
        f"Client: {meta['client']}; its ceiling against a null endpoint: {ceil['bulk']:,.0f} requests/s "
        f"(bulk shape), {ceil['online']:,.0f} requests/s (online shape).",
    ]
    return "\n".join(lines) + "\n"


def targets(f: Figures) -> list[str]:
    amx = any(x.startswith("amx") for x in f.result["meta"].get("cpu", {}).get("flags", []))
    floor = 0.60 if amx else 0.75
    lines = ["| target | queries | passages | met |", "|---|---|---|---|"]

    def row(name: str, cells: list[tuple[str, bool | None]]) -> None:
        met = [ok for _, ok in cells if ok is not None]
        verdict = (
            "n/a"
            if not met
            else "yes"
            if all(met)
            else "no"
            if not any(met)
            else "queries only"
            if met[0]
            else "passages only"
        )
        lines.append(f"| {name} | {cells[0][0]} | {cells[1][0]} | {verdict} |")

    def vs_peer(key: str, peer_keys: list[str], goal: float) -> list[tuple[str, bool | None]]:
        out: list[tuple[str, bool | None]] = []
        for c in CORPORA:
            best, v = f.best_peer(peer_keys, c), f.rate(key, c)
            if not best or not v:
                out.append(("n/a", None))
                continue
            out.append((f"{v / best[1]:.2f}x ({best[0].split('|')[0]})", v / best[1] >= goal))
        return out

    def frac(model: str, key: str) -> list[tuple[str, bool | None]]:
        out: list[tuple[str, bool | None]] = []
        for c in CORPORA:
            x = f.fraction(model, key, c)
            out.append((fmt(x, ".0%"), None if x is None else x >= floor))
        return out

    def ratio(a: str, b: str, goal: float | None = None) -> list[tuple[str, bool | None]]:
        out: list[tuple[str, bool | None]] = []
        for c in CORPORA:
            x, y = f.rate(a, c), f.rate(b, c)
            out.append(
                (f"{x / y:.2f}x" if x and y else "n/a", None if not (x and y and goal) else x / y >= goal)
            )
        return out

    def cos(name: str, goal: float) -> list[tuple[str, bool | None]]:
        out: list[tuple[str, bool | None]] = []
        for c in CORPORA:
            x = f.cosine(name, c)
            out.append((fmt(x, ".6f"), None if x is None else x >= goal))
        return out

    row(f"bulk >= 2x the best peer with min cosine >= {PEER_FLOOR}", vs_peer("ours|bulk-float", PEERS, 2.0))
    row("online >= 1.5x the best peer", vs_peer("ours|online-float", PEERS, 1.5))
    row(f"bulk >= {floor:.0%} of the bf16 matmul bound ({'AMX' if amx else 'no AMX'})",
        frac("encoder", "ours|bulk-float"))  # fmt: skip
    row("default dtype min cosine >= 0.999 vs float32", cos("ours", 0.999))
    row("float32 mode exact (min cosine >= 0.99999 vs sentence-transformers)", cos("ours-exact", 0.99999))
    if "ours-int8|bulk-float" in {k.rsplit("|", 1)[0] for k in f.med}:
        row("--quantization int8 min cosine >= 0.995 vs float32", cos("ours-int8", 0.995))
    if any(k.startswith("dec-") for k in f.med):
        row(
            "decoder bulk >= 2x the best peer with min cosine >= 0.999",
            vs_peer("dec-ours|bulk-float", DECODER_PEERS, 2.0),
        )
        row(f"decoder bulk >= {floor:.0%} of the bound", frac("decoder", "dec-ours|bulk-float"))
        row("decoder default dtype min cosine >= 0.999 vs float32", cos("dec-ours", 0.999))
    lines += ["", "Other ratios:", "", "| ratio | queries | passages |", "|---|---|---|"]
    for name, a, b in [
        ("bulk vs sentence-transformers torch float32", "ours|bulk-float", "st-torch-fp32|encode"),
        ("online vs sentence-transformers torch float32", "ours|online-float", "st-torch-fp32|encode"),
        (
            "float32 bulk vs sentence-transformers torch float32",
            "ours-exact|bulk-float",
            "st-torch-fp32|encode",
        ),
        ("bulk vs Infinity bulk", "ours|bulk-float", "infinity|bulk-float"),
        ("int8 bulk vs default bulk", "ours-int8|bulk-float", "ours|bulk-float"),
        ("int8 online vs default online", "ours-int8|online-float", "ours|online-float"),
        ("online vs Infinity online", "ours|online-float", "infinity|online-float"),
        ("base64 vs float, bulk", "ours|bulk-base64", "ours|bulk-float"),
        ("base64 vs float, online", "ours|online-base64", "ours|online-float"),
    ]:
        cells = ratio(a, b)
        lines.append(f"| {name} | {cells[0][0]} | {cells[1][0]} |")
    lines.append("")
    return lines


def latency_lines(result: dict) -> list[str]:
    lines = ["Latency of single short queries (queries.jsonl, 1 input, one at a time), medians over rounds:"]
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
    return lines


def update_docs(doc: Path, table: str) -> None:
    text = doc.read_text()
    begin, end = "<!-- compare:begin -->", "<!-- compare:end -->"
    a, b = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:a] + "\n" + table + text[b:])
