"""What a model directory is: architecture, pooling, normalization, dimension, max input length.

Read from config.json and the files beside it, each kind by its own module: the sentence-transformers
modules (st_modules.py), a scoring head (score_spec.py), SPLADE (splade_spec.py). Plain JSON reading: no
torch, no weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embed_service.models.files import positive_int, read_json
from embed_service.models.registry import Family, resolve_family
from embed_service.models.score_spec import (
    ScoreSpec,
    classifier_spec,
    llm_reranker_spec,
    logit_score_spec,
)
from embed_service.models.splade_spec import SpladeSpec, check_splade, splade_pooling
from embed_service.models.st_modules import (
    DenseSpec,
    default_max_length,
    dense_module,
    pooling_mode,
    prompts_of,
    st_modules,
)

# Read by other modules from here, beside ModelSpec.
__all__ = [
    "DenseSpec",
    "ModelSpec",
    "ScoreSpec",
    "SpladeSpec",
    "default_max_length",
    "load_spec",
    "positive_int",
]


@dataclass
class ModelSpec:
    path: Path
    config: dict[str, Any]
    architecture: str
    family: Family
    pooling: str
    normalize: bool
    dense: list[DenseSpec] = field(default_factory=list)
    max_input_length: int = 512
    position_limit: int = 512
    """The longest sequence the position table allows."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Named prompts from config_sentence_transformers.json, prepended to text inputs."""
    default_prompt_name: str | None = None
    sparse_head: Path | None = None
    """bge-m3's sparse_linear.pt (lexical weights), when the folder has it."""
    colbert_head: Path | None = None
    """bge-m3's colbert_linear.pt (multi-vector), when the folder has it."""
    score: ScoreSpec | None = None
    """A cross-encoder or classifier (*ForSequenceClassification): it scores and does not embed."""
    splade: SpladeSpec | None = None
    """A SPLADE model (modules.json lists SpladePooling): its output is the vocabulary-size sparse vector
    of the MLM head's logits, and it gives no dense output."""
    image_processor: Any = None
    """A two-tower model's images.preprocess.ImageProcessor (preprocessor_config.json); None: text only."""
    text_padding: tuple[int, int] | None = None
    """(length, pad id) each text is padded to before the text tower (SigLIP: models/towers.py)."""

    @property
    def modalities(self) -> frozenset[str]:
        """What the model embeds: text, and images for a two-tower model with an image processor."""
        return frozenset({"text", "image"} if self.image_processor is not None else {"text"})

    @property
    def tokens_per_image(self) -> int:
        """An image's cost in the batcher: its sequence length in the vision tower (models/towers.py)."""
        from embed_service.models import towers

        return towers.tokens_per_image(self.config, self.family.cls)

    @property
    def outputs(self) -> frozenset[str]:
        """The output kinds this model gives: a scoring model scores only; an embedding model gives dense,
        and sparse and colbert with bge-m3's heads; a SPLADE model sparse only."""
        if self.score is not None:
            return frozenset({"score"})
        if self.splade is not None:
            return frozenset({"sparse"})
        kinds = {"dense"}
        if self.sparse_head is not None:
            kinds.add("sparse")
        if self.colbert_head is not None:
            kinds.add("colbert")
        return frozenset(kinds)

    @property
    def default_outputs(self) -> frozenset[str]:
        """What a request that names no outputs gets: sparse for a SPLADE model, else dense."""
        return frozenset({"sparse" if self.splade is not None else "dense"})

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int | None:
        """Rows of the word embedding table: every token id must be below it. (A served folder always has
        it: checkpoint.check_model_files; None only for the JSON-only folders of tokenizer tests.)"""
        rows = self.config.get("vocab_size")
        return int(rows) if rows is not None else None

    def check_tokenizer_size(self, tokens: int) -> int:
        """The bound on token ids (the embedding table's rows), once the tokenizer's `tokens` ids are known
        to fit in it."""
        if self.vocab_size is None:
            return tokens
        if tokens > self.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokens} tokens but the embedding table only {self.vocab_size} rows "
                "(vocab_size in config.json): the tokenizer does not belong to these weights"
            )
        return self.vocab_size

    @property
    def position_offset(self) -> int:
        return self.family.position_offset(self.config)

    @property
    def dimension(self) -> int:
        """The dense vector's size; for a SPLADE model the sparse vector's (the vocabulary), as
        sentence-transformers' SparseEncoder reports it."""
        if self.splade is not None:
            return int(self.config["vocab_size"])
        if self.family.towers:
            from embed_service.models import towers

            return towers.dimension(self.config, self.family.cls)
        return self.dense[-1].out_features if self.dense else self.hidden_size

    @property
    def causal(self) -> bool:
        """Decoders attend causally unless the config asks for bidirectional attention, in either spelling:
        ``is_causal: false`` (gte-Qwen2 style) or ``use_bidirectional_attention: true``."""
        bidirectional = self.config.get("is_causal", True) is False or bool(
            self.config.get("use_bidirectional_attention", False)
        )
        return self.family.causal and not bidirectional


