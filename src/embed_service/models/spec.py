"""What a model directory is: architecture, pooling, normalization, dimension, max input length.

Read from config.json and the sentence-transformers files (modules.json, 1_Pooling/config.json, Normalize,
Dense, sentence_bert_config.json). Plain JSON reading: no torch, no weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embed_service.models.registry import SCORING_HEADS, Family, resolve_family

# sentence-transformers' pooling modes, by their names in the current `pooling_mode` key -> ours.
_POOLING_MODES = {
    "cls": "cls",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "lasttoken": "last",
}
# The boolean keys older files carry instead, in sentence-transformers' order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Tanh": "tanh",
    "torch.nn.Identity": "identity",
}


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module after pooling."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


# sentence-transformers CrossEncoder activations (activation_fn), by their dotted paths -> ours.
_CE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.Identity": "identity",
    "torch.nn.Tanh": "tanh",
}


@dataclass(frozen=True)
class ScoreSpec:
    """A scoring model's head and how its logits become scores (models/scoring.py, engine/scoring.py).

    rerank_activation: what CrossEncoder.predict applies (its saved ``activation_fn``, else sigmoid for one
    label, identity for several). classify_activation: what the transformers text-classification pipeline
    applies (by ``problem_type``: sigmoid for multi-label or one label, softmax for single-label or several,
    none for regression).
    """

    head: str  # "bert", "roberta", "modernbert" (a classifier), "yes_no" or "logit_score" (LLM rerankers)
    labels: tuple[str, ...]  # id2label, in label order
    rerank_activation: str
    classify_activation: str
    yes_no_ids: tuple[int, int] | None = None  # the LLM reranker's (no, yes) token ids
    logit_ids: tuple[int, ...] | None = None
    """A sentence-transformers LogitScore module's (true,) or (true, false) token ids: the score is the true
    token's logit, less the false token's when there is one."""
    chat_format: str | None = None
    """A LogitScore model whose pairs go through the tokenizer's chat template (sentence-transformers'
    message modality): how a message's content is written, "flat" (the text) or "structured" (a list of
    typed parts). None: pairs are tokenized as two texts."""


# sentence-transformers' SparseEncoder (SPLADE): the architectures whose masked-LM head models/bert.py builds,
# and the SpladePooling options (sparse_encoder/modules/splade_pooling.py).
SPLADE_ARCHITECTURES = frozenset(
    {
        "BertForMaskedLM",
        "BertForPreTraining",
        "RobertaForMaskedLM",
        "XLMRobertaForMaskedLM",
        "ModernBertForMaskedLM",  # its head: models/modernbert.py
    }
)
_SPLADE_POOLING = ("max", "sum")
_SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeSpec:
    """A SpladePooling module over the MLM logits: per token log(1 + ReLU(logits)) (``log1p_relu``: log1p
    once more), then the maximum (``max``) or the sum (``sum``) over the tokens, per vocabulary entry."""

    pooling_strategy: str = "max"
    activation_function: str = "relu"


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
        return self.dense[-1].out_features if self.dense else self.hidden_size

    @property
    def causal(self) -> bool:
        """Decoders attend causally unless the config asks for bidirectional attention, in either spelling:
        ``is_causal: false`` (gte-Qwen2 style) or ``use_bidirectional_attention: true``."""
        bidirectional = self.config.get("is_causal", True) is False or bool(
            self.config.get("use_bidirectional_attention", False)
        )
        return self.family.causal and not bidirectional


# The config.json keys every family's model code reads, as positive integers.
_REQUIRED_CONFIG = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def positive_int(cfg: dict[str, Any], key: str, file: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if value is None else f"{value!r}, not a positive integer"
        raise ValueError(f"{file}: {key} is {what}")
    return value


def _dense(mpath: Path) -> DenseSpec:
    """A sentence-transformers Dense module from its config.json."""
    file = mpath / "config.json"
    dcfg = _read_json(file)
    if not isinstance(dcfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    act = dcfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act not in _ST_ACTIVATIONS:
        raise ValueError(f"{mpath}: unsupported Dense activation {act}")
    bias = dcfg.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError(f"{file}: bias is {bias!r}, not true or false")
    return DenseSpec(
        mpath,
        positive_int(dcfg, "in_features", file),
        positive_int(dcfg, "out_features", file),
        bias,
        _ST_ACTIVATIONS[act],
    )


def _st_modules(path: Path) -> list[dict[str, Any]]:
    modules = path / "modules.json"
    return _read_json(modules) if modules.is_file() else []


def load_spec(path: str | Path, max_input_length: int | None = None, llm_reranker: bool = False) -> ModelSpec:
    path = Path(path).resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'}: not a JSON object")
    architecture, family = resolve_family(config)
    config = family.standard_config(config)
    pooling, normalize = family.default_pooling, family.default_normalize
    dense: list[DenseSpec] = []
    splade: SpladeSpec | None = None
    modules = _st_modules(path)
    if modules:
        normalize = False  # with sentence-transformers files, Normalize is on only when listed
        for m in modules:
            kind = m.get("type", "").rsplit(".", 1)[-1]
            mpath = path / m.get("path", "")
            if kind == "Pooling":
                pooling = _pooling_mode(mpath)
            elif kind == "Normalize":
                normalize = True
            elif kind == "Dense":
                dense.append(_dense(mpath))
            elif kind == "SpladePooling":
                splade = _splade_pooling(mpath)
            elif kind == "LogitScore":
                pass  # read below (_logit_score), with the Transformer module it scores
            elif kind not in ("Transformer", "MLMTransformer"):
                raise ValueError(f"unsupported sentence-transformers module {m.get('type')}")
        if splade is not None or any(m.get("type", "").endswith("MLMTransformer") for m in modules):
            _check_splade(path, architecture, modules)
    width = int(config["hidden_size"])
    for d in dense:  # each Dense takes what the one before gives
        if d.in_features != width:
            raise ValueError(f"{d.path}: in_features is {d.in_features}, but its input has {width} features")
        width = d.out_features
    position_limit = int(config.get("max_position_embeddings", 1 << 20)) - family.position_offset(config)
    prompts, default_prompt_name = _prompts(path)
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
        score=_llm_reranker(path, family)
        if llm_reranker
        else _logit_score(path, config, architecture, family, modules)
        or _score_spec(path, config, architecture, family),
        splade=splade,
    )
    spec.max_input_length = max_input_length or default_max_length(path, position_limit)
    if spec.max_input_length > position_limit:
        raise ValueError(
            f"max input length {spec.max_input_length} exceeds the model's {position_limit} positions"
        )
    return spec


def _score_spec(path: Path, config: dict[str, Any], architecture: str, family: Family) -> ScoreSpec | None:
    """The scoring head of a *ForSequenceClassification checkpoint, with its labels and activations."""
    if not architecture.endswith("ForSequenceClassification"):
        return None
    id2label = config.get("id2label") or {}
    try:
        labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    except (TypeError, ValueError):
        raise ValueError(f"{path / 'config.json'}: id2label keys must be label indices") from None
    if not labels:
        n = config.get("num_labels", 2)
        labels = tuple(f"LABEL_{i}" for i in range(n if isinstance(n, int) and n > 0 else 2))
    rerank = _ce_activation(path, config, len(labels))
    problem = config.get("problem_type")
    if problem == "regression":
        classify = "identity"
    elif problem == "multi_label_classification" or len(labels) == 1:
        classify = "sigmoid"
    else:
        classify = "softmax"
    return ScoreSpec(SCORING_HEADS[family.cls], labels, rerank, classify)


def _ce_activation(path: Path, config: dict[str, Any], labels: int) -> str:
    """CrossEncoder's activation: sentence-transformers 6 saves it in config_sentence_transformers.json,
    4 and 5 in config.json, older versions under another key; unsaved, sigmoid for one label."""
    st_file = path / "config_sentence_transformers.json"
    st = _read_json(st_file) if st_file.is_file() else {}
    saved = (
        (st.get("activation_fn") if isinstance(st, dict) else None)
        or (config.get("sentence_transformers") or {}).get("activation_fn")
        or config.get("sbert_ce_default_activation_function")
    )
    if saved is not None and saved not in _CE_ACTIVATIONS:
        raise ValueError(f"{path}: unsupported cross-encoder activation {saved!r}")
    return _CE_ACTIVATIONS[saved] if saved else ("sigmoid" if labels == 1 else "identity")


def _logit_score(
    path: Path, config: dict[str, Any], architecture: str, family: Family, modules: list[dict[str, Any]]
) -> ScoreSpec | None:
    """A sentence-transformers 6 LLM cross-encoder (modules.json: a text-generation Transformer, then
    LogitScore): the true token's logit at the last token, less the false token's when there is one, then
    CrossEncoder's activation. Its input is what CrossEncoder.predict feeds such a folder without a chat
    template: ``tokenizer(query, document)`` cut longest_first (engine/scoring.py PairTokenizer); with the
    message modality, the chat template's render of a query and a document message (ChatPairTokenizer).
    Anything else the files ask for (another logits input, processing options, a default prompt) is
    refused here rather than scored differently."""
    found = [m for m in modules if m.get("type", "").rsplit(".", 1)[-1] == "LogitScore"]
    if not found:
        return None
    where = path / found[0].get("path", "") / "config.json"
    if len(found) > 1 or modules[-1] is not found[0]:
        raise ValueError(f"{path / 'modules.json'}: LogitScore is supported only once, as the last module")
    if not family.causal or not architecture.endswith("ForCausalLM"):
        raise ValueError(f"{where}: LogitScore scores a causal LM (*ForCausalLM), not {architecture}")
    cfg = _read_json(where) if where.is_file() else {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: not a JSON object")
    vocab = int(config["vocab_size"])
    ids: list[int] = []
    for key in ("true_token_id", "false_token_id"):
        i = cfg.get(key)
        if i is None and key == "false_token_id":
            continue  # the score is the true token's logit alone
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise ValueError(f"{where}: {key} is {i!r}, not a token id below vocab_size {vocab}")
        ids.append(i)
    logits = cfg.get("module_input_name", "causal_logits")
    st_file = path / "sentence_bert_config.json"
    st = _read_json(st_file) if st_file.is_file() else {}
    st = st if isinstance(st, dict) else {}
    produced = st.get("module_output_name", "causal_logits")
    if logits != produced:
        raise ValueError(
            f"{where}: module_input_name {logits!r} is not what the Transformer module gives ({produced!r})"
        )
    # The saved modality config (else the one sentence-transformers infers: text, and message when the
    # tokenizer has a chat template) says how a pair reaches the model: with message, through the template.
    template = _chat_template(path)
    modalities = st.get("modality_config")
    if modalities is None:
        modalities = {"text": {}, **({"message": {}} if template is not None else {})}
    if not isinstance(modalities, dict) or not set(modalities) <= {"text", "message"}:
        raise ValueError(f"{st_file}: modality_config {modalities!r}: only text and message are supported")
    for name, m in modalities.items():
        m = m if isinstance(m, dict) else {}
        if m.get("method", "forward") != "forward" or m.get("method_output_name", "logits") != "logits":
            raise ValueError(f"{st_file}: the {name} modality must give the causal LM's logits (forward)")
    chat_format = None
    if "message" in modalities:
        if not isinstance(template, str):
            raise ValueError(
                f"{path}: pairs go through the chat template (the message modality), but the tokenizer has "
                "no chat template (one string in chat_template.jinja or tokenizer_config.json)"
            )
        chat_format = (modalities["message"] or {}).get("format", "auto")
        if chat_format == "auto":
            chat_format = _message_format(str(config.get("model_type", "")), template)
        if chat_format not in ("flat", "structured"):
            raise ValueError(f"{st_file}: message format {chat_format!r} is not flat or structured")
    if st.get("processing_kwargs") or st.get("do_lower_case"):
        raise ValueError(
            f"{st_file}: processing_kwargs and do_lower_case are not supported for a LogitScore model"
        )
    ce_file = path / "config_sentence_transformers.json"
    ce = _read_json(ce_file) if ce_file.is_file() else {}
    if isinstance(ce, dict) and ce.get("default_prompt_name"):
        raise ValueError(f"{ce_file}: a default prompt is not supported for a LogitScore model")
    rerank = _ce_activation(path, config, 1)
    return ScoreSpec("logit_score", ("score",), rerank, rerank, logit_ids=tuple(ids), chat_format=chat_format)


def _chat_template(path: Path) -> Any:
    """The tokenizer's chat template as transformers reads it: chat_template.jinja, else the
    tokenizer_config.json key (a string, or a list of named templates); None without one."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    tk_file = path / "tokenizer_config.json"
    tk = _read_json(tk_file) if tk_file.is_file() else {}
    return tk.get("chat_template") if isinstance(tk, dict) else None


