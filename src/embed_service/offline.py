"""`embed-service encode INPUT OUTPUT`: embed a file of texts with an `Embedder`, no server in the loop.

In: JSON lines, CSV, Parquet or plain text (one text a line), read in blocks of ``--chunk-rows`` rows
(offline_input.py; the flag and docs/offline.md say chunk, a word the code keeps for a long text's
windows); the text from ``--text-field`` and, with ``--id-field``, an id kept beside each vector, one type
for the whole job (else the row's index, from 0). Out: Parquet (an id column and an ``embedding`` column
of fixed-size lists) or ``.npy`` (the (n, D) array, and the ids in ``<stem>.ids.npy``). With
``--image-field`` instead, a CLIP or SigLIP model embeds the images of that field (offline_images.py).

Bounded memory: a few blocks are held at a time (read, in the engine, being written), whatever the size of
the input. The blocks go to the engine as bulk requests (engine/admission.py), two in flight so that the
workers never wait for the reader or the writer.

Resumable: each block is written as its own Parquet file in ``OUTPUT.parts/`` (to a temporary name, then
renamed: a kill mid-write leaves a temporary file, never half a block). A rerun with the same input and
options counts the rows of the parts there, skips that many input rows and goes on; when every row is in,
the parts are joined into OUTPUT (one part at a time, to a temporary name, then renamed) and removed.
``OUTPUT.parts/job.json`` records the input (its path, size and mtime), the options, the settings that
change the vectors as resolved from flags, --config and ``EMBED_*`` variables, and what the engine made of
them (the model's folder, dtype, device, max input length): a rerun with other ones is refused instead of
mixing vectors of two jobs. Each part records the hash of the input's rows up to its last one; a rerun
hashes the rows it skips and refuses an input whose rows are not the ones embedded (rewritten in place,
reordered), whatever its size and mtime. A job that fails says whether its parts are kept for a rerun.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from embed_service.config import Settings
from embed_service.embedder import Embedder
from embed_service.engine.errors import EngineError
from embed_service.offline_images import ImageColumn, check_image_job, check_model
from embed_service.offline_input import (
    FORMATS,
    Block,
    JobError,
    OtherJobError,
    Reader,
    count_rows,
    input_format,
    pyarrow,
)
from embed_service.requests.encodings import EMBED_DTYPES

__all__ = ["JobError", "Parts", "add_arguments", "ids_file", "run"]

BLOCKS_IN_FLIGHT = 2
ROW_COLUMN = "row"  # the id column when the input names none: the row's index in the input, from 0
EMBEDDING_COLUMN = "embedding"
DIGEST_KEY = b"embed_service.rows_sha256"  # a part's metadata: the hash of the input's rows up to its last
# The settings that change the vectors, as given (the engine's resolution of model, dtype, device and max
# input length is recorded beside them, see `engine_record`): a rerun with others is refused. Threads,
# replicas and batch sizes do not change them.
RESULT_SETTINGS = ("revision", "chunk_long_inputs", "chunk_overlap", "max_chunks_per_input")
_INPUT_INDEX = re.compile(r"^input (\d+)\b")


# --- writing -------------------------------------------------------------------------------------


class Parts:
    """The blocks written so far, one Parquet file each, in OUTPUT.parts/ (see the module docstring).

    `claim(job)` records the job in job.json, or checks that the one recorded is the same (a JobError names
    what differs); `check_engine` does the same, once the engine is up, for what it resolved."""

    def __init__(self, output: Path, overwrite: bool):
        self.output = output
        self.dir = output.with_name(output.name + ".parts")
        if output.exists() and not self.dir.exists() and not overwrite:
            raise JobError(f"{output} exists; --overwrite to replace it")
        if self.dir.exists() and overwrite:
            shutil.rmtree(self.dir)
        self.record = self.dir / "job.json"
        self.before: dict[str, Any] | None = (
            json.loads(self.record.read_text()) if self.record.exists() else None
        )
        self.files = sorted(self.dir.glob("part-*.parquet")) if self.dir.exists() else []
        import pyarrow.parquet as pq

        metas = [pq.read_metadata(f) for f in self.files]
        self.rows = sum(m.num_rows for m in metas)
        self.digest = (metas[-1].metadata or {}).get(DIGEST_KEY, b"").decode() if metas else None
        self.id_type = pq.read_schema(self.files[0]).field(0).type if self.files else None

    def claim(self, job: dict[str, Any]) -> None:
        if self.before is not None:
            _same_job(self.dir, self.before, job, ("input", "options", "settings"))
            self.job = self.before  # the input's size and mtime as when the job began
        else:
            self.job = job
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.tmp"):  # a write a kill interrupted
            stale.unlink()
        self._save()

    def check_engine(self, engine: dict[str, Any]) -> None:
        if "engine" in self.job:
            _same_job(self.dir, self.job, {"engine": engine}, ("engine",))
        else:
            self.job["engine"] = engine
            self._save()

    def _save(self) -> None:
        _atomic_write(self.record, json.dumps(self.job, indent=1, sort_keys=True).encode())

    def write(self, block: Block, vectors: np.ndarray, id_name: str) -> None:
        pa = pyarrow()
        import pyarrow.parquet as pq

        ids = (
            block.ids
            if block.ids is not None
            else pa.array(range(block.first, block.first + len(block.texts)), pa.int64())
        )
        flat = pa.array(np.ascontiguousarray(vectors).reshape(-1))
        table = pa.table(
            {id_name: ids, EMBEDDING_COLUMN: pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])}
        ).replace_schema_metadata({DIGEST_KEY: block.digest.encode()})
        path = self.dir / f"part-{block.first:012d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp)
        _fsync_replace(tmp, path)
        self.files.append(path)
        self.rows += len(block.texts)

    def left_behind(self) -> str:
        """What a failed job leaves, for its last line: the parts a rerun resumes from, or nothing."""
        if not self.rows:
            shutil.rmtree(self.dir, ignore_errors=True)
            return "nothing was written"
        return (
            f"{self.dir} keeps the {self.rows} rows written: the same command resumes after them "
            "(--overwrite starts again)"
        )

    def finish(self, kind: str) -> None:
        """Join the parts into OUTPUT (Parquet, or .npy and its ids), then remove them."""
        import pyarrow.parquet as pq

        tmp = self.output.with_name(self.output.name + ".tmp")
        if kind == "parquet":
            writer = None
            for f in self.files:
                table = pq.read_table(f).replace_schema_metadata(None)
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


def _same_job(folder: Path, before: dict[str, Any], now: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse, naming what differs, when the job recorded in `folder` is not this one (in `keys`)."""
    changed = []
    for key in keys:
        a, b = before.get(key), now.get(key)
        if not (isinstance(a, dict) and isinstance(b, dict)):  # a record of another version, or none
            if a != b:
                changed.append(f"{key}: {a!r} then, {b!r} now")
            continue
        for name in sorted({**a, **b}):
            if name in IDENTITY_ONLY and key == "input":
                continue
            if a.get(name) != b.get(name):
                changed.append(f"{name}: {a.get(name)!r} then, {b.get(name)!r} now")
    if changed:
        raise OtherJobError(
            f"{folder} holds a job with other settings ({'; '.join(changed)}); rerun with the same ones to "
            "resume, or --overwrite to start again"
        )


