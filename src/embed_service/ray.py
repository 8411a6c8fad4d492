"""Ray Data: `EmbedBatches`, a callable class for ``Dataset.map_batches`` holding one `Embedder` per actor, and
`actor_pool`, the pool's sizing.

    import ray
    from embed_service.ray import EmbedBatches, actor_pool

    ray.init()
    ds = ray.data.read_parquet("s3://bucket/docs/")
    ds = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"column": "text", "dtype": "float32"},
        batch_size=1024,
        **actor_pool(cpus_per_actor=2),  # as many actors of 2 CPUs as fit, one CPU left for reading
    )
    ds.write_parquet("s3://bucket/embeddings/")

Images, for a CLIP or SigLIP model: ``image_column="image"`` embeds that column instead of a text one, over
``ray.data.read_images`` (each row an (H, W[, C]) uint8 array, taken as ``PIL.Image.fromarray`` makes it),
``read_parquet`` of encoded bytes or Hugging Face's ``{bytes, path}`` structs, or paths (offline_images.py).

Ray Data's read and write tasks need a CPU each (``num_cpus=1`` by default): a pool whose actors take every
CPU of the cluster leaves them none, and the job makes no progress and raises nothing. `actor_pool` leaves
``reserve_cpus`` free and refuses a pool that would not.

Nothing here imports Ray at import time: Ray imports this class on each actor, which builds its Embedder
once (loading the model, starting its worker processes) and embeds every batch the actor gets. The same
code runs on a laptop's ``ray.init()`` and on a KubeRay cluster (docs/offline.md). Install with the ``ray``
extra.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embed_service.embedder import Embedder
from embed_service.offline_images import NotAnImage, image_source

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


def actor_pool(
    cpus_per_actor: float = 1.0, actors: int | None = None, reserve_cpus: float = 1.0
) -> dict[str, Any]:
    """``map_batches`` keyword arguments (``compute``, ``num_cpus``) for a pool of `EmbedBatches` actors of
    `cpus_per_actor` CPUs each that leaves `reserve_cpus` of the running cluster's CPUs to Ray Data's read
    and write tasks. `actors`: the pool's size; None: as many as fit. Raises ValueError for a pool that
    would take the reserved CPUs (it would stall: see the module docstring). Call it after ``ray.init()``."""
    import ray
    from ray.data import ActorPoolStrategy

    total = float(ray.cluster_resources().get("CPU", 0))
    fit = int((total - reserve_cpus) // cpus_per_actor) if cpus_per_actor > 0 else 0
    size = fit if actors is None else actors
    if size < 1 or size > fit:
        raise ValueError(
            f"{size} actors of {cpus_per_actor:g} CPUs leave Ray Data's read and write tasks less than "
            f"{reserve_cpus:g} of the cluster's {total:g} CPUs, and the job would stall: at most {max(fit, 0)} "
            "actors of that size, or fewer CPUs each"
        )
    return {"compute": ActorPoolStrategy(size=size), "num_cpus": cpus_per_actor}


class EmbedBatches:
    """Adds an embedding column to each batch (numpy, pandas or pyarrow, as Ray hands it).

    Args:
        model: as `Embedder` (None: the packaged all-MiniLM-L6-v2).
        column: the column of texts (or token-id lists).
        image_column: instead, a column of images: (H, W[, C]) uint8 arrays (``read_images``), encoded
            bytes, ``{bytes, path}`` structs or file paths (relative ones from the working directory).
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
        image_column: str | None = None,
        output_column: str = "embedding",
        **options: Any,
    ):
        self.column, self.image_column = column, image_column
        self.output_column = output_column
        self.encode_options = {k: options.pop(k) for k in ENCODE_OPTIONS if k in options}
        self.embedder = Embedder(model, **options)

    def __call__(self, batch: Any) -> Any:
        texts = (
            _column(batch, self.column) if self.image_column is None else _images(batch, self.image_column)
        )
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


def _images(batch: Any, name: str) -> list[Any]:
    """A batch's image column as `Embedder.encode` takes images; a ValueError names a cell that is none."""
    if isinstance(batch, dict):
        values = batch[name]
    elif hasattr(batch, "column_names"):
        import pyarrow as pa

        column = batch.column(name)  # Ray's tensor columns (read_images) are extension types: as arrays
        tensors = isinstance(column.type, pa.ExtensionType)
        values = column.combine_chunks().to_numpy() if tensors else column.to_pylist()
    else:
        values = batch[name].to_numpy()
    out = []
    for i, value in enumerate(values):
        try:
            out.append(image_source(value, None))
        except NotAnImage as exc:
            raise ValueError(f"row {i} of the batch: the {name!r} column is {exc}") from None
    return out


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
