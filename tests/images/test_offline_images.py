"""`embed-service encode --image-field` over a tiny random CLIP folder: a column of image paths (relative to
the input's folder or to --image-root), of Parquet bytes and of Hugging Face's {bytes, path} structs gives,
row for row, transformers' ``CLIPModel.get_image_features`` of the same files (load_image, the image
processor; L2-normalized when the model's vectors are) in float32, min cosine >= 0.99999, and
`Embedder.encode` of the same paths. A bad row (no file, corrupt bytes, over --max-image-pixels or
--max-image-bytes) stops the job naming the row and the limit, after the chunks before it are written; the
fixed input resumes. A text-only model refuses an image job at start. Many images whose bytes together pass
--max-request-image-bytes go to the engine as several requests, in `encode` as in a job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers as T
from transformers.image_utils import load_image

from embed_service import Embedder, cli, offline
from tests.images.pictures import encode, from_array, noise
from tests.images.test_decode import png_claiming
from tests.images.test_preprocess import encoded
from tests.images.test_server import clip_path  # noqa: F401  (the tiny CLIP folder)
from tests.models.test_clip import min_cos

MAX_IMAGE_BYTES = 300_000
MAX_REQUEST_IMAGE_BYTES = 600_000


@pytest.fixture(scope="module")
def clip(clip_path) -> Iterator[Embedder]:  # noqa: F811
    with Embedder(
        str(clip_path),
        dtype="float32",
        data_parallel_size=1,
        max_image_bytes=MAX_IMAGE_BYTES,
        max_request_image_bytes=MAX_REQUEST_IMAGE_BYTES,
    ) as e:
        yield e


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, list[str]]:
    """Every picture of tests/images (PNG, JPEG with EXIF orientations, WebP, GIF) as a file under pics/."""
    root = tmp_path_factory.mktemp("images")
    (root / "pics").mkdir()
    names = []
    for name, data in encoded():
        names.append(f"pics/{name}.img")
        (root / names[-1]).write_bytes(data)
    return root, names


def reference(path: Path, files: list[Path], normalize: bool) -> np.ndarray:
    """transformers: load_image, the image processor, get_image_features (L2-normalized when the model's
    vectors are: this folder has no Normalize module, so they are not)."""
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = T.AutoImageProcessor.from_pretrained(str(path))
    with torch.inference_mode():
        pixels = processor(images=[load_image(str(f)) for f in files], return_tensors="pt")["pixel_values"]
        vectors = model.get_image_features(pixel_values=pixels).pooler_output.numpy()
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True) if normalize else vectors


@pytest.fixture(scope="module")
def expected(clip, clip_path, folder) -> np.ndarray:  # noqa: F811
    root, names = folder
    return reference(clip_path, [root / n for n in names], clip.info["normalize"])


def job(embedder: Embedder | None, *argv: str) -> int:
    args = cli.build_parser().parse_args(["encode", *argv, "--no-progress"])
    settings = {k: v for k, v in vars(args).items() if k in cli.ENCODE_SETTINGS}
    return offline.run(args, settings, embedder)


def vectors_of(path: Path, id_name: str = "row") -> tuple[list, np.ndarray]:
    table = pq.read_table(path)
    return table.column(id_name).to_pylist(), np.stack(
        table.column("embedding").to_numpy(zero_copy_only=False)
    )


def check(got: np.ndarray, want: np.ndarray, clip: Embedder, sources: list) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    norm = lambda v: np.linalg.norm(v, axis=1)  # noqa: E731
    assert np.allclose(norm(got), norm(want), rtol=1e-5)  # scaled (or not) as the model's vectors are
    assert min_cos(got, want) >= 0.99999
    assert np.abs(got - clip.encode(sources)).max() <= 1e-5


def test_a_jsonl_column_of_relative_paths_equals_transformers(clip, folder, expected, tmp_path):
    root, names = folder
    source = root / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "file": n}) + "\n" for i, n in enumerate(names)))
    out = tmp_path / "out.parquet"
    job(clip, str(source), str(out), "--image-field", "file", "--id-field", "id", "--chunk-rows", "5")
    ids, got = vectors_of(out, "id")
    assert ids == [f"p{i}" for i in range(len(names))]
    check(got, expected, clip, [root / n for n in names])


def test_a_csv_of_paths_under_an_image_root_to_npy(clip, folder, expected, tmp_path):
    root, names = folder
    source = tmp_path / "rows.csv"  # elsewhere: the paths are relative to --image-root
    source.write_text("path\n" + "".join(n.removeprefix("pics/") + "\n" for n in names))
    out = tmp_path / "out.npy"
    job(clip, str(source), str(out), "--image-field", "path", "--image-root", str(root / "pics"))
    check(np.load(out), expected, clip, [root / n for n in names])
    assert np.load(offline.ids_file(out)).tolist() == list(range(len(names)))


def test_parquet_bytes_and_hugging_face_structs(clip, folder, expected, tmp_path):
    root, names = folder
    data = [(root / n).read_bytes() for n in names]
    binary = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"image": pa.array(data, pa.binary())}), binary, row_group_size=7)
    job(clip, str(binary), str(tmp_path / "a.parquet"), "--image-field", "image", "--chunk-rows", "4")
    check(vectors_of(tmp_path / "a.parquet")[1], expected, clip, data)
    # datasets' Image feature: {bytes, path}; the path is read when the bytes are null
    structs = [
        {"bytes": None, "path": str(root / n)} if i % 3 == 0 else {"bytes": d, "path": n}
        for i, (n, d) in enumerate(zip(names, data))
    ]
    hf = tmp_path / "hf.parquet"
    pq.write_table(pa.table({"image": structs}), hf)
    job(clip, str(hf), str(tmp_path / "b.parquet"), "--image-field", "image")
    check(vectors_of(tmp_path / "b.parquet")[1], expected, clip, data)


def test_a_bad_row_stops_the_job_naming_it_and_the_fixed_input_resumes(clip, folder, expected, tmp_path):
    root, names = folder
    source = tmp_path / "rows.jsonl"
    later = tmp_path / "later.png"  # row 7's file, not there yet
    rows = [str(root / n) for n in names[:6]] + [str(later)] + [str(root / n) for n in names[6:12]]
    source.write_text("".join(json.dumps({"image": r}) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    argv = (str(source), str(out), "--image-field", "image", "--chunk-rows", "3")
    with pytest.raises(offline.JobError) as stop:
        job(clip, *argv)
    message = str(stop.value)
    assert f"line 7: the 'image' field is '{later}', and there is no file {later}" in message, message
    assert "keeps the 6 rows written" in message, message
    later.write_bytes((root / names[0]).read_bytes())
    job(clip, *argv)
    got = vectors_of(out)[1]
    want = np.concatenate([expected[:6], expected[:1], expected[6:12]])
    assert min_cos(got, want) >= 0.99999 and len(got) == 13


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (
            b"\x89PNG\r\n\x1a\n not a picture",
            r"row 3: not an image in an allowed format \(PNG, JPEG, WebP, GIF\)",
        ),
        (
            encode(from_array(noise(400, 400, 3, 1), "RGB"), "PNG"),
            rf"row 3: \d+ bytes; the limit is {MAX_IMAGE_BYTES} bytes per image \(--max-image-bytes\)",
        ),
        (b"", r"row 3: the 'image' field is empty bytes"),
    ],
    ids=["corrupt", "over-max-image-bytes", "empty"],
)
def test_bad_bytes_name_the_row_and_the_limit(clip, folder, tmp_path, bad, pattern):
    root, names = folder
    data = [(root / n).read_bytes() for n in names[:2]] + [bad] + [(root / names[2]).read_bytes()]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": pa.array(data, pa.binary())}), source)
    with pytest.raises(offline.JobError, match=pattern + r".*; nothing was written"):
        job(clip, str(source), str(tmp_path / "out.parquet"), "--image-field", "image")


def test_the_max_image_pixels_flag_reaches_the_engine(clip_path, folder, tmp_path):  # noqa: F811
    """The job's own Embedder, from its flags: a header of 10000 x 10000 pixels past --max-image-pixels."""
    root, names = folder
    (tmp_path / "bomb.png").write_bytes(png_claiming(10000, 10000))
    source = tmp_path / "in.csv"
    source.write_text(f"image\n{root / names[0]}\n{tmp_path / 'bomb.png'}\n")
    pattern = r"row 2: 10000x10000 = 100000000 pixels; the limit is 250000 pixels \(--max-image-pixels\)"
    flags = ("--model", str(clip_path), "--dtype", "float32", "--data-parallel-size", "1")
    with pytest.raises(offline.JobError, match=pattern):
        job(None, str(source), str(tmp_path / "o.parquet"), "--image-field", "image", *flags,
            "--max-image-pixels", "250000")  # fmt: skip


