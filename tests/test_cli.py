"""The command line: flags, EMBED_* variables, and refusals at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.server import ServerProcess


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embed_service", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_flag_with_its_variable():
    out = run_cli("serve", "--help").stdout
    for flag in (
        "--model",
        "--served-model-name",
        "--max-batch-tokens",
        "--no-auto-truncate",
        "--api-key",
        "--tensor-parallel-size",
        "--dtype",
    ):
        assert flag in out
    assert "EMBED_MAX_BATCH_TOKENS" in out


def test_batch_budget_below_max_length_is_refused_at_startup():
    r = run_cli("serve", "--max-batch-tokens", "100")
    assert r.returncode != 0
    assert "max-batch-tokens" in r.stderr and "256" in r.stderr


def test_bad_values_are_refused():
    r = run_cli("serve", "--dtype", "float8")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = run_cli("serve", env={"EMBED_MAX_BATCH_REQUESTS": "0"})
    assert r.returncode == 2 and "max-batch-requests" in r.stderr


def test_missing_model_directory_is_refused(tmp_path):
    r = run_cli("serve", "--model", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "no such directory" in r.stderr


def test_flags_env_and_aliases(default_model_path, tmp_path):
    link = tmp_path / "my-minilm"
    link.symlink_to(default_model_path)
    env = {"EMBED_MAX_INPUT_LENGTH": "128", "EMBED_AUTO_TRUNCATE": "false"}
    with ServerProcess(
        "--model",
        str(link),
        "--served-model-name",
        "first",
        "--served-model-name",
        "second",
        "--dtype",
        "float32",
        env=env,
    ) as s:
        info = httpx.get(s.url + "/info").json()
        assert info["model"] == "first" and info["served_model_names"] == ["first", "second"]
        assert info["max_input_length"] == 128 and info["auto_truncate"] is False
        assert info["dtype"] == "float32" and info["device"] == "cpu" and info["dimension"] == 384
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["first", "second"]
        a = httpx.post(s.url + "/v1/embeddings", json={"input": "x", "model": "second"}).json()
        assert a["model"] == "second"
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "word " * 200})
        assert r.status_code == 400  # auto-truncate off from the environment, 128 tokens max


def test_directory_name_is_the_default_served_name(default_model_path, tmp_path):
    link = tmp_path / "named-by-directory"
    link.symlink_to(default_model_path)
    with ServerProcess("--model", str(link)) as s:
        info = httpx.get(s.url + "/info").json()
        assert info["model"] == "named-by-directory"
        # --dtype auto: bfloat16 on CPUs with AMX / AVX512-BF16, else float32.
        flags = open("/proc/cpuinfo").read()
        assert info["dtype"] == ("bfloat16" if ("amx_bf16" in flags or "avx512_bf16" in flags) else "float32")