# Recorded with the input, not compared: the rows' hash decides whether the input is the one embedded (a
# copy with another mtime resumes; a file rewritten in place, even to the same size, does not).
IDENTITY_ONLY = ("size", "mtime_ns")


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


async def _embed_blocks(
    source: Path,
    embedder: Embedder,
    blocks: Iterator[Block],
    parts: Parts,
    options: dict[str, Any],
    id_name: str,
    progress: Progress,
) -> None:
    pending: deque[tuple[Block, asyncio.Future]] = deque()

    async def write_oldest() -> None:
        block, future = pending.popleft()
        try:
            result = await future
        except EngineError as exc:  # the engine names the input by its index in the block: name the row
            message = _INPUT_INDEX.sub(lambda m: block.where(int(m.group(1))), str(exc))
            raise JobError(f"{source}: {message}") from None
        parts.write(block, result.embeddings, id_name)
        progress.update(len(block.texts), result.prompt_tokens)

    try:
        try:
            for block in blocks:
                pending.append((block, asyncio.ensure_future(embedder.aembed(block.texts, **options))))
                if len(pending) >= BLOCKS_IN_FLIGHT:
                    await write_oldest()
        except JobError:  # a bad row ahead: the blocks before it are embedded already, keep them
            while pending:
                await write_oldest()
            raise
        while pending:
            await write_oldest()
    finally:
        for _, future in pending:
            future.cancel()


def _then(before: dict[str, Any], now: dict[str, Any]) -> str:
    """How the input differs from when the job began, in size and modification time (or nothing)."""
    changes = []
    if before.get("size") != now["size"]:
        changes.append(f"{before.get('size')} bytes then, {now['size']} now")
    if before.get("mtime_ns") != now["mtime_ns"]:
        stamp = lambda ns: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) if ns else "?"  # noqa: E731
        changes.append(f"modified {stamp(before.get('mtime_ns'))} then, {stamp(now['mtime_ns'])} UTC now")
    return f" ({'; '.join(changes)})" if changes else ""


