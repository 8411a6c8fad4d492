"""`embed-service encode INPUT OUTPUT`: embed a file of texts with an `Embedder`, no server in the loop.

In: JSON lines, CSV, Parquet or plain text (one text a line), read in chunks of ``--chunk-rows`` rows;
the text from ``--text-field`` and, with ``--id-field``, an id kept beside each vector (else the row
number). Out: Parquet (an id column and an ``embedding`` column of fixed-size lists) or ``.npy`` (the
(n, D) array, and the ids in ``<stem>.ids.npy``).

Bounded memory: a few chunks are held at a time (read, in the engine, being written), whatever the size of
the input. The chunks go to the engine as bulk requests (engine/admission.py), two in flight so that the
workers never wait for the reader or the writer.

Resumable: each chunk is written as its own Parquet file in ``OUTPUT.parts/`` (to a temporary name, then
renamed: a kill mid-write leaves a temporary file, never half a chunk). A rerun with the same input and
options counts the rows of the parts there, skips that many input rows and goes on; when every row is in,
the parts are joined into OUTPUT (one part at a time, to a temporary name, then renamed) and removed.
``OUTPUT.parts/job.json`` records the input and options, so a rerun with other ones is refused instead of
mixing vectors of two jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embed_service.embedder import Embedder, rebased
from embed_service.engine.errors import EngineError

FORMATS = ("jsonl", "csv", "parquet", "text")
SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
CHUNKS_IN_FLIGHT = 2
ROW_COLUMN = "row"  # the id column when the input names none: the row's number in the input
EMBEDDING_COLUMN = "embedding"
# The settings that change the vectors: a rerun with others is refused (threads, replicas and batch sizes
# do not change them).
RESULT_SETTINGS = ("model", "revision", "dtype", "device", "max_input_length")


class JobError(Exception):
    """A job that cannot run as asked: its one line goes to stderr, the exit code is 2."""


@dataclass
class Chunk:
    first: int  # the row number of texts[0] (rows counted from 0, after skipped blank lines)
    texts: list[str]
    ids: list[Any] | None  # None: the row numbers


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise JobError("Parquet and CSV need pyarrow: pip install 'embed-service[offline]'") from None
    return pyarrow


# --- reading -------------------------------------------------------------------------------------


def input_format(path: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return SUFFIXES[path.suffix.lower()]
    except KeyError:
        raise JobError(
            f"cannot tell the format of {path} from its suffix; give --input-format ({', '.join(FORMATS)})"
        ) from None


def _lines(path: Path) -> Iterator[bytes]:
    """The non-blank lines of a text or JSON-lines file, without their line ends."""
    with open(path, "rb") as f:
        for line in f:
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield line


def _records(
    path: Path, fmt: str, text_field: str, id_field: str | None, chunk_rows: int
) -> Iterator[tuple[list, list | None]]:
    """(texts, ids) in batches of any size, in input order."""
    if fmt == "text":
        batch: list[str] = []
        for line in _lines(path):
            batch.append(line.decode("utf-8"))
            if len(batch) >= chunk_rows:
                yield batch, None
                batch = []
        if batch:
            yield batch, None
        return
    if fmt == "jsonl":
        import orjson

        texts: list[Any] = []
        ids: list[Any] = []
        for n, line in enumerate(_lines(path)):
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise JobError(f"{path}: row {n} is not JSON: {exc}") from None
            if not isinstance(record, dict):
                raise JobError(f"{path}: row {n} is not a JSON object")
            texts.append(record.get(text_field))
            if id_field is not None:
                ids.append(record.get(id_field))
            if len(texts) >= chunk_rows:
                yield texts, ids if id_field is not None else None
                texts, ids = [], []
        if texts:
            yield texts, ids if id_field is not None else None
        return
    columns = [text_field] + ([id_field] if id_field is not None else [])
    for table in _arrow_batches(path, fmt, columns, chunk_rows):
        missing = [c for c in columns if c not in table.schema.names]
        if missing:
            raise JobError(
                f"{path} has no column {missing[0]!r}; its columns: {', '.join(table.schema.names)}"
            )
        yield table.column(text_field).to_pylist(), table.column(id_field).to_pylist() if id_field else None


def _arrow_batches(path: Path, fmt: str, columns: list[str], chunk_rows: int) -> Iterator[Any]:
    pa = _pyarrow()
    if fmt == "parquet":
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        have = f.schema_arrow.names
        missing = [c for c in columns if c not in have]
        if missing:
            raise JobError(f"{path} has no column {missing[0]!r}; its columns: {', '.join(have)}")
        for batch in f.iter_batches(batch_size=chunk_rows, columns=columns):
            yield pa.Table.from_batches([batch])
        return
    import pyarrow.csv as pcsv

    try:
        reader = pcsv.open_csv(path, convert_options=pcsv.ConvertOptions(include_columns=columns))
    except pa.ArrowInvalid as exc:
        raise JobError(f"{path}: {exc}") from None
    for batch in reader:
        yield pa.Table.from_batches([batch])


def count_rows(path: Path, fmt: str, text_field: str) -> int | None:
    """The input's rows, for the progress bar's ETA: Parquet's metadata, else one pass reading only what
    counts (lines, or the CSV's text column)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    if fmt in ("text", "jsonl"):
        return sum(1 for _ in _lines(path))
    try:
        return sum(t.num_rows for t in _arrow_batches(path, fmt, [text_field], 65536))
    except Exception:
        return None


def read_chunks(
    path: Path, fmt: str, text_field: str, id_field: str | None, chunk_rows: int, skip: int
) -> Iterator[Chunk]:
    """The input from row `skip` on, as chunks of exactly `chunk_rows` rows (the last may be shorter):
    chunk boundaries do not depend on how the reader batches, so the parts of a rerun line up."""
    texts: list[Any] = []
    ids: list[Any] = []
    row = 0  # rows read so far
    for batch_texts, batch_ids in _records(path, fmt, text_field, id_field, chunk_rows):
        n = len(batch_texts)
        if row + n <= skip:
            row += n
            continue
        start = max(0, skip - row)
        texts += batch_texts[start:]
        ids += (batch_ids or [])[start:]
        row += n
        while len(texts) >= chunk_rows:
            first = row - len(texts)
            yield _chunk(path, first, texts[:chunk_rows], ids[:chunk_rows] if id_field else None, text_field)
            texts, ids = texts[chunk_rows:], ids[chunk_rows:]
    if texts:
        yield _chunk(path, row - len(texts), texts, ids if id_field else None, text_field)


def _chunk(path: Path, first: int, texts: list[Any], ids: list[Any] | None, field: str) -> Chunk:
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            what = (
                "missing" if text is None else "empty" if text == "" else f"a {type(text).__name__}, not text"
            )
            raise JobError(f"{path}: row {first + i}: the {field!r} field is {what}")
    return Chunk(first, texts, ids)


# --- writing -------------------------------------------------------------------------------------


class Parts:
    """The chunks written so far, one Parquet file each, in OUTPUT.parts/ (see the module docstring)."""

    def __init__(self, output: Path, job: dict[str, Any], overwrite: bool):
        self.output = output
        self.dir = output.with_name(output.name + ".parts")
        if output.exists() and not self.dir.exists() and not overwrite:
            raise JobError(f"{output} exists; --overwrite to replace it")
        if self.dir.exists() and overwrite:
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        record = self.dir / "job.json"
        if record.exists():
            before = json.loads(record.read_text())
            if before != job:
                changed = sorted(k for k in {**before, **job} if before.get(k) != job.get(k))
                raise JobError(
                    f"{self.dir} holds a job with other settings ({', '.join(changed)} differ); rerun with "
                    "the same ones to resume, or --overwrite to start again"
                )
        else:
            _atomic_write(record, json.dumps(job, indent=1, sort_keys=True).encode())
        for stale in self.dir.glob("*.tmp"):  # a write a kill interrupted
            stale.unlink()
        self.files = sorted(self.dir.glob("part-*.parquet"))
        import pyarrow.parquet as pq

        self.rows = sum(pq.read_metadata(f).num_rows for f in self.files)

    def write(self, chunk: Chunk, vectors: np.ndarray, id_name: str) -> None:
        pa = _pyarrow()
        import pyarrow.parquet as pq

        ids = (
            pa.array(chunk.ids)
            if chunk.ids is not None
            else pa.array(range(chunk.first, chunk.first + len(chunk.texts)), pa.int64())
        )
        flat = pa.array(np.ascontiguousarray(vectors).reshape(-1))
        table = pa.table(
            {id_name: ids, EMBEDDING_COLUMN: pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])}
        )
        path = self.dir / f"part-{chunk.first:012d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp)
        _fsync_replace(tmp, path)
        self.files.append(path)
        self.rows += len(chunk.texts)

    def finish(self, kind: str) -> None:
        """Join the parts into OUTPUT (Parquet, or .npy and its ids), then remove them."""
        import pyarrow.parquet as pq

        tmp = self.output.with_name(self.output.name + ".tmp")
        if kind == "parquet":
            writer = None
            for f in self.files:
                table = pq.read_table(f)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
            if writer is None:
                raise JobError("the input has no rows")
            writer.close()
            _fsync_replace(tmp, self.output)
        else:
            metas = [pq.read_metadata(f) for f in self.files]
            if not metas:
                raise JobError("the input has no rows")
            first = pq.read_table(self.files[0])
            vectors = first.column(EMBEDDING_COLUMN).type
            out = np.lib.format.open_memmap(
                tmp, "w+", np.dtype(vectors.value_type.to_pandas_dtype()), (self.rows, vectors.list_size)
            )
            ids: list[Any] = []
            at = 0
            for f in self.files:
                table = pq.read_table(f)
                column = table.column(EMBEDDING_COLUMN).combine_chunks()
                block = column.values.to_numpy(zero_copy_only=False).reshape(len(table), -1)
                out[at : at + len(table)] = block
                ids += table.column(0).to_pylist()
                at += len(table)
            out.flush()
            del out
            ids_path = ids_file(self.output)
            ids_tmp = ids_path.with_name(ids_path.name + ".tmp")
            with open(ids_tmp, "wb") as handle:
                np.save(handle, np.asarray(ids))
            _fsync_replace(ids_tmp, ids_path)
            _fsync_replace(tmp, self.output)  # last: OUTPUT present means the job is done
        shutil.rmtree(self.dir)


