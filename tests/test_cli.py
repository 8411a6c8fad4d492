"""The command line: flags, EMBED_* variables, and refusals at start-up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from embed_service.config import Settings
from tests.server import ServerProcess, refusal


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
    assert r.returncode == 2 and "EMBED_MAX_BATCH_REQUESTS='0': must be at least 1" in r.stderr


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--max-input-length", "-5", "must be at least 1"),
        ("--data-parallel-size", "0", "must be at least 1"),
        ("--num-threads", "-1", "must be at least 1"),
        ("--drain-timeout", "-1", "0 or more"),
        ("--drain-timeout", "nan", "0 or more"),
        ("--priority-max-tokens", "-1", "0 or more"),
    ],
)
def test_out_of_range_flags_are_one_line_naming_the_flag(flag, value, why):
    line = refusal(flag, value, timeout=60)
    assert line.startswith(f"embed-service: {flag} ") and why in line


@pytest.mark.parametrize(
    "variable, value, why",
    [
        ("EMBED_PORT", "abc", "valid integer"),
        ("EMBED_NUM_THREADS", "-2", "must be at least 1"),
        ("EMBED_AUTO_TRUNCATE", "maybe", "valid boolean"),
        ("EMBED_SERVED_MODEL_NAME", '["unclosed"', "Expecting"),
        ("EMBED_SERVED_MODEL_NAME", "a,a", "distinct"),
    ],
)
def test_invalid_variables_are_one_line_naming_the_variable(variable, value, why):
    line = refusal(env={variable: value}, timeout=60)
    assert line.startswith(f"embed-service: {variable}=") and why in line


@pytest.mark.parametrize(
    "value, names",
    [("a", ["a"]), ("a,b", ["a", "b"]), (" a , b ,", ["a", "b"]), ('["a", "b"]', ["a", "b"]), ("", [])],
)
def test_served_model_name_variable_takes_one_name_or_a_comma_list(monkeypatch, value, names):
    monkeypatch.setenv("EMBED_SERVED_MODEL_NAME", value)
    assert Settings().served_model_name == names


def test_served_model_name_flag_is_repeatable_and_wins_over_the_variable(monkeypatch):
    from embed_service.cli import build_parser

    monkeypatch.setenv("EMBED_SERVED_MODEL_NAME", "from-env")
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "--served-model-name", "b,c"])
    values = {k: v for k, v in vars(args).items() if k != "command"}
    assert Settings(**values).served_model_name == ["a", "b", "c"]


def test_list_variables_get_past_the_settings_in_the_server():
    # The comma form used to crash in pydantic-settings before any validator ran. With the port taken,
    # the server gets past its settings and stops at the bind: no model needed.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for value in ("a", "a,b"):
            line = refusal("--port", str(port), env={"EMBED_SERVED_MODEL_NAME": value}, timeout=60)
            assert "cannot listen on 127.0.0.1" in line


def test_missing_model_directory_is_refused(tmp_path):
    r = run_cli("serve", "--model", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "no such directory" in r.stderr


def test_flags_env_and_aliases(default_model_path, tmp_path):
    link = tmp_path / "my-minilm"
    link.symlink_to(default_model_path)
    # The names in the documented comma form of the variable (the repeated flag: the test below).
    env = {
        "EMBED_MAX_INPUT_LENGTH": "128",
        "EMBED_AUTO_TRUNCATE": "false",
        "EMBED_SERVED_MODEL_NAME": "first,second",
    }
    with ServerProcess("--model", str(link), "--dtype", "float32", env=env) as s:
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