def engine_record(embedder: Embedder) -> dict[str, Any]:
    """What the engine resolved that changes the vectors: the model's folder and the dtype, device and max
    input length it runs with (``--dtype auto`` is bfloat16 on one machine, float32 on another)."""
    info = embedder.info
    keys = ("model_path", "dtype", "device", "max_input_length", "dimension", "tensor_parallel_size")
    return {k: info.get(k) for k in keys}


def run(
    args: argparse.Namespace, settings: Settings | dict[str, Any] | None, embedder: Embedder | None = None
) -> int:
    """The job. `settings`: the engine's (flags, --config, EMBED_* variables resolved: cli.encode_settings;
    a dict is resolved here); `embedder`: one started already (tests share one), whose settings then count,
    else the job builds its own once the input and output are checked."""
    source, output = Path(args.input), Path(args.output)
    if not source.is_file():
        raise JobError(f"{source}: no such file")
    fmt = input_format(source, args.input_format)
    kind = output_kind(output)
    pyarrow()  # the parts are Parquet files, whatever the input and the output
    if args.chunk_rows < 1:
        raise JobError("--chunk-rows must be at least 1")
    images = None
    if args.image_field is not None:  # a column of images (offline_images.py)
        check_image_job(args, fmt)
        root = Path(args.image_root) if args.image_root else source.parent
        images = ImageColumn(source, args.image_field, root.resolve())
    elif args.image_root is not None:
        raise JobError("--image-root applies to an --image-field job")
    field = args.image_field or args.text_field or "text"
    if fmt == "text" and args.id_field:
        raise JobError(
            "--id-field applies to JSON lines, CSV and Parquet; a text file's ids are its row numbers"
        )
    if embedder is not None:
        resolved = embedder.settings
    else:
        resolved = settings if isinstance(settings, Settings) else Settings(**(settings or {}))
    options = {
        "dimensions": args.dimensions,
        "normalize": args.normalize,
        "prompt_name": args.prompt_name,
        "prompt": args.prompt,
        "truncate": args.truncate,
        "embed_dtype": args.embed_dtype,
    }
    stat = source.stat()
    job = {
        "input": {
            "path": str(source.resolve()),
            "format": fmt,
            "text_field": None if images else field,
            "id_field": args.id_field,
            **({"image_field": field, "image_root": str(images.root)} if images else {}),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        },
        "options": options,
        "settings": {k: getattr(resolved, k) for k in RESULT_SETTINGS},
        # As asked (informative): what the engine made of them is "engine", recorded once it is up.
        "requested": {"model": resolved.model, "dtype": resolved.dtype, "device": resolved.device},
    }
    parts = Parts(output, args.overwrite)
    parts.claim(job)
    then = _then(parts.before["input"], job["input"]) if parts.before else ""
    reader = Reader(
        source, fmt, field, args.id_field, args.chunk_rows, parts.rows, parts.id_type, then, images
    )
    try:
        total = count_rows(source, fmt, field) if args.progress else None
        if total is not None and parts.rows > total:
            raise OtherJobError(
                f"{parts.dir} holds {parts.rows} rows, more than the {total} of {source}{then}; "
                "--overwrite to start again"
            )
        owned = embedder is None
        if embedder is None:
            embedder = Embedder(**resolved.model_dump())
        try:
            if images is not None:
                check_model(embedder.info)
            parts.check_engine(engine_record(embedder))
            progress = Progress(total, parts.rows, args.progress)
            try:
                blocks = reader.blocks(expected=parts.digest)
                id_name = args.id_field or ROW_COLUMN
                asyncio.run(_embed_blocks(source, embedder, blocks, parts, options, id_name, progress))
            finally:
                progress.close()
        finally:
            if owned:
                embedder.close()
    except OtherJobError:
        raise
    except JobError as exc:
        raise JobError(f"{exc}; {parts.left_behind()}") from None
    except BaseException:  # an interrupt, a model that cannot be served: say what is kept, then go on
        print(f"embed-service: {parts.left_behind()}", file=sys.stderr)
        raise
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
    parser.add_argument("--text-field", help="the JSON field or column holding the text (default: text)")
    parser.add_argument(
        "--image-field",
        help="instead of a text: the JSON field or column holding an image (a path, bytes, or a {bytes, path} "
        "struct) for a CLIP or SigLIP model",
    )
    parser.add_argument(
        "--image-root", help="the folder relative image paths are resolved against (default: the input's)"
    )
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
    parser.add_argument(
        "--embed-dtype", choices=EMBED_DTYPES, default="float32", help="the stored type of each value"
    )
