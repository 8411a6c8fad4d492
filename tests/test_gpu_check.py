"""benchmarks/gpu_check.sh, the command a lent GPU runs, proven on the CPU with --cpu-dry-run: every step runs
(kernel tests, attention backends, the fidelity check, in-process and HTTP throughput for an encoder and a
decoder written with random weights) and one JSON summary comes out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_dry_run_prints_one_passing_summary(tmp_path):
    pytest.importorskip("triton", reason="the kernel step needs triton (the dev extra)")
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run", "--out", str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["dry_run"] and summary["ok"] and summary["kernels"]["passed"]
    assert {r["case"] for r in summary["attention"]} == {
        "encoder",
        "decoder-gqa-causal",
        "sliding-window-causal",
    }
    for kind in ("encoder", "decoder"):
        model = summary["models"][kind]
        assert [r["input_tokens"] for r in model["in_process"]] == [32, 128]
        assert all(r["tokens_per_s"] > 0 for r in model["in_process"])
        (http,) = model["http"]
        assert http["fidelity"]["passed"] and http["fidelity"]["min_cosine"] >= 0.999
        assert http["kernels"] and http["attention"]
        for load in http["loads"]:
            assert load["errors"] == 0 and load["embeddings_per_s"] > 0
            # The corpus is cut to the length asked for, by the model's own tokenizer.
            assert abs(load["tokens_per_s"] / load["embeddings_per_s"] - load["input_tokens"]) <= 2
