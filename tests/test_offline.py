"""`embed-service encode`: every input format, both outputs, interruption and resume, the progress bar.

The reference is `Embedder.encode` over the same texts (itself equal to the server's, tests/test_embedder.py):
every job's vectors must equal it bit for bit, with the ids in input order. The format tests run the job
in this process on one shared Embedder; the interruption test runs the real command in a subprocess,
SIGKILLs it after a few chunks are written, and reruns it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embed_service import Embedder, cli, offline
from tests.server import read_corpus

# Short texts, some with what trips CSV writers (commas, quotes, a line break), a few hundred rows.
TEXTS = [
    t[:120].replace("\n", " ") + (', "quoted"' if i % 7 == 0 else "")
    for i, t in enumerate(read_corpus("passages.jsonl", 40) + read_corpus("queries.jsonl", 40))
]
IDS = [f"doc-{i:04d}" for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    with Embedder(dtype="float32", data_parallel_size=1) as e:
        yield e


@pytest.fixture(scope="module")
def reference(embedder) -> np.ndarray:
    return embedder.encode(TEXTS)


def write_inputs(folder: Path) -> dict[str, Path]:
    paths = {
        f: folder / name for f, name in [("jsonl", "in.jsonl"), ("csv", "in.csv"), ("parquet", "in.parquet")]
    }
    with open(paths["jsonl"], "w") as f:
        for i, t in zip(IDS, TEXTS):
            f.write(json.dumps({"id": i, "body": t, "other": 1}) + "\n")
            if i.endswith("3"):
                f.write("\n")  # blank lines are not rows
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "body"])
        w.writerows(zip(IDS, TEXTS))
    table = pa.table({"other": range(len(TEXTS)), "body": TEXTS, "id": IDS})
    pq.write_table(table, paths["parquet"], row_group_size=50)  # row groups that do not line up with chunks
    return paths


def job(embedder: Embedder | None, *argv: str) -> int:
    args = cli.build_parser().parse_args(["encode", *argv])
    settings = {k: v for k, v in vars(args).items() if k in cli.ENCODE_SETTINGS}
    return offline.run(args, settings, embedder)


def read_parquet(path: Path, id_name: str = "id") -> tuple[list, np.ndarray]:
    table = pq.read_table(path)
    vectors = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    return table.column(id_name).to_pylist(), vectors


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_input_format_to_parquet(embedder, reference, tmp_path, fmt):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "out.parquet"
    job(
        embedder,
        str(inputs[fmt]),
        str(out),
        "--text-field",
        "body",
        "--id-field",
        "id",
        "--chunk-rows",
        "32",
        "--no-progress",
    )
    ids, vectors = read_parquet(out)
    assert ids == IDS
    assert vectors.dtype == np.float32 and vectors.tobytes() == reference.tobytes()
    assert not (tmp_path / "out.parquet.parts").exists()


def test_text_input_to_npy_with_options(embedder, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS[:50]) + "\n\n")
    out = tmp_path / "out.npy"
    job(embedder, str(source), str(out), "--dimensions", "64", "--embed-dtype", "int8", "--no-progress")
    same = embedder.encode(TEXTS[:50], dimensions=64, embed_dtype="int8")
    vectors = np.load(out)
    assert vectors.dtype == np.int8 and vectors.tobytes() == same.tobytes()
    assert np.load(offline.ids_file(out)).tolist() == list(range(50))  # a text file's ids: its row numbers


def test_refusals(embedder, tmp_path):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "out.parquet"
    with pytest.raises(offline.JobError, match="no column 'text'"):
        job(embedder, str(inputs["parquet"]), str(out), "--no-progress")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ""}\n')
    with pytest.raises(offline.JobError, match="line 2: the 'text' field is empty"):
        job(embedder, str(bad), str(tmp_path / "bad.parquet"), "--no-progress")
    with pytest.raises(offline.JobError, match=r"must end in \.parquet or \.npy"):
        job(embedder, str(bad), str(tmp_path / "out.csv"))
    long = tmp_path / "long.jsonl"
    long.write_text('{"text": "short"}\n' * 5 + json.dumps({"text": "word " * 400}) + "\n")
    with pytest.raises(offline.JobError, match="line 6 has more than the maximum of 256 tokens"):
        job(
            embedder,
            str(long),
            str(tmp_path / "long.parquet"),
            "--no-truncate",
            "--chunk-rows",
            "4",
            "--no-progress",
        )


def test_a_rerun_with_other_options_is_refused(embedder, tmp_path):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    parts.mkdir()
    args = [str(inputs["jsonl"]), str(out), "--text-field", "body", "--no-progress"]
    with pytest.raises(offline.JobError, match="exists"):  # a finished output is not overwritten
        out.write_bytes(b"")
        parts.rmdir()
        job(embedder, *args)
    out.unlink()
    job(embedder, *args, "--chunk-rows", "200")  # one chunk, finished: parts removed
    parts.mkdir()
    (parts / "job.json").write_text(json.dumps({"input": "another"}))
    out.unlink()
    with pytest.raises(offline.JobError, match="other settings"):
        job(embedder, *args)


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "embed_service", "encode", *argv]


def test_killed_then_resumed_equals_an_uninterrupted_run(embedder, reference, tmp_path):
    inputs = write_inputs(tmp_path)
    argv = ["--text-field", "body", "--id-field", "id", "--chunk-rows", "8", "--dtype", "float32"]

    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    run = [*command(str(inputs["jsonl"]), str(out), *argv), "--data-parallel-size", "1"]
    proc = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(parts.glob("part-*.parquet"))) < 3:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no chunks written in 120 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its workers, mid-run
        proc.wait(30)
    assert not out.exists()
    written = sorted(parts.glob("part-*.parquet"))
    done = sum(pq.read_metadata(p).num_rows for p in written)  # every complete part is whole
    assert 0 < done < len(TEXTS)
    (parts / "part-999999999999.parquet.tmp").write_bytes(b"PAR1 half a row group")  # a write cut short

    rerun = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    ids, vectors = read_parquet(out)
    assert ids == IDS  # nothing twice, nothing missing, in input order
    # What an uninterrupted job writes (the tests above), to what is guaranteed: a vector's bits depend on
    # the batch it was computed in (the rows padded beside it), and the resumed job batches the rows after
    # the kill differently from the uninterrupted one. Equal bytes would need batch-invariant kernels.
    assert vectors.dtype == np.float32 and vectors.shape == reference.shape
    cosine = (vectors * reference).sum(1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.99999 and np.abs(vectors - reference).max() <= 1e-5
    assert not parts.exists()

    # The rerun's progress bar: started at the rows already written, rows/s, tokens/s and an ETA.
    bar = rerun.stderr
    assert f"{done}/{len(TEXTS)}" in bar and f"{len(TEXTS)}/{len(TEXTS)}" in bar
    assert "rows/s" in bar and "tokens/s" in bar and "<00:" in bar