def load_spec(path: str | Path, max_input_length: int | None = None, llm_reranker: bool = False) -> ModelSpec:
    path = two_tower_folder(Path(path).resolve())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'}: not a JSON object")
    architecture, family = resolve_family(config)
    config = family.standard_config(config)
    pooling, normalize = family.default_pooling, family.default_normalize
    dense: list[DenseSpec] = []
    splade: SpladeSpec | None = None
    modules = st_modules(path)
    if modules:
        normalize = False  # with sentence-transformers files, Normalize is on only when listed
        for m in modules:
            kind = m.get("type", "").rsplit(".", 1)[-1]
            mpath = path / m.get("path", "")
            if kind == "Pooling":
                pooling = pooling_mode(mpath)
            elif kind == "Normalize":
                normalize = True
            elif kind == "Dense":
                dense.append(dense_module(mpath))
            elif kind == "SpladePooling":
                splade = splade_pooling(mpath)
            elif kind == "CLIPModel" and family.towers and mpath == path:
                pass  # sentence-transformers' CLIP layout: this folder is the model (two_tower_folder)
            elif kind == "LogitScore":
                pass  # read below (_logit_score), with the Transformer module it scores
            elif kind not in ("Transformer", "MLMTransformer"):
                raise ValueError(f"unsupported sentence-transformers module {m.get('type')}")
        if splade is not None or any(m.get("type", "").endswith("MLMTransformer") for m in modules):
            check_splade(path, architecture, modules)
    width = int(config["hidden_size"])
    for d in dense:  # each Dense takes what the one before gives
        if d.in_features != width:
            raise ValueError(f"{d.path}: in_features is {d.in_features}, but its input has {width} features")
        width = d.out_features
    position_limit = int(config.get("max_position_embeddings", 1 << 20)) - family.position_offset(config)
    prompts, default_prompt_name = prompts_of(path)
    spec = ModelSpec(
        path,
        config,
        architecture,
        family,
        pooling,
        normalize,
        dense,
        position_limit=position_limit,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        # bge-m3's layout: the heads beside the transformer's weights (FlagEmbedding loads them by name).
        sparse_head=path / "sparse_linear.pt" if (path / "sparse_linear.pt").is_file() else None,
        colbert_head=path / "colbert_linear.pt" if (path / "colbert_linear.pt").is_file() else None,
        score=llm_reranker_spec(path, family)
        if llm_reranker
        else logit_score_spec(path, config, architecture, family, modules)
        or classifier_spec(path, config, architecture, family),
        splade=splade,
    )
    if family.towers:
        from embed_service.models import towers

        spec.image_processor = image_processor(path, architecture)
        spec.text_padding = towers.siglip_padding(path, config, family.cls)
    spec.max_input_length = max_input_length or default_max_length(path, position_limit)
    if spec.max_input_length > position_limit:
        raise ValueError(
            f"max input length {spec.max_input_length} exceeds the model's {position_limit} positions"
        )
    return spec


def two_tower_folder(path: Path) -> Path:
    """sentence-transformers' CLIP layout: modules.json's one CLIPModel module holds the model's files (in
    a subfolder such as ``0_CLIPModel``, or the folder itself); any other folder is itself."""
    modules = st_modules(path) if not (path / "config.json").is_file() else []
    clip = [m for m in modules if m.get("type", "").rsplit(".", 1)[-1] == "CLIPModel"]
    if len(modules) == 1 and clip:
        return (path / clip[0].get("path", "")).resolve()
    return path


def image_processor(path: Path, architecture: str) -> Any:
    """The folder's image processor, or None where it has no preprocessor_config.json (text only)."""
    if not (path / "preprocessor_config.json").is_file():
        return None
    from embed_service.images.preprocess import ImageProcessor
    from embed_service.models import towers

    processor = ImageProcessor.from_folder(path, architecture)
    size = towers.image_size(read_json(path / "config.json"), architecture)
    if processor.output_size != (size, size):
        raise ValueError(
            f"{path / 'preprocessor_config.json'}: images come out {processor.output_size[0]}x"
            f"{processor.output_size[1]}, but the vision tower takes {size}x{size} (vision_config.image_size)"
        )
    return processor
