"""Ray Data: `EmbedBatches` on a local Ray cluster started here (2 CPUs, one ray.init for the module), over a
real read (`read_parquet`, whose read tasks need a CPU of their own) with the pool `actor_pool` sizes: the
actors' CPUs leave one CPU free (two actors of 0.5 CPU each here). Actors that take every CPU leave the read
tasks none and the job stalls without an error: `actor_pool` refuses such a pool, and the pipeline runs on a
thread that fails the test, instead of hanging it, when nothing comes back in PIPELINE_TIMEOUT_S. The vectors equal `Embedder.encode`
over the same texts, to the tolerance a vector's batch allows (tests/test_offline.py's resume test); images
from `read_images` into a tiny CLIP equal transformers' get_image_features of ``Image.fromarray``."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from embed_service import Embedder
from tests.images.test_server import clip_path  # noqa: F401  (a tiny CLIP folder)
from tests.models.conftest import tokenizer_sources  # noqa: F401  (what clip_path builds it from)
from tests.server import read_corpus

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'embed-service[ray]')")
pa = pytest.importorskip("pyarrow")

TEXTS = read_corpus("queries.jsonl", 48)
CLUSTER_CPUS = 2
PIPELINE_TIMEOUT_S = 600  # a stall, not a speed: a loaded 2-core machine runs this in well under it


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_map_batches_over_read_parquet_with_the_documented_sizing(cluster, tmp_path):
    import pyarrow.parquet as pq

    from embed_service.ray import EmbedBatches, actor_pool

    source = tmp_path / "docs"
    source.mkdir()
    for part in range(2):  # two files of two row groups: several read tasks
        rows = range(part * 24, part * 24 + 24)
        table = pa.table({"id": list(rows), "text": [TEXTS[i] for i in rows]})
        pq.write_table(table, source / f"part-{part}.parquet", row_group_size=12)
    pool = actor_pool(cpus_per_actor=0.5)
    assert pool["compute"].min_size == 2 and pool["num_cpus"] == 0.5  # (2 - 1) CPUs / 0.5

    def pipeline() -> list[dict]:
        ds = ray.data.read_parquet(str(source), override_num_blocks=4).map_batches(
            EmbedBatches,
            fn_constructor_kwargs={
                "dtype": "float32",
                "data_parallel_size": 1,
                "num_threads": 1,
                "dimensions": 128,
            },
            batch_size=8,
            **pool,
        )
        return ds.take_all()

    rows = run_pipeline(pipeline)
    rows.sort(key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(len(TEXTS)))
    vectors = np.stack([r["embedding"] for r in rows])
    with Embedder(dtype="float32", data_parallel_size=1, num_threads=1) as embedder:
        expected = embedder.encode(TEXTS, dimensions=128)
    assert vectors.dtype == np.float32 and vectors.shape == expected.shape
    assert np.abs(vectors - expected).max() <= 1e-5


def run_pipeline(pipeline) -> list[dict]:
    """`pipeline()`'s rows, or a failure past PIPELINE_TIMEOUT_S (a pipeline whose read tasks found no free
    CPU waits for ever; shutting Ray down unblocks its thread)."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        try:
            return thread.submit(pipeline).result(timeout=PIPELINE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            ray.shutdown()
            pytest.fail(f"no result in {PIPELINE_TIMEOUT_S} s: the read tasks found no free CPU")


def test_a_pool_that_takes_every_cpu_is_refused(cluster):
    """The sizing that stalled with read_parquet: two actors of one CPU on a 2-CPU cluster."""
    from embed_service.ray import actor_pool

    with pytest.raises(ValueError, match="2 actors of 1 CPUs leave Ray Data's read and write tasks less"):
        actor_pool(cpus_per_actor=1, actors=2)
    assert actor_pool(cpus_per_actor=1)["compute"].min_size == 1


def test_read_images_into_a_clip_equals_transformers(cluster, clip_path, tmp_path):  # noqa: F811
    """`ray.data.read_images` (each row an (H, W, 3) uint8 array) through EmbedBatches(image_column=...):
    each row's vector is transformers' get_image_features of ``Image.fromarray`` of its array (float32, min
    cosine >= 0.99999) and `Embedder.encode` of that PIL image."""
    import torch
    import transformers as T
    from PIL import Image

    from embed_service.ray import EmbedBatches, actor_pool
    from tests.images.pictures import encode, gradient, shapes
    from tests.models.test_clip import min_cos

    source = tmp_path / "pics"
    source.mkdir()
    for i, picture in enumerate([gradient(64, 48), shapes(300, 200), shapes(33, 61), gradient(7, 5)]):
        (source / f"{i}.png").write_bytes(encode(picture, "PNG"))

    def pipeline() -> list[dict]:
        ds = ray.data.read_images(str(source), include_paths=True).map_batches(
            EmbedBatches,
            fn_constructor_kwargs={
                "model": str(clip_path),
                "image_column": "image",
                "dtype": "float32",
                "data_parallel_size": 1,
                "num_threads": 1,
            },
            batch_size=3,
            **actor_pool(cpus_per_actor=0.5, actors=1),
        )
        return ds.take_all()

    rows = run_pipeline(pipeline)
    rows.sort(key=lambda r: r["path"])
    assert len(rows) == 4 and all(r["image"].dtype == np.uint8 and r["image"].ndim == 3 for r in rows)
    pictures = [Image.fromarray(r["image"]) for r in rows]
    model = T.AutoModel.from_pretrained(str(clip_path), dtype=torch.float32).eval()
    processor = T.AutoImageProcessor.from_pretrained(str(clip_path))
    with torch.inference_mode():
        want = model.get_image_features(
            **processor(images=pictures, return_tensors="pt")
        ).pooler_output.numpy()
    got = np.stack([r["embedding"] for r in rows])
    assert got.dtype == np.float32 and got.shape == want.shape and min_cos(got, want) >= 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-5)
    with Embedder(str(clip_path), dtype="float32", data_parallel_size=1, num_threads=1) as embedder:
        assert np.abs(got - embedder.encode(pictures)).max() <= 1e-5


def test_image_batches_in_each_format_and_a_cell_that_is_no_image(clip_path):  # noqa: F811
    """The actor's call, in this process: a numpy, a pandas and a pyarrow batch (Ray's tensor column) of the
    same arrays give `Embedder.encode` of ``Image.fromarray`` of each; a missing cell is refused, naming its
    row."""
    from PIL import Image
    from ray.data.extensions import ArrowTensorArray

    from embed_service.ray import EmbedBatches
    from tests.images.pictures import noise

    arrays = np.stack([noise(20, 16, 3, seed) for seed in range(3)])  # (3, 16, 20, 3) uint8
    embed = EmbedBatches(str(clip_path), image_column="image", dtype="float32", data_parallel_size=1)
    try:
        want = embed.embedder.encode([Image.fromarray(a) for a in arrays])
        batches = [
            {"image": arrays},
            pytest.importorskip("pandas").DataFrame({"image": list(arrays)}),
            pa.table({"image": ArrowTensorArray.from_numpy(arrays)}),
        ]
        for batch in batches:
            out = embed(batch)
            got = np.stack(
                list(
                    out["embedding"].to_numpy(zero_copy_only=False)
                    if hasattr(out, "column_names")
                    else out["embedding"]
                )
            )
            assert np.abs(got - want).max() <= 1e-5, type(batch)
        batch = {"image": np.array([arrays[0], None], dtype=object)}
        with pytest.raises(ValueError, match="row 1 of the batch: the 'image' column is missing"):
            embed(batch)
    finally:
        embed.embedder.close()