def ids_file(output: Path) -> Path:
    """Where a .npy output's ids go: out.npy -> out.ids.npy."""
    return output.with_name(output.stem + ".ids.npy")


def _fsync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    _fsync_replace(tmp, path)


# --- the job -------------------------------------------------------------------------------------


def output_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".npy":
        return "npy"
    raise JobError(f"the output must end in .parquet or .npy, got {path.name}")


class Progress:
    """A tqdm bar in rows, its rate rows/s, with tokens/s beside it and an ETA when the total is known."""

    def __init__(self, total: int | None, done: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total, initial=done, unit="rows", dynamic_ncols=True, disable=not enabled, smoothing=0.1
        )
        self.start = time.monotonic()
        self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


async def _embed_chunks(
    source: Path,
    embedder: Embedder,
    chunks: Iterator[Chunk],
    parts: Parts,
    options: dict[str, Any],
    id_name: str,
    progress: Progress,
) -> None:
    pending: deque[tuple[Chunk, asyncio.Future]] = deque()

    async def write_oldest() -> None:
        chunk, future = pending.popleft()
        try:
            result = await future
        except EngineError as exc:  # the rows are the inputs: name the row, counted from 0 in the input
            raise JobError(f"{source}: {rebased(exc, chunk.first)}") from None
        parts.write(chunk, result.embeddings, id_name)
        progress.update(len(chunk.texts), result.prompt_tokens)

    try:
        for chunk in chunks:
            pending.append((chunk, asyncio.ensure_future(embedder.aembed(chunk.texts, **options))))
            if len(pending) >= CHUNKS_IN_FLIGHT:
                await write_oldest()
        while pending:
            await write_oldest()
    finally:
        for _, future in pending:
            future.cancel()


