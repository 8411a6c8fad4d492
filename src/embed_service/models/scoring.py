"""Scoring heads over a batch's last hidden states: a cross-encoder's classifier, an LLM reranker's yes/no.

Each head maps (T, H) hidden states of the flat batch and its cu_seqlens to (B, L) raw logits in float32
(the engine applies the activation: sigmoid, softmax, as the model's files ask). Module names mirror the
checkpoint's, so the tensors load by name; the backbone's loader ignores them (``classifier.``,
``pooler.``, ``head.``, ``lm_head.``) and `load_head` reads only these few tensors from the same files.

- BERT (BertForSequenceClassification): the pooler (dense + tanh on [CLS]), then ``classifier``.
- RoBERTa and XLM-RoBERTa (RobertaClassificationHead): ``classifier.dense`` + tanh on <s>, then
  ``classifier.out_proj``; no pooler.
- ModernBERT (ModernBertForSequenceClassification): [CLS] or the mean of the tokens
  (``classifier_pooling``), ``head.dense`` + the activation + ``head.norm``, then ``classifier``.
- Yes/no (Qwen3-Reranker style): the last token's hidden state times two rows of the LM head, the
  ``no`` and ``yes`` tokens' (``lm_head.weight``, or the embedding table when the two are tied). Only those
  two rows are read from the checkpoint (safetensors slices): 2 x H floats instead of V x H.
- LogitScore (sentence-transformers 6 LLM cross-encoders): the same rows for its true and, when it names
  one, false token; the score is the true token's logit less the false one's (or the true logit alone).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from embed_service.layers.activation import get_activation
from embed_service.layers.linear import Linear, dense
from embed_service.models.checkpoint import weight_files
from embed_service.models.spec import ModelSpec

# The backbone prefixes a head's tensors may carry in a checkpoint (bert.pooler.dense -> pooler.dense).
_PREFIXES = ("bert.", "roberta.", "model.")


def _firsts(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return hidden[cu_seqlens[:-1].long()]  # (B, H)


def _lasts(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return hidden[cu_seqlens[1:].long() - 1]  # (B, H)


def _means(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=hidden.device), lens)
    sums = torch.zeros(lens.numel(), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, seq, hidden) / lens[:, None].to(hidden.dtype)


class _Pooler(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.dense = Linear(h, h)


class BertScorer(nn.Module):
    """BertForSequenceClassification: classifier(tanh(pooler.dense(h[CLS])))."""

    def __init__(self, cfg: dict, labels: int):
        super().__init__()
        self.pooler = _Pooler(cfg["hidden_size"])
        self.classifier = Linear(cfg["hidden_size"], labels)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(_firsts(hidden, cu_seqlens))))


class _RobertaHead(nn.Module):
    def __init__(self, h: int, labels: int):
        super().__init__()
        self.dense = Linear(h, h)
        self.out_proj = Linear(h, labels)


class RobertaScorer(nn.Module):
    """RobertaClassificationHead: out_proj(tanh(dense(h[<s>])))."""

    def __init__(self, cfg: dict, labels: int):
        super().__init__()
        self.classifier = _RobertaHead(cfg["hidden_size"], labels)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(_firsts(hidden, cu_seqlens))))


class _ModernBertHead(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.dense = Linear(h, h, bias=cfg.get("classifier_bias", False))
        self.norm = nn.LayerNorm(h, eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))


class ModernBertScorer(nn.Module):
    """ModernBertForSequenceClassification: classifier(norm(act(dense(pool(h)))))."""

    def __init__(self, cfg: dict, labels: int):
        super().__init__()
        self.pool = _means if cfg.get("classifier_pooling", "cls") == "mean" else _firsts
        self.act = get_activation(cfg.get("classifier_activation", "gelu"))
        self.head = _ModernBertHead(cfg)
        self.classifier = Linear(cfg["hidden_size"], labels)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        h = self.head
        return self.classifier(h.norm(self.act(h.dense(self.pool(hidden, cu_seqlens)))))


class YesNoScorer(nn.Module):
    """The LM head's `no` and `yes` rows on the last token: (B, 2) logits [no, yes]."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.rows = nn.Parameter(torch.empty(2, cfg["hidden_size"]), requires_grad=False)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return dense(_lasts(hidden, cu_seqlens), self.rows)


class LogitScorer(nn.Module):
    """sentence-transformers' LogitScore on the last token: (B, 1) logit[true] - logit[false], or logit[true]
    when there is no false token. The two logits are taken apart and subtracted, as LogitScore does."""

    def __init__(self, cfg: dict, tokens: int):
        super().__init__()
        self.rows = nn.Parameter(torch.empty(tokens, cfg["hidden_size"]), requires_grad=False)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        logits = dense(_lasts(hidden, cu_seqlens), self.rows)
        return logits[:, :1] if logits.shape[1] == 1 else logits[:, :1] - logits[:, 1:2]


SCORERS = {"bert": BertScorer, "roberta": RobertaScorer, "modernbert": ModernBertScorer}


def _read(path: Path, wanted: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors named in `wanted` (parameter -> the names it may have in the files)."""
    by_name = {alias: param for param, aliases in wanted.items() for alias in aliases}
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name in by_name:
                        out[by_name[name]] = f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            out.update({by_name[k]: v for k, v in state.items() if k in by_name})
    return out


def _lm_rows(path: Path, cfg: dict, ids: tuple[int, ...]) -> torch.Tensor:
    """(len(ids), H): rows `ids` of the LM head (the embedding table when tied), reading only those rows."""
    names = ["lm_head.weight"]
    if cfg.get("tie_word_embeddings", False):
        names = ["model.embed_tokens.weight", "embed_tokens.weight", *names]
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                for name in names:
                    if name in keys:
                        table = f.get_slice(name)  # a view of the file: only the sliced rows are read
                        return torch.cat([table[i : i + 1] for i in ids])
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name in names:
                if name in state:
                    return state[name][list(ids)].clone()
    raise ValueError(f"{path}: no {' or '.join(names)} in the checkpoint, for the LLM reranker's scores")


def load_head(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The scoring head of `spec`, in float32 on `device`, its tensors read from the checkpoint."""
    score = spec.score
    assert score is not None
    if score.head == "yes_no":
        assert score.yes_no_ids is not None
        head: nn.Module = YesNoScorer(spec.config)
        head.rows.data = _lm_rows(spec.path, spec.config, score.yes_no_ids).float()
        return head.to(device)
    if score.head == "logit_score":
        assert score.logit_ids is not None
        head = LogitScorer(spec.config, len(score.logit_ids))
        head.rows.data = _lm_rows(spec.path, spec.config, score.logit_ids).float()
        return head.to(device)
    head = SCORERS[score.head](spec.config, len(score.labels))
    params = dict(head.state_dict())
    tensors = _read(spec.path, {p: [p, *(prefix + p for prefix in _PREFIXES)] for p in params})
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"{spec.path}: the classifier's weights are missing from the checkpoint: {missing}")
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    return head.float().to(device)
