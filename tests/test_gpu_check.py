"""benchmarks/gpu_check.sh, the command a lent GPU runs, proven on the CPU.

--cpu-dry-run: every step runs (kernel tests, attention backends, CUDA graph layout and its replay check,
the fidelity check through it, in-process and HTTP throughput for an encoder and a decoder written with
random weights and the carried tokenizers) and the JSON summary is on disk after every step.
--prepare --no-download: the carried set's size accounting, its limit and the device command, offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from benchmarks import gpu_prepare, gpu_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.sh")


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SCRIPT, *args],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_cpu_dry_run_prints_one_passing_summary(tmp_path):
    pytest.importorskip("triton", reason="the kernel step needs triton (the dev extra)")
    out = tmp_path / "summary.json"
    run = script("--cpu-dry-run", "--out", str(out), timeout=960)  # past the dry run's own 900 s budget
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["dry_run"] and summary["ok"] and summary["kernels"]["passed"]
    assert summary["environment"]["requirements_ok"]
    assert [s["status"] for s in summary["steps"]] == ["ok"] * 10, summary["steps"]
    assert {r["case"] for r in summary["attention"]} == {
        "encoder",
        "decoder-gqa-causal",
        "sliding-window-causal",
    }
    for row in summary["attention"]:
        assert set(row["backends"]) == {"default", "sdpa"} and row["agree"]
    for kind in ("encoder", "decoder"):
        model = summary["models"][kind]
        graphs = model["cuda_graphs"]
        assert graphs["agree"] and not graphs["captured"] and "not CUDA" in graphs["skipped"]
        assert graphs["replay_check"]["steps_checked"] == graphs["steps"]
        assert graphs["fidelity_replayed"]["passed"] and graphs["fidelity_eager"]["passed"]
        assert [r["input_tokens"] for r in model["in_process"]] == [32, 128]
        assert all(r["tokens_per_s"] > 0 for r in model["in_process"])
        (http,) = model["http"]
        assert http["fidelity"]["passed"] and http["fidelity"]["min_cosine"] >= 0.999
        assert http["kernels"] and http["attention"] and "not CUDA" in http["cuda_graphs"]["off"]
        for load in http["loads"]:
            assert load["errors"] == 0 and load["embeddings_per_s"] > 0
            # The corpus is cut to the length asked for, by the model's own tokenizer (the decoder's
            # appends its end-of-text token).
            assert abs(load["tokens_per_s"] / load["embeddings_per_s"] - load["input_tokens"]) <= 2


def test_prepare_accounts_for_the_carried_set_and_prints_the_device_command(tmp_path):
    carry = tmp_path / "carry"
    wheel = carry / "wheels" / "fastapi-0.165.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"\0" * 1_000_000)
    run = script("--prepare", str(carry), "--no-download")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads(run.stdout.strip().splitlines()[0])
    assert manifest == json.loads((carry / "manifest.json").read_text())
    files = [f for f in carry.rglob("*") if f.is_file() and f.name != "manifest.json"]
    assert manifest["carry_bytes"] == sum(f.stat().st_size for f in files)
    assert manifest["carry_bytes"] < 56 << 20 and manifest["travel_mib"] < 64
    # What the device image lacks (the list), at the versions installed here; nothing it has.
    pins = manifest["packages"]
    assert {"fastapi", "uvicorn", "httptools", "pydantic", "pydantic-settings", "orjson"} <= set(pins)
    assert not (set(pins) & (gpu_prepare.DEVICE_PACKAGES - gpu_prepare.ALWAYS_CARRY))
    assert manifest["wheels"] == [wheel.name] and "fastapi" not in manifest["missing_wheels"]
    # The device command names this folder, and the carry list is it.
    call = manifest["run"]
    assert call["carry"] == [str(carry)] and f"--carried {carry} " in call["command"]
    assert "$OUT/summary.json" in call["command"] and call["timeout_s"] <= 600
    assert f"command:   {call['command']}" in run.stderr and json.dumps([str(carry)]) in run.stderr
    # The decoder's tokenizer is small, byte-level, and loads as the server loads it.
    from transformers import AutoTokenizer

    decoder = AutoTokenizer.from_pretrained(str(carry / "tokenizers" / "decoder"))
    assert decoder.is_fast and len(decoder) <= gpu_prepare.DECODER_VOCAB
    assert decoder.decode(decoder("héllo wörld")["input_ids"]).strip() == "héllo wörld"
    assert sum(f.stat().st_size for f in (carry / "tokenizers").rglob("*")) < 2 << 20


def test_prepare_refuses_a_carried_set_over_56_mib(tmp_path):
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    with open(carry / "wheels" / "big-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(56 << 20)  # sparse: its size counts, no disk is written
    run = script("--prepare", str(carry), "--no-download")
    assert run.returncode == 1
    assert "limit 56" in run.stderr and json.loads(run.stdout.splitlines()[0])["carry_mib"] > 56


def test_a_step_past_its_limit_is_stopped_and_the_summary_is_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "STEP_LIMITS", {"short": 0.5, "long": 3600})
    monkeypatch.setattr(gpu_run, "MIN_STEP_S", 0.1)
    out = tmp_path / "summary.json"
    run = gpu_run.Run({"device": "cpu"}, out, budget_s=3600)
    never = threading.Event()
    assert run.step("stuck", "short", never.wait) is None  # stopped by its limit, not by an event
    assert run.step("fine", "long", lambda: 42) == 42
    assert run.step("broken", "long", lambda: 1 / 0) is None
    steps = json.loads(out.read_text())["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [
        ("stuck", "timeout"),
        ("fine", "ok"),
        ("broken", "failed"),
    ]
    assert "ZeroDivisionError" in steps[2]["error"]
    run.deadline = 0  # the budget spent: later steps are skipped, and say so
    assert run.step("late", "long", lambda: 42) is None
    assert json.loads(out.read_text())["steps"][-1]["status"] == "skipped"