def run(args: argparse.Namespace, settings: dict[str, Any], embedder: Embedder | None = None) -> int:
    """The job. `settings`: the engine settings given on the command line; `embedder`: one built from them
    already (tests share one), else the job builds its own once the input and output are checked."""
    source, output = Path(args.input), Path(args.output)
    if not source.is_file():
        raise JobError(f"{source}: no such file")
    fmt = input_format(source, args.input_format)
    kind = output_kind(output)
    _pyarrow()  # the parts are Parquet files, whatever the input and the output
    if args.chunk_rows < 1:
        raise JobError("--chunk-rows must be at least 1")
    if fmt == "text" and args.id_field:
        raise JobError(
            "--id-field applies to JSON lines, CSV and Parquet; a text file's ids are its row numbers"
        )
    options = {
        "dimensions": args.dimensions,
        "normalize": args.normalize,
        "prompt_name": args.prompt_name,
        "prompt": args.prompt,
        "truncate": args.truncate,
        "embed_dtype": args.embed_dtype,
    }
    job = {
        "input": str(source.resolve()),
        "input_format": fmt,
        "text_field": args.text_field,
        "id_field": args.id_field,
        "options": options,
        "settings": {k: settings[k] for k in sorted(settings) if k in RESULT_SETTINGS},
    }
    parts = Parts(output, job, args.overwrite)
    total = count_rows(source, fmt, args.text_field) if args.progress else None
    if total is not None and parts.rows > total:
        raise JobError(f"{parts.dir} holds {parts.rows} rows, more than the {total} of {source}")
    owned = embedder is None
    if embedder is None:
        embedder = Embedder(**settings)
    try:
        progress = Progress(total, parts.rows, args.progress)
        try:
            chunks = read_chunks(source, fmt, args.text_field, args.id_field, args.chunk_rows, parts.rows)
            asyncio.run(
                _embed_chunks(source, embedder, chunks, parts, options, args.id_field or ROW_COLUMN, progress)
            )
        finally:
            progress.close()
    finally:
        if owned:
            embedder.close()
    parts.finish(kind)
    print(f"embed-service: wrote {parts.rows} rows to {output}", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The job's own flags (the engine's settings are added beside them by cli.py)."""
    parser.add_argument(
        "input", help="JSON lines (.jsonl), CSV (.csv), Parquet (.parquet) or text (.txt, a text a line)"
    )
    parser.add_argument(
        "output", help="Parquet (.parquet: the id and the embedding per row) or .npy (and <stem>.ids.npy)"
    )
    parser.add_argument("--input-format", choices=FORMATS, help="default: from the input's suffix")
    parser.add_argument("--text-field", default="text", help="the JSON field or column holding the text")
    parser.add_argument(
        "--id-field", help="a JSON field or column to keep beside each vector (default: the row number)"
    )
    parser.add_argument(
        "--chunk-rows", type=int, default=1024, help="rows per chunk: read, embedded and written together"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUTPUT, or a partial job's parts with other settings",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr"
    )
    parser.add_argument("--dimensions", type=int, help="keep the first N features, then normalize")
    parser.add_argument(
        "--normalize", action=argparse.BooleanOptionalAction, default=None, help="default: the model's"
    )
    parser.add_argument("--prompt-name", help="one of the model's named prompts, prepended to each text")
    parser.add_argument("--prompt", help="a raw prefix for each text")
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut texts past the max input length (default: on); --no-truncate: such a text stops the job",
    )
    from embed_service.api.encodings import EMBED_DTYPES

    parser.add_argument(
        "--embed-dtype", choices=EMBED_DTYPES, default="float32", help="the stored type of each value"
    )