def test_refusals_before_any_row(clip, folder, tmp_path):
    root, names = folder
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "a photo", "image": str(root / names[0])}) + "\n")
    out = str(tmp_path / "out.parquet")
    for argv, pattern in [
        (("--text-field", "text"), "--text-field and --image-field name two columns; a job embeds one"),
        (("--prompt", "a photo of "), "--prompt applies to texts; an --image-field job embeds images only"),
    ]:
        with pytest.raises(offline.JobError, match=pattern):
            job(clip, str(source), out, "--image-field", "image", *argv)
    with pytest.raises(offline.JobError, match="--image-root applies to an --image-field job"):
        job(clip, str(source), out, "--image-root", str(root))
    lines = tmp_path / "in.txt"
    lines.write_text(f"{root / names[0]}\n")
    with pytest.raises(offline.JobError, match="--image-field applies to JSON lines, CSV and Parquet"):
        job(clip, str(lines), out, "--image-field", "image")


def test_a_text_only_model_refuses_an_image_job(folder, tmp_path):
    root, names = folder
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"image": str(root / names[0])}) + "\n")
    refusal = r"--image-field: model \S+ embeds text only.*; nothing"
    with (
        Embedder(dtype="float32", data_parallel_size=1, num_threads=1) as text_only,
        pytest.raises(offline.JobError, match=refusal),
    ):
        job(text_only, str(source), str(tmp_path / "out.parquet"), "--image-field", "image")
    assert not (tmp_path / "out.parquet.parts").exists()


