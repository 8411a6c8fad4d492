"""The input of `embed-service encode` (offline.py): its rows read in blocks, each row named as a user finds it,
the ids given one type for the whole job, and a running hash of what was read, so that a resumed job can
tell whether the rows it skips are the rows it embedded.

- Rows are named by their line (from 1, blank lines counted: what an editor or ``sed -n Np`` shows) in text
  and JSON-lines files, and by their row from 1 (the header not counted) in CSV and Parquet files. Only the
  default id column, ``row``, counts rows from 0, as array indices do.
- An id column has one Arrow type per job: the first block's (or, when resuming, the parts'); a row whose id
  does not convert to it, or has none, stops the job at its block, before that block is embedded.
- The hash (SHA-256) covers each row's text and id in order; a part records it as of its last row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

FORMATS = ("jsonl", "csv", "parquet", "text")
SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
LINE_FORMATS = ("jsonl", "text")


class JobError(Exception):
    """A job that cannot run as asked: its one line goes to stderr, the exit code is 2."""


class OtherJobError(JobError):
    """OUTPUT.parts/ holds another job's rows (other settings, another input): the message says what to do."""


def pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise JobError("Parquet and CSV need pyarrow: pip install 'embed-service[offline]'") from None
    return pyarrow


@dataclass
class Block:
    first: int  # the index of texts[0] among the input's rows (from 0, blank lines not rows)
    texts: list[Any]  # the rows' inputs: texts, or images (a path, bytes) for an --image-field job
    ids: Any  # a pyarrow Array of the job's id type, or None: the row indices are the ids
    digest: str  # the hash of every row read up to this block's last, hex
    lines: list[int] | None  # each row's line, for text and JSON lines

    def where(self, i: int) -> str:
        """Row `i` of the block, as the user finds it in the input."""
        return f"line {self.lines[i]}" if self.lines is not None else f"row {self.first + i + 1}"