# sentence-transformers' message format for a chat template (base/modality.py InputFormatter._infer_format):
# its model types known to be flat, else structured when the template reads typed content parts.
_FLAT_MODEL_TYPES = ("apertus", "deepseek_v3", "gpt_oss", "seed_oss")
_STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


def _message_format(model_type: str, template: str) -> str:
    if model_type in _FLAT_MODEL_TYPES:
        return "flat"
    return "structured" if any(p in template for p in _STRUCTURED_PATTERNS) else "flat"


def _vocab_id(path: Path, token: str) -> int:
    """A token's id from tokenizer.json (its added tokens, then the model's vocabulary)."""
    tok = _read_json(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else {}
    for added in tok.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    raise ValueError(f"{path / 'tokenizer.json'}: no {token!r} token, which an LLM reranker scores")


def _llm_reranker(path: Path, family: Family) -> ScoreSpec:
    """Qwen3-Reranker style (--llm-reranker): a causal LM's `no` and `yes` logits at the last token."""
    if not family.causal:
        raise ValueError(f"--llm-reranker needs a causal LM (*ForCausalLM); {family.cls} is an encoder")
    ids = (_vocab_id(path, "no"), _vocab_id(path, "yes"))
    return ScoreSpec("yes_no", ("yes",), "yes_no", "yes_no", yes_no_ids=ids)


def _pooling_mode(mpath: Path) -> str:
    """The one pooling mode of a sentence-transformers Pooling module, in either config format."""
    pcfg = _read_json(mpath / "config.json")
    mode = pcfg.get("pooling_mode")
    if mode is None:  # as sentence-transformers: the legacy keys set, else mean
        mode = [name for key, name in _LEGACY_POOLING_KEYS.items() if pcfg.get(key)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise ValueError(
            f"{mpath}: exactly one of the pooling modes {sorted(_POOLING_MODES)} is supported, found {modes}"
        )
    chosen = _POOLING_MODES[modes[0]]
    if pcfg.get("include_prompt", True) is False and chosen != "last":
        # The prompt would have to be left out of the pooled tokens; the pooled token of last-token
        # pooling is never part of the prompt, so only that mode is unaffected.
        raise ValueError(
            f"{mpath}: include_prompt=false (pooling that leaves the prompt tokens out) is not supported "
            f"with {chosen} pooling"
        )
    return chosen


def _splade_pooling(mpath: Path) -> SpladeSpec:
    """A SpladePooling module's options from its config.json, refusing values sentence-transformers refuses."""
    file = mpath / "config.json"
    cfg = _read_json(file) if file.is_file() else {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    spec = SpladeSpec(cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu"))
    if spec.pooling_strategy not in _SPLADE_POOLING:
        raise ValueError(
            f"{file}: pooling_strategy {spec.pooling_strategy!r} is not one of {_SPLADE_POOLING}"
        )
    if spec.activation_function not in _SPLADE_ACTIVATIONS:
        raise ValueError(
            f"{file}: activation_function {spec.activation_function!r} is not one of {_SPLADE_ACTIVATIONS}"
        )
    return spec


def _check_splade(path: Path, architecture: str, modules: list[dict[str, Any]]) -> None:
    """SpladePooling reads MLM logits: the checkpoint must be a masked LM whose head we build, and nothing
    but the transformer may stand before the pooling (a dense Pooling or Dense module beside it is refused)."""
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if kinds[-1:] != ["SpladePooling"] or any(k not in ("Transformer", "MLMTransformer") for k in kinds[:-1]):
        raise ValueError(
            f"{path / 'modules.json'}: a SPLADE model is a transformer then SpladePooling, found {kinds}"
        )
    if architecture not in SPLADE_ARCHITECTURES:
        raise ValueError(
            f"{path}: SpladePooling needs a masked-LM checkpoint with its head "
            f"({', '.join(sorted(SPLADE_ARCHITECTURES))}); config.json names {architecture}"
        )


def _prompts(path: Path) -> tuple[dict[str, str], str | None]:
    """``prompts`` and ``default_prompt_name`` from config_sentence_transformers.json."""
    file = path / "config_sentence_transformers.json"
    if not file.is_file():
        return {}, None
    cfg = _read_json(file)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ValueError(f"{file}: `prompts` must map names to strings")
    default = cfg.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ValueError(
            f"{file}: default_prompt_name {default!r} is not one of the prompts {sorted(prompts)}"
        )
    return prompts, default


def default_max_length(path: Path, position_limit: int) -> int:
    """sentence-transformers' max_seq_length, else a sane tokenizer model_max_length, else the positions."""
    st = path / "sentence_bert_config.json"
    if st.is_file():
        v = _read_json(st).get("max_seq_length")
        if v:
            return min(int(v), position_limit)
    tk = path / "tokenizer_config.json"
    if tk.is_file():
        v = _read_json(tk).get("model_max_length")
        if isinstance(v, (int, float)) and 0 < v < 1_000_000:
            return min(int(v), position_limit)
    return position_limit