def test_images_past_the_request_budget_go_as_several_requests(clip, clip_path, tmp_path):  # noqa: F811
    """Eight pictures of about 120 KB: 960 KB, past the 600 KB per request, in one job chunk."""
    files = []
    for i in range(8):
        files.append(tmp_path / f"n{i}.png")
        files[-1].write_bytes(encode(from_array(noise(200, 200, 3, 10 + i), "RGB"), "PNG"))
    assert sum(f.stat().st_size for f in files) > MAX_REQUEST_IMAGE_BYTES
    want = reference(clip_path, files, clip.info["normalize"])
    assert min_cos(clip.encode(files), want) >= 0.99999
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"image": f.name}) + "\n" for f in files))
    job(clip, str(source), str(tmp_path / "out.parquet"), "--image-field", "image")
    assert min_cos(vectors_of(tmp_path / "out.parquet")[1], want) >= 0.99999


def test_a_rerun_hashes_the_bytes_it_skips(clip, folder, expected, tmp_path):
    """Parquet bytes: a job stopped by a corrupt row 7 keeps 6 rows; a rerun over an input whose row 2 holds
    other bytes is refused; the input with only row 7 fixed resumes, and every row is its picture's."""
    root, names = folder
    data = [(root / n).read_bytes() for n in names[:9]]
    source = tmp_path / "in.parquet"

    def write(rows: list[bytes]) -> None:
        pq.write_table(pa.table({"image": pa.array(rows, pa.binary())}), source)

    write(data[:6] + [b"\x89PNG\r\n\x1a\n cut"] + data[7:])
    out = tmp_path / "out.parquet"
    argv = (str(source), str(out), "--image-field", "image", "--chunk-rows", "3")
    with pytest.raises(offline.JobError, match="row 7: not an image.*keeps the 6 rows written"):
        job(clip, *argv)
    write(data[:1] + data[2:3] + data[2:])  # row 2 is row 3's picture now: the rows written are not these
    with pytest.raises(offline.OtherJobError, match="its first 6 rows are not the ones embedded"):
        job(clip, *argv)
    write(data)
    job(clip, *argv)
    assert min_cos(vectors_of(out)[1], expected[:9]) >= 0.99999
