"""Ray Data: `EmbedBatches` on a local Ray cluster started here (2 CPUs), two actors, a small dataset;
the vectors equal `Embedder.encode` over the same texts, bit for bit, whatever actor embedded them."""

from __future__ import annotations

import numpy as np
import pytest

from embed_service import Embedder
from tests.server import read_corpus

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'embed-service[ray]')")

TEXTS = read_corpus("queries.jsonl", 48)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_map_batches_on_an_actor_pool(cluster):
    from ray.data import ActorPoolStrategy

    from embed_service.ray import EmbedBatches

    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(TEXTS)], override_num_blocks=4)
    out = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={
            "dtype": "float32",
            "data_parallel_size": 1,
            "num_threads": 1,
            "dimensions": 128,
        },
        compute=ActorPoolStrategy(size=2),
        batch_size=8,
        num_cpus=1,
    )
    rows = sorted(out.take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(len(TEXTS)))
    vectors = np.stack([r["embedding"] for r in rows])
    with Embedder(dtype="float32", data_parallel_size=1, num_threads=1) as embedder:
        expected = embedder.encode(TEXTS, dimensions=128)
    assert vectors.dtype == np.float32 and vectors.tobytes() == expected.tobytes()