def input_format(path: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return SUFFIXES[path.suffix.lower()]
    except KeyError:
        raise JobError(
            f"cannot tell the format of {path} from its suffix; give --input-format ({', '.join(FORMATS)})"
        ) from None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of each non-blank line of a text or JSON-lines file, without its end."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield number, line


Batch = tuple[list[Any], list[Any] | None, list[int] | None]  # texts, ids, lines


def _records(path: Path, fmt: str, text_field: str, id_field: str | None, size: int) -> Iterator[Batch]:
    """(texts, ids, lines) in batches of about `size` rows, in input order."""
    if fmt in LINE_FORMATS:
        texts: list[Any] = []
        ids: list[Any] = []
        lines: list[int] = []
        for number, line in _lines(path):
            if fmt == "text":
                texts.append(line.decode("utf-8"))
            else:
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise JobError(f"{path}: line {number} is not JSON: {exc}") from None
                if not isinstance(record, dict):
                    raise JobError(f"{path}: line {number} is not a JSON object")
                texts.append(record.get(text_field))
                if id_field is not None:
                    ids.append(record.get(id_field))
            lines.append(number)
            if len(texts) >= size:
                yield texts, ids if id_field is not None else None, lines
                texts, ids, lines = [], [], []
        if texts:
            yield texts, ids if id_field is not None else None, lines
        return
    columns = [text_field] + ([id_field] if id_field is not None else [])
    for table in arrow_batches(path, fmt, columns, size):
        missing = [c for c in columns if c not in table.schema.names]
        if missing:
            raise JobError(
                f"{path} has no column {missing[0]!r}; its columns: {', '.join(table.schema.names)}"
            )
        column_ids = table.column(id_field).to_pylist() if id_field else None
        yield table.column(text_field).to_pylist(), column_ids, None


def arrow_batches(path: Path, fmt: str, columns: list[str], size: int) -> Iterator[Any]:
    pa = pyarrow()
    if fmt == "parquet":
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        have = f.schema_arrow.names
        missing = [c for c in columns if c not in have]
        if missing:
            raise JobError(f"{path} has no column {missing[0]!r}; its columns: {', '.join(have)}")
        for batch in f.iter_batches(batch_size=size, columns=columns):
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
    if fmt in LINE_FORMATS:
        return sum(1 for _ in _lines(path))
    try:
        return sum(t.num_rows for t in arrow_batches(path, fmt, [text_field], 65536))
    except Exception:
        return None


def _hash_rows(h: Any, texts: list[Any], ids: list[Any] | None) -> None:
    for i, text in enumerate(texts):
        h.update(orjson.dumps([text, ids[i] if ids is not None else None], default=str))
        h.update(b"\n")


class Reader:
    """The input from row `skip` on, as blocks of exactly `chunk_rows` rows (the last may be shorter): block
    boundaries do not depend on how the reader batches, so the parts of a rerun line up.

    The `skip` rows a resumed job already embedded are read again, only to hash them: `skipped_digest` is
    their hash, which `blocks` compares with the one the parts recorded. `id_type`: the job's id type (the
    parts', when resuming), else taken from the first block. `then`: how the input looked when the job
    began, for the refusal."""

    def __init__(
        self,
        path: Path,
        fmt: str,
        text_field: str,
        id_field: str | None,
        chunk_rows: int,
        skip: int = 0,
        id_type: Any = None,
        then: str = "",
        images: Any = None,
    ):
        self.path, self.fmt, self.text_field, self.id_field = path, fmt, text_field, id_field
        self.images = images  # an offline_images.ImageColumn: the field holds images, not texts
        self.chunk_rows, self.skip, self.id_type, self.then = chunk_rows, skip, id_type, then
        self._hash = hashlib.sha256()
        self.skipped_digest: str | None = None if skip else self._hash.hexdigest()

    def blocks(self, expected: str | None = None) -> Iterator[Block]:
        """The blocks; `expected`: the hash the skipped rows must have (else JobError before any block)."""
        texts: list[Any] = []
        ids: list[Any] = []
        lines: list[int] = []
        row = 0  # rows read so far
        batches = _records(self.path, self.fmt, self.text_field, self.id_field, self.chunk_rows)
        for batch_texts, batch_ids, batch_lines in batches:
            n = len(batch_texts)
            start = min(n, max(0, self.skip - row))
            if start:
                skipped = self._keys(batch_texts[:start])
                _hash_rows(self._hash, skipped, batch_ids[:start] if batch_ids else None)
            if row + start == self.skip and self.skipped_digest is None:
                self.skipped_digest = self._hash.hexdigest()
                self.check_skipped(expected)
            row += n
            if start == n:
                continue
            texts += batch_texts[start:]
            ids += (batch_ids or [])[start:]
            lines += (batch_lines or [])[start:]
            while len(texts) >= self.chunk_rows:
                k = self.chunk_rows
                yield self._block(row - len(texts), texts[:k], ids[:k], lines[:k])
                texts, ids, lines = texts[k:], ids[k:], lines[k:]
        if self.skipped_digest is None:  # the input is shorter than what was embedded
            self.skipped_digest = self._hash.hexdigest()
            self.check_skipped(expected)
        if texts:
            yield self._block(row - len(texts), texts, ids, lines)

    def check_skipped(self, expected: str | None) -> None:
        if expected is not None and self.skipped_digest != expected:
            raise OtherJobError(
                f"{self.path} changed since the job began{self.then}: its first {self.skip} rows are not "
                "the ones embedded; --overwrite to start again"
            )

    def _block(self, first: int, texts: list[Any], ids: list[Any], lines: list[int]) -> Block:
        block = Block(first, texts, None, "", lines if self.fmt in LINE_FORMATS else None)
        if self.images is not None:
            block.texts = self.images.sources(texts, block.where)
        for i, text in enumerate(texts if self.images is None else ()):
            if not isinstance(text, str) or not text:
                what = "missing" if text is None else "empty" if text == "" else f"{kind_of(text)}, not text"
                raise JobError(f"{self.path}: {block.where(i)}: the {self.text_field!r} field is {what}")
        if self.id_field is not None:
            block.ids = self._ids(block, ids)
        _hash_rows(self._hash, self._keys(texts), ids if self.id_field is not None else None)
        block.digest = self._hash.hexdigest()
        return block

    def _keys(self, texts: list[Any]) -> list[Any]:
        """What the hash records of each row's input: a text, or an image cell (offline_images.row_key)."""
        return texts if self.images is None else self.images.keys(texts)

    def _ids(self, block: Block, ids: list[Any]) -> Any:
        """The block's ids as an Arrow array of the job's id type (set here from the first block)."""
        pa = pyarrow()
        field = self.id_field
        for i, value in enumerate(ids):
            if value is None:
                raise JobError(f"{self.path}: {block.where(i)}: the {field!r} field is missing")
        errors = (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError)
        want = self.id_type if self.id_type is not None else pa.array(ids[:1]).type
        try:
            array = pa.array(ids, type=want)
        except errors:
            for i, value in enumerate(ids):
                try:
                    pa.array([value], type=want)
                except errors:
                    raise JobError(
                        f"{self.path}: {block.where(i)}: the {field!r} field is {kind_of(value)} ({value!r}), "
                        f"where the ids before it are {_arrow_kind(want)}: one id type per job"
                    ) from None
            raise
        self.id_type = want
        return array


def kind_of(value: Any) -> str:
    """What a value is, as its JSON type (for a JSON-lines file) or Python's."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object"}
    kinds[list] = "a list"
    return kinds.get(type(value), f"a {type(value).__name__}")


def _arrow_kind(t: Any) -> str:
    pa = pyarrow()
    if pa.types.is_integer(t):
        return "integers"
    if pa.types.is_floating(t):
        return "numbers"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "strings"
    return str(t)
