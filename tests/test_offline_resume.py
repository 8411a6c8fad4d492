"""`embed-service encode`'s resume keeps one job's vectors: a rerun over an input whose rows are not the ones
already embedded is refused (an input reversed in place, even with its size and mtime put back); ids keep
one type for the whole job, refused at the chunk that breaks it rather than at the final join; a job that
stops names the row as the user finds it and says what a rerun does.

The jobs run in this process on one shared Embedder (float32, one replica); a job is stopped part way by a
row the job refuses (an empty text), which keeps the chunks before it.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from embed_service import Embedder, cli, offline
from tests.server import read_corpus

TEXTS = [t[:100] for t in read_corpus("passages.jsonl", 30) + read_corpus("queries.jsonl", 30)]


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    with Embedder(dtype="float32", data_parallel_size=1) as e:
        yield e


def job(embedder: Embedder, *argv: str) -> int:
    args = cli.build_parser().parse_args(["encode", *argv, "--no-progress"])
    flags = {k: v for k, v in vars(args).items() if k in cli.ENCODE_SETTINGS}
    return offline.run(args, flags, embedder)  # the embedder's settings count


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_of(texts: list[str]) -> list[dict]:
    return [{"id": f"doc-{i:03d}", "text": t} for i, t in enumerate(texts)]


def test_an_input_reversed_in_place_is_refused_even_with_its_size_and_mtime_back(embedder, tmp_path):
    """The issue's `tac`: a job stopped after two chunks, its input reversed in place and the job rerun,
    used to resume and write every row with ids of both orders."""
    rows = rows_of(TEXTS)
    rows[20]["text"] = ""  # stops the job at line 21, after the chunks of lines 1-16
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    argv = [str(source), str(out), "--id-field", "id", "--chunk-rows", "8"]
    with pytest.raises(offline.JobError):  # what it says: test_ids_keep_one_type_for_the_job
        job(embedder, *argv)
    stat = source.stat()
    write_jsonl(source, rows[::-1])  # tac: the same lines in another order, the same size
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(offline.JobError, match="in.jsonl changed since the job began: its first 16 rows"):
        job(embedder, *argv)
    assert not out.exists() and len(list((tmp_path / "out.parquet.parts").glob("part-*"))) == 2

    rows[20]["text"] = "fixed"
    write_jsonl(source, rows)  # the input as it was, line 21 fixed: the job resumes and every row is once
    job(embedder, *argv)
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [r["id"] for r in rows]
    vectors = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    expected = embedder.encode([r["text"] for r in rows])
    assert np.abs(vectors - expected).max() <= 1e-5  # see test_offline.py's resume test for why not bytes


def test_a_rerun_names_what_changed_in_the_input(embedder, tmp_path):
    rows = rows_of(TEXTS[:30])
    rows[20]["text"] = ""
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    with pytest.raises(offline.JobError):
        job(embedder, str(source), str(out), "--chunk-rows", "8")
    write_jsonl(source, rows_of([t.upper() for t in TEXTS[:30]]))  # the same rows, edited
    with pytest.raises(offline.JobError, match=r"changed since the job began \(.*modified .* then, .* now"):
        job(embedder, str(source), str(out), "--chunk-rows", "8")


def test_ids_keep_one_type_for_the_job(embedder, tmp_path):
    """Integer ids, then string ones in the sixth chunk: refused there, naming its first line, before that
    chunk is embedded (it used to fail at the final join, after all the work, and on every rerun)."""
    rows = [{"id": i if not 40 <= i < 48 else f"x{i}", "text": t} for i, t in enumerate(TEXTS)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    argv = [str(source), str(out), "--id-field", "id", "--chunk-rows", "8"]
    message = (
        r"line 41: the 'id' field is a string \('x40'\), where the ids before it are integers: "
        r"one id type per job; .* keeps the 40 rows written: the same command resumes after them"
    )
    with pytest.raises(offline.JobError, match=message):
        job(embedder, *argv)
    rows = [{"id": i, "text": t} for i, t in enumerate(TEXTS)]
    write_jsonl(source, rows)
    job(embedder, *argv)  # resumes after the 40 rows, with integer ids
    assert pq.read_table(out).column("id").to_pylist() == list(range(len(TEXTS)))


def test_mixed_ids_within_the_first_chunk_are_refused(embedder, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "x"}, {"id": 2, "text": "y"}])
    with pytest.raises(offline.JobError, match="line 2: the 'id' field is a number .* are strings"):
        job(embedder, str(source), str(tmp_path / "out.parquet"), "--id-field", "id")
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"id": "a", "text": "x"}, {"text": "y"}])
    with pytest.raises(offline.JobError, match="line 2: the 'id' field is missing; nothing was written"):
        job(embedder, str(missing), str(tmp_path / "out2.parquet"), "--id-field", "id")
    assert not (tmp_path / "out2.parquet.parts").exists()  # nothing to resume: nothing left behind


def test_rows_are_named_as_the_user_finds_them(embedder, tmp_path):
    """Text and JSON lines: the line, from 1, blank lines counted. CSV and Parquet: the row, from 1."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "fine"}\n\n{"text": 42}\n')
    with pytest.raises(offline.JobError, match="in.jsonl: line 3: the 'text' field is a number, not text"):
        job(embedder, str(source), str(tmp_path / "a.parquet"))
    table = tmp_path / "in.csv"
    with open(table, "w", newline="") as f:
        csv.writer(f).writerows([["text"], ["one"], ["two"], [""]])
    with pytest.raises(offline.JobError, match="in.csv: row 3: the 'text' field is"):
        job(embedder, str(table), str(tmp_path / "b.parquet"))
    long = tmp_path / "long.txt"
    long.write_text("short\n\n" + "word " * 400 + "\n")
    with pytest.raises(offline.JobError, match="long.txt: line 3 has more than the maximum of 256 tokens"):
        job(embedder, str(long), str(tmp_path / "c.parquet"), "--no-truncate")
