"""Ray Data: `EmbedBatches`, a callable class for ``Dataset.map_batches`` holding one `Embedder` per actor.

    import ray
    from ray.data import ActorPoolStrategy
    from embed_service.ray import EmbedBatches

    ds = ray.data.read_parquet("s3://bucket/docs/")
    ds = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"column": "text", "dtype": "float32"},
        compute=ActorPoolStrategy(size=4),  # four actors, each with its own Embedder and workers
        batch_size=1024,
        num_cpus=2,  # what each actor's Embedder may use (its workers' threads follow the machine's cores)
    )
    ds.write_parquet("s3://bucket/embeddings/")

Nothing here imports Ray: Ray imports this class on each actor, which builds its Embedder once (loading
the model, starting its worker processes) and embeds every batch the actor gets. The same code runs on a
laptop's ``ray.init()`` and on a KubeRay cluster (docs/offline.md). Install with the ``ray`` extra.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embed_service.embedder import Embedder

ENCODE_OPTIONS = (
    "normalize",
    "dimensions",
    "prompt_name",
    "prompt",
    "truncate",
    "truncation_direction",
    "embed_dtype",
    "embed_ranges",
)


class EmbedBatches:
    """Adds an embedding column to each batch (numpy, pandas or pyarrow, as Ray hands it).

    Args:
        model: as `Embedder` (None: the packaged all-MiniLM-L6-v2).
        column: the column of texts (or token-id lists).
        output_column: the column the vectors go to: one (D,) array per row, float32 or the
            ``embed_dtype``'s storage.
        **options: `Embedder.encode` options (normalize, dimensions, prompt_name, prompt, truncate,
            truncation_direction, embed_dtype, embed_ranges); every other keyword is an `Embedder`
            setting (dtype, device, data_parallel_size, num_threads, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        column: str = "text",
        output_column: str = "embedding",
        **options: Any,
    ):
        self.column = column
        self.output_column = output_column
        self.encode_options = {k: options.pop(k) for k in ENCODE_OPTIONS if k in options}
        self.embedder = Embedder(model, **options)

    def __call__(self, batch: Any) -> Any:
        texts = _column(batch, self.column)
        if not len(texts):
            vectors = np.zeros((0, self.embedder.dimension), np.float32)
        else:
            vectors = self.embedder.encode(texts, **self.encode_options)
        return _with_column(batch, self.output_column, vectors)

    def __del__(self) -> None:  # an actor's end: stop its workers now rather than at interpreter exit
        embedder = getattr(self, "embedder", None)
        if embedder is not None:
            embedder.close()


def _column(batch: Any, name: str) -> list[Any]:
    if isinstance(batch, dict):  # Ray's default batch format: column -> numpy array
        values = batch[name]
    elif hasattr(batch, "column_names"):  # pyarrow.Table
        return batch.column(name).to_pylist()
    else:  # pandas.DataFrame
        values = batch[name].to_numpy()
    return [v.tolist() if isinstance(v, np.ndarray) else v for v in values]


def _with_column(batch: Any, name: str, vectors: np.ndarray) -> Any:
    if isinstance(batch, dict):
        return {**batch, name: vectors}
    if hasattr(batch, "column_names"):
        import pyarrow as pa

        flat = pa.array(vectors.reshape(-1))
        return batch.append_column(name, pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]))
    out = batch.copy()
    out[name] = list(vectors)
    return out
