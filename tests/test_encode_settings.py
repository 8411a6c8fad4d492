"""`embed-service encode` and `Embedder()` take their settings from every route the docs give: keyword
arguments and flags, a --config file, and the EMBED_* variables (docs/python.md, docs/offline.md), with the
same precedence as `serve`. Each route is checked by what the vectors are: a tiny random model given only
through that route must produce sentence-transformers' vectors for that model (64 wide, where the packaged
default is 384), and a max input length given only through a variable must produce sentence-transformers'
vectors at that length. A resumed job's job.json records what the settings resolved to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import transformers

from embed_service import Embedder
from tests.models.tiny import Tiny, build, st_reference
from tests.server import read_corpus

TEXTS = read_corpus("passages.jsonl", 12) + read_corpus("queries.jsonl", 12)
TINY = Tiny(
    "bert",
    "BertModel",
    lambda: transformers.BertConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=30522,
        max_position_embeddings=130,
    ),
    tokenizer="wordpiece",
    pooling="mean",
    normalize=True,
    max_seq_length=128,
)
# Both sides in float32; the engine's kernels and sentence-transformers' differ in summation order only.
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path) -> Path:
    return build(TINY, tmp_path_factory.mktemp("tiny") / "tiny-bert", {"wordpiece": default_model_path})


@pytest.fixture(scope="module")
def tiny_reference(tiny) -> np.ndarray:
    return st_reference(tiny, TEXTS)


def clean_env(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("EMBED_"):
            monkeypatch.delenv(name)


# --- Embedder() ---------------------------------------------------------------------------------------


def test_embedder_takes_the_model_from_EMBED_MODEL(monkeypatch, tiny, tiny_reference):
    clean_env(monkeypatch)
    monkeypatch.setenv("EMBED_MODEL", str(tiny))
    with Embedder(dtype="float32", data_parallel_size=1) as e:
        assert e.info["model_path"] == str(tiny) and e.dimension == 64
        np.testing.assert_allclose(e.encode(TEXTS), tiny_reference, atol=ATOL)


def test_embedder_takes_other_EMBED_variables_and_an_argument_wins(monkeypatch, default_model_path):
    from sentence_transformers import SentenceTransformer

    clean_env(monkeypatch)
    monkeypatch.setenv("EMBED_MAX_INPUT_LENGTH", "32")
    monkeypatch.setenv("EMBED_MAX_BATCH_TOKENS", "1000")
    monkeypatch.setenv("EMBED_DATA_PARALLEL_SIZE", "1")
    monkeypatch.setenv("EMBED_DTYPE", "bfloat16")  # the argument below wins
    with Embedder(dtype="float32") as e:
        info = e.info
        assert (info["max_input_length"], info["max_batch_tokens"], info["dtype"]) == (32, 1000, "float32")
        assert len(info["replicas"]) == 1
        got = e.encode(TEXTS)
    model = SentenceTransformer(str(default_model_path), device="cpu")
    model.max_seq_length = 32
    np.testing.assert_allclose(got, model.encode(TEXTS, convert_to_numpy=True), atol=ATOL)


# --- embed-service encode ---------------------------------------------------------------------------------


def encode(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EMBED_")}
    return subprocess.run(
        [sys.executable, "-m", "embed_service", "encode", *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **env},
    )


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def vectors_of(path: Path) -> tuple[list, np.ndarray]:
    table = pq.read_table(path)
    return table.column(0).to_pylist(), np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def test_encode_takes_EMBED_variables_records_them_and_resumes_only_with_them(tmp_path, tiny, tiny_reference):
    """EMBED_MODEL and EMBED_DTYPE only. A job stopped by a bad last line keeps its parts and says so, and
    its job.json records what the settings resolved to; a rerun with another EMBED_DTYPE is refused (it
    would mix vectors of two dtypes); once the line is fixed, the same settings resume and finish."""
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    with open(source, "a") as f:
        f.write('{"id": "bad", "text": ""}\n')
    out = tmp_path / "out.parquet"
    argv = [str(source), str(out), "--id-field", "id", "--chunk-rows", "8"]
    env = {"EMBED_MODEL": str(tiny), "EMBED_DTYPE": "float32", "EMBED_DATA_PARALLEL_SIZE": "1"}

    first = encode(*argv, env=env)
    assert first.returncode == 2, first.stderr
    line = first.stderr.strip().splitlines()[-1]
    assert f"line {len(TEXTS) + 1}: the 'text' field is empty" in line
    assert f"keeps the {len(TEXTS)} rows written: the same command resumes after them" in line
    job = json.loads((tmp_path / "out.parquet.parts" / "job.json").read_text())
    assert job["engine"]["model_path"] == str(tiny) and job["engine"]["dtype"] == "float32"
    assert job["engine"]["dimension"] == 64 and job["requested"]["model"] == str(tiny)

    source.write_text(source.read_text().replace('"text": ""', '"text": "fixed"'))
    other = encode(*argv, env={**env, "EMBED_DTYPE": "bfloat16"})
    assert other.returncode == 2 and "dtype: 'float32' then, 'bfloat16' now" in other.stderr, other.stderr

    resumed = encode(*argv, env=env)
    assert resumed.returncode == 0, resumed.stderr
    ids, vectors = vectors_of(out)
    assert ids == [f"d{i}" for i in range(len(TEXTS))] + ["bad"]
    np.testing.assert_allclose(vectors[:-1], tiny_reference, atol=ATOL)
    np.testing.assert_allclose(vectors[-1], st_reference(tiny, ["fixed"])[0], atol=ATOL)


@pytest.mark.parametrize("route", ["flag", "EMBED_CONFIG"])
def test_encode_takes_a_config_file(tmp_path, tiny, tiny_reference, route):
    config = tmp_path / "embed.yaml"
    config.write_text(f"model: {tiny}\ndtype: float32\ndata_parallel_size: 1\n")
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "out.parquet"
    if route == "flag":
        r = encode(str(source), str(out), "--config", str(config), env={})
    else:
        r = encode(str(source), str(out), env={"EMBED_CONFIG": str(config)})
    assert r.returncode == 0, r.stderr
    _, vectors = vectors_of(out)
    np.testing.assert_allclose(vectors, tiny_reference, atol=ATOL)


def test_encode_flags_win_over_the_config_file(tmp_path, tiny, default_model_path):
    config = tmp_path / "embed.toml"
    config.write_text(f'model = "{default_model_path}"\nmax_input_length = 16\n')
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS[:4])
    out = tmp_path / "out.parquet"
    argv = ["--config", str(config), "--model", str(tiny), "--dtype", "float32"]
    r = encode(str(source), str(out), *argv, "--data-parallel-size", "1", env={})
    assert r.returncode == 0, r.stderr
    _, vectors = vectors_of(out)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(tiny), device="cpu")
    model.max_seq_length = 16  # from the file: the flags named only the model and the dtype
    np.testing.assert_allclose(vectors, model.encode(TEXTS[:4], convert_to_numpy=True), atol=ATOL)


def test_encode_refuses_a_config_file_of_several_models(tmp_path, tiny, default_model_path):
    config = tmp_path / "embed.yaml"
    config.write_text(f"models:\n  - {tiny}\n  - {default_model_path}\n")
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS[:2])
    r = encode(str(source), str(tmp_path / "out.parquet"), "--config", str(config), env={})
    assert r.returncode == 2 and "encode embeds with one model, the file lists several" in r.stderr
