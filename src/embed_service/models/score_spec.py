"""What makes a folder a scoring model, and how its logits become scores: a *ForSequenceClassification
checkpoint (a cross-encoder or classifier, with CrossEncoder's saved activation), a sentence-transformers 6
LogitScore LLM cross-encoder (and whether its pairs go through the chat template), or a Qwen3-Reranker
style causal LM (--llm-reranker)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_service.models.files import read_json
from embed_service.models.registry import SCORING_HEADS, Family

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


def classifier_spec(
    path: Path, config: dict[str, Any], architecture: str, family: Family
) -> ScoreSpec | None:
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
    rerank = ce_activation(path, config, len(labels))
    problem = config.get("problem_type")
    if problem == "regression":
        classify = "identity"
    elif problem == "multi_label_classification" or len(labels) == 1:
        classify = "sigmoid"
    else:
        classify = "softmax"
    return ScoreSpec(SCORING_HEADS[family.cls], labels, rerank, classify)


def ce_activation(path: Path, config: dict[str, Any], labels: int) -> str:
    """CrossEncoder's activation: sentence-transformers 6 saves it in config_sentence_transformers.json,
    4 and 5 in config.json, older versions under another key; unsaved, sigmoid for one label."""
    st_file = path / "config_sentence_transformers.json"
    st = read_json(st_file) if st_file.is_file() else {}
    saved = (
        (st.get("activation_fn") if isinstance(st, dict) else None)
        or (config.get("sentence_transformers") or {}).get("activation_fn")
        or config.get("sbert_ce_default_activation_function")
    )
    if saved is not None and saved not in _CE_ACTIVATIONS:
        raise ValueError(f"{path}: unsupported cross-encoder activation {saved!r}")
    return _CE_ACTIVATIONS[saved] if saved else ("sigmoid" if labels == 1 else "identity")


def logit_score_spec(
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
    cfg = read_json(where) if where.is_file() else {}
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
    st = read_json(st_file) if st_file.is_file() else {}
    st = st if isinstance(st, dict) else {}
    produced = st.get("module_output_name", "causal_logits")
    if logits != produced:
        raise ValueError(
            f"{where}: module_input_name {logits!r} is not what the Transformer module gives ({produced!r})"
        )
    # The saved modality config (else the one sentence-transformers infers: text, and message when the
    # tokenizer has a chat template) says how a pair reaches the model: with message, through the template.
    template = chat_template(path)
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
            chat_format = message_format(str(config.get("model_type", "")), template)
        if chat_format not in ("flat", "structured"):
            raise ValueError(f"{st_file}: message format {chat_format!r} is not flat or structured")
    if st.get("processing_kwargs") or st.get("do_lower_case"):
        raise ValueError(
            f"{st_file}: processing_kwargs and do_lower_case are not supported for a LogitScore model"
        )
    ce_file = path / "config_sentence_transformers.json"
    ce = read_json(ce_file) if ce_file.is_file() else {}
    if isinstance(ce, dict) and ce.get("default_prompt_name"):
        raise ValueError(f"{ce_file}: a default prompt is not supported for a LogitScore model")
    rerank = ce_activation(path, config, 1)
    return ScoreSpec("logit_score", ("score",), rerank, rerank, logit_ids=tuple(ids), chat_format=chat_format)


def chat_template(path: Path) -> Any:
    """The tokenizer's chat template as transformers reads it: chat_template.jinja, else the
    tokenizer_config.json key (a string, or a list of named templates); None without one."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    tk_file = path / "tokenizer_config.json"
    tk = read_json(tk_file) if tk_file.is_file() else {}
    return tk.get("chat_template") if isinstance(tk, dict) else None


# sentence-transformers' message format for a chat template (base/modality.py InputFormatter._infer_format):
# its model types known to be flat, else structured when the template reads typed content parts.
_FLAT_MODEL_TYPES = ("apertus", "deepseek_v3", "gpt_oss", "seed_oss")
_STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


def message_format(model_type: str, template: str) -> str:
    if model_type in _FLAT_MODEL_TYPES:
        return "flat"
    return "structured" if any(p in template for p in _STRUCTURED_PATTERNS) else "flat"


def vocab_id(path: Path, token: str) -> int:
    """A token's id from tokenizer.json (its added tokens, then the model's vocabulary)."""
    tok = read_json(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else {}
    for added in tok.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    raise ValueError(f"{path / 'tokenizer.json'}: no {token!r} token, which an LLM reranker scores")


def llm_reranker_spec(path: Path, family: Family) -> ScoreSpec:
    """Qwen3-Reranker style (--llm-reranker): a causal LM's `no` and `yes` logits at the last token."""
    if not family.causal:
        raise ValueError(f"--llm-reranker needs a causal LM (*ForCausalLM); {family.cls} is an encoder")
    ids = (vocab_id(path, "no"), vocab_id(path, "yes"))
    return ScoreSpec("yes_no", ("yes",), "yes_no", "yes_no", yes_no_ids=ids)
