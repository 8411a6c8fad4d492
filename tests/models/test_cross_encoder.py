"""Cross-encoders and sequence classifiers, served in float32, equal their references on tiny random weights.

Rerank against sentence-transformers' CrossEncoder.predict and .rank on the same folder (the pair template,
token types, longest_first truncation, the pooler and classifier heads and the saved activation all
matter); /classify against the transformers text-classification pipeline. Scores within 1e-5, the same
order. Also: a document's score does not depend on what it is batched with, and a cross-encoder split over
two tensor-parallel ranks scores as one does.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers as T

from tests.models.cross_encoders import bert_config, build, xlmr_config
from tests.models.tiny import EDGE_TEXTS
from tests.server import ServerProcess, read_corpus

QUERIES = read_corpus("queries.jsonl", 2) + [" ".join(["query"] * 150)]  # the last: longer than any limit
DOCUMENTS = read_corpus("passages.jsonl", 24) + EDGE_TEXTS  # long passages: truncated, longest_first
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    model_class: str
    config: object
    tokenizer: str
    max_length: int | None = None
    activation: torch.nn.Module | None = None


CASES = [
    # [CLS] q [SEP] d [SEP] with token types 0 then 1; pooler + classifier; CrossEncoder's default sigmoid.
    Case("bert", "BertForSequenceClassification", bert_config(num_labels=1), "wordpiece"),
    # <s> q </s></s> d </s>, no token types, positions after the padding index; the saved Identity
    # activation (raw logits) read from config_sentence_transformers.json.
    Case(
        "xlm-roberta",
        "XLMRobertaForSequenceClassification",
        xlmr_config(num_labels=1),
        "bpe-template",
        max_length=96,
        activation=torch.nn.Identity(),
    ),
    Case(
        "modernbert",
        "ModernBertForSequenceClassification",
        T.ModernBertConfig(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=96,
            num_hidden_layers=3,
            vocab_size=30522,
            pad_token_id=0,
            cls_token_id=101,
            sep_token_id=102,
            bos_token_id=101,
            eos_token_id=102,
            max_position_embeddings=160,
            local_attention=16,
            global_attn_every_n_layers=2,
            classifier_pooling="mean",
            classifier_bias=True,
            num_labels=1,
        ),
        "wordpiece",
        max_length=160,
    ),
]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
# Qwen3-Reranker's shape in miniature: the LM head apart from the embedding table (as in the 4B and 8B).
QWEN3 = T.Qwen3Config(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=96,
    num_hidden_layers=3,
    vocab_size=49152,
    max_position_embeddings=256,
    pad_token_id=0,
    rope_theta=50000.0,
    tie_word_embeddings=False,
)


@dataclass
class Served:
    path: Path
    server: ServerProcess


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_sources) -> Iterator[dict[str, Served]]:
    """Every tiny model and its server, started together (one module-wide server each)."""
    root = tmp_path_factory.mktemp("scoring")
    paths = {
        c.name: build(
            c.model_class,
            c.config,
            c.tokenizer,
            root / c.name,
            tokenizer_sources,
            c.activation,
            max_length=c.max_length,
        )
        for c in CASES
    }
    paths["classifier"] = build(
        "BertForSequenceClassification",
        bert_config(num_labels=3, id2label=LABELS, problem_type="single_label_classification"),
        "wordpiece",
        root / "classifier",
        tokenizer_sources,
        cross_encoder=False,
        max_length=128,
    )
    common = ("--dtype", "float32", "--data-parallel-size", "1")
    servers = {name: ServerProcess("--model", str(p), *common) for name, p in paths.items()}

    paths["qwen3-reranker"] = build(
        "Qwen3ForCausalLM", QWEN3, "bpe", root / "qwen3-reranker", tokenizer_sources, cross_encoder=False
    )
    servers["qwen3-reranker"] = ServerProcess(
        "--model", str(paths["qwen3-reranker"]), *common, "--llm-reranker"
    )
    # The same causal LM saved by sentence-transformers 6 as an LLM cross-encoder (Transformer + LogitScore),
    # served without --llm-reranker.
    paths["logit-score"] = build("Qwen3ForCausalLM", QWEN3, "bpe", root / "logit-score", tokenizer_sources)
    servers["logit-score"] = ServerProcess("--model", str(paths["logit-score"]), *common)
    servers["bert-tp2"] = ServerProcess(
        "--model", str(paths["bert"]), "--dtype", "float32", "--tensor-parallel-size", "2"
    )
    try:
        for s in servers.values():
            s.wait_healthy()
        yield {name: Served(paths.get(name, paths["bert"]), s) for name, s in servers.items()}
    finally:
        with ThreadPoolExecutor(len(servers)) as pool:  # their drains overlap
            list(pool.map(lambda s: s.stop(), servers.values()))


def rerank(server: ServerProcess, query: str, documents: list[str], **extra: object) -> dict:
    r = httpx.post(
        server.url + "/rerank", json={"query": query, "documents": documents, **extra}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def scores_by_index(body: dict, n: int) -> np.ndarray:
    out = np.full(n, np.nan, dtype=np.float32)
    for item in body["results"]:
        out[item["index"]] = item["relevance_score"]
    return out


def cross_encoder(path: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu")


def assert_same_order(ours: list[int], reference: np.ndarray) -> None:
    """`ours` ranks best first by the reference's scores: where two swap, they tie within the tolerance."""
    ranked = reference[ours]
    assert np.all(np.diff(ranked) <= 2 * TOLERANCE), (ours, ranked)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_rerank_equals_cross_encoder_predict(served, name):
    model = cross_encoder(served[name].path)
    for query in QUERIES:
        body = rerank(served[name].server, query, DOCUMENTS)
        ours = scores_by_index(body, len(DOCUMENTS))
        reference = model.predict([(query, d) for d in DOCUMENTS], batch_size=16).astype(np.float32)
        np.testing.assert_allclose(ours, reference, rtol=0, atol=TOLERANCE)
        assert_same_order([r["index"] for r in body["results"]], reference)
        assert body["usage"]["total_tokens"] > len(DOCUMENTS)


@pytest.mark.parametrize("name", ["bert", "xlm-roberta"])
def test_top_n_and_documents_equal_cross_encoder_rank(served, name):
    model = cross_encoder(served[name].path)
    query = QUERIES[0]
    docs = DOCUMENTS[:20]
    body = rerank(served[name].server, query, docs, top_n=5, return_documents=True)
    reference = model.rank(query, docs, top_k=5, return_documents=True)
    assert len(body["results"]) == 5
    full = model.predict([(query, d) for d in docs]).astype(np.float32)
    assert_same_order([r["index"] for r in body["results"]], full)
    # The best five are the reference's best five (up to ties at the cut).
    cut = reference[-1]["score"]
    assert {r["index"] for r in body["results"] if r["relevance_score"] > cut + TOLERANCE} <= {
        r["corpus_id"] for r in reference
    }
    for r in body["results"]:
        assert r["document"] == {"text": docs[r["index"]]}
        assert abs(r["relevance_score"] - full[r["index"]]) <= TOLERANCE


def test_a_documents_score_does_not_depend_on_its_batch(served):
    server = served["bert"].server
    query = QUERIES[1]
    together = scores_by_index(rerank(server, query, DOCUMENTS), len(DOCUMENTS))
    alone = np.array([rerank(server, query, [d])["results"][0]["relevance_score"] for d in DOCUMENTS[::5]])
    np.testing.assert_allclose(alone, together[::5], rtol=0, atol=1e-6)
    shuffled = list(range(len(DOCUMENTS)))[::-1]
    reordered = scores_by_index(rerank(server, query, [DOCUMENTS[i] for i in shuffled]), len(DOCUMENTS))
    np.testing.assert_allclose(reordered, together[shuffled], rtol=0, atol=1e-6)


def test_tensor_parallel_cross_encoder_scores_as_one_rank(served):
    query = QUERIES[0]
    one = scores_by_index(rerank(served["bert"].server, query, DOCUMENTS), len(DOCUMENTS))
    two = scores_by_index(rerank(served["bert-tp2"].server, query, DOCUMENTS), len(DOCUMENTS))
    np.testing.assert_allclose(two, one, rtol=0, atol=TOLERANCE)
    ranks = httpx.get(served["bert-tp2"].server.url + "/info", timeout=10).json()["parameter_bytes_per_rank"]
    assert len(ranks) == 2


def test_truncate_false_refuses_a_pair_past_the_max_length(served):
    r = httpx.post(
        served["bert"].server.url + "/rerank",
        json={"query": QUERIES[-1], "documents": ["short", DOCUMENTS[0]], "truncate": False},
        timeout=60,
    )
    assert r.status_code == 400
    assert "more than the maximum of 128 tokens" in r.json()["error"]["message"]


def test_classify_equals_the_text_classification_pipeline(served):
    from transformers import pipeline

    texts = read_corpus("queries.jsonl", 12) + EDGE_TEXTS
    r = httpx.post(served["classifier"].server.url + "/classify", json={"input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    classifier = pipeline("text-classification", model=str(served["classifier"].path), device="cpu")
    reference = classifier(texts, top_k=None, truncation=True)
    for item, ref in zip(body["data"], reference):
        by_label = {x["label"]: x["score"] for x in ref}
        probs = np.array([by_label[LABELS[i]] for i in range(3)], dtype=np.float32)
        np.testing.assert_allclose(item["probs"], probs, rtol=0, atol=TOLERANCE)
        assert item["num_classes"] == 3
        assert by_label[item["label"]] == max(by_label.values())
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    one = httpx.post(served["classifier"].server.url + "/classify", json={"input": texts[0]}, timeout=60)
    np.testing.assert_allclose(one.json()["data"][0]["probs"], body["data"][0]["probs"], rtol=0, atol=1e-6)


def test_a_classifier_with_several_labels_does_not_rerank(served):
    r = httpx.post(
        served["classifier"].server.url + "/rerank", json={"query": "q", "documents": ["d"]}, timeout=60
    )
    assert r.status_code == 400
    assert "3 labels" in r.json()["error"]["message"]


def qwen3_reranker_reference(path: Path, query: str, documents: list[str], instruction: str) -> np.ndarray:
    """Qwen3-Reranker's model-card code: prefix + the formatted pair (truncated) + suffix, left-padded
    batches, the `yes` against `no` logits at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prefix = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
        'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tok.encode(prefix, add_special_tokens=False)
    suffix_tokens = tok.encode(suffix, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    max_length = 256
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in documents]
    out = []
    for start in range(0, len(pairs), 8):
        inputs = tok(
            pairs[start : start + 8],
            padding=False,
            truncation="longest_first",
            return_attention_mask=False,
            add_special_tokens=False,
            max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
        )
        for i, ele in enumerate(inputs["input_ids"]):
            inputs["input_ids"][i] = prefix_tokens + ele + suffix_tokens
        inputs = tok.pad(inputs, padding=True, return_tensors="pt")
        with torch.inference_mode():
            logits = model(**inputs).logits[:, -1, :]
        scores = torch.stack([logits[:, no], logits[:, yes]], dim=1)
        out.append(torch.nn.functional.log_softmax(scores, dim=1)[:, 1].exp().numpy())
    return np.concatenate(out).astype(np.float32)


def test_llm_reranker_equals_the_causal_lm_on_its_prompt(served):
    path, server = served["qwen3-reranker"].path, served["qwen3-reranker"].server
    default = "Given a web search query, retrieve relevant passages that answer the query"
    for query, instruction in ((QUERIES[0], None), (QUERIES[-1], "Find the passage about the topic")):
        extra = {"instruction": instruction} if instruction else {}
        body = rerank(server, query, DOCUMENTS, **extra)
        ours = scores_by_index(body, len(DOCUMENTS))
        reference = qwen3_reranker_reference(path, query, DOCUMENTS, instruction or default)
        np.testing.assert_allclose(ours, reference, rtol=0, atol=TOLERANCE)
        assert_same_order([r["index"] for r in body["results"]], reference)
    info = httpx.get(server.url + "/info", timeout=10).json()
    # The yes/no head: two rows of the LM head, not its 49,152.
    hidden = QWEN3.hidden_size
    embedding_and_layers = info["parameter_bytes_per_rank"][0] - 2 * hidden * 4
    assert embedding_and_layers < 2 * QWEN3.vocab_size * hidden * 4  # no second V x H table
    r = httpx.post(server.url + "/classify", json={"input": ["a"]}, timeout=30)
    assert r.status_code == 400


def test_logit_score_folder_equals_cross_encoder_predict(served):
    """A sentence-transformers 6 LLM cross-encoder folder, detected by its LogitScore module: its scores are
    CrossEncoder.predict's (the true-token logit less the false one's at the last token, then sigmoid) on the
    pairs as it tokenizes them (no chat template: tokenizer(query, document), longest_first)."""
    from sentence_transformers.cross_encoder.modules import LogitScore

    path, server = served["logit-score"].path, served["logit-score"].server
    model = cross_encoder(path)
    assert isinstance(model[-1], LogitScore) and model[-1].false_token_id is not None
    worst = 0.0
    for query in QUERIES:  # two short queries and one past the max length with the long passages
        body = rerank(server, query, DOCUMENTS)
        ours = scores_by_index(body, len(DOCUMENTS))
        reference = model.predict([(query, d) for d in DOCUMENTS], batch_size=16).astype(np.float32)
        worst = max(worst, float(np.abs(ours - reference).max()))
        np.testing.assert_allclose(ours, reference, rtol=0, atol=TOLERANCE)
        assert_same_order([r["index"] for r in body["results"]], reference)
    print(f"LogitScore folder: max abs diff to CrossEncoder.predict {worst:.2e}")
    info = httpx.get(server.url + "/info", timeout=10).json()
    assert info["outputs"] == ["score"]
    # Two LM-head rows, not the 49,152-row table.
    assert info["parameter_bytes_per_rank"][0] < 2 * QWEN3.vocab_size * QWEN3.hidden_size * 4
    r = httpx.post(server.url + "/classify", json={"input": ["a"]}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(
        server.url + "/rerank", json={"query": "q", "documents": ["d"], "instruction": "x"}, timeout=30
    )
    assert r.status_code == 400  # CrossEncoder has no instruction to give


def _edited_copy(src: Path, dst: Path, file: str, **changes: object) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / file).read_text())
    cfg.update(changes)
    (dst / file).write_text(json.dumps(cfg))
    return dst


def _in_process_scores(path: Path, query: str, documents: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    """The spec, pair tokenizer and head the server would use, on the CrossEncoder's own backbone's last
    hidden states: (scores after the activation, the token ids of each pair)."""
    from tokenizers import Tokenizer

    from embed_service.engine.scoring import activate, pair_tokenizer
    from embed_service.models.scoring import load_head
    from embed_service.models.spec import load_spec

    spec = load_spec(path)
    assert spec.score is not None
    head = load_head(spec, torch.device("cpu"))
    backbone = cross_encoder(path)[0].model.model
    pairs = pair_tokenizer(spec, Tokenizer.from_file(str(path / "tokenizer.json")).to_str(), "")
    logits, tokens = [], []
    with torch.inference_mode():
        for ids, _ in pairs.encode(query, documents, truncate=True):
            hidden = backbone(torch.tensor([ids])).last_hidden_state[0]
            logits.append(head(hidden, torch.tensor([0, len(ids)], dtype=torch.int32)).numpy()[0])
            tokens.append(ids)
    return activate(np.array(logits), spec.score.rerank_activation)[:, 0], tokens


def test_logit_score_true_token_only_equals_cross_encoder(served, tmp_path):
    """false_token_id null: the score is sigmoid(logit of the true token)."""
    from embed_service.models.spec import load_spec

    path = _edited_copy(
        served["logit-score"].path, tmp_path / "true-only", "1_LogitScore/config.json", false_token_id=None
    )
    spec = load_spec(path)
    assert spec.score is not None and spec.score.logit_ids is not None and len(spec.score.logit_ids) == 1
    model = cross_encoder(path)
    assert model[-1].false_token_id is None
    query, documents = QUERIES[0], DOCUMENTS[::4]
    ours, _ = _in_process_scores(path, query, documents)
    reference = model.predict([(query, d) for d in documents]).astype(np.float32)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=TOLERANCE)


# Reranker chat templates of the kind sentence-transformers 6 documents: the pair as a `query` and a
# `document` message, content as text (flat) or as typed parts (structured), ending on the assistant turn.
_TEMPLATE = """{%- set query = QUERY -%}
{%- set document = DOCUMENT -%}
<|im_start|>system
Judge whether the Document is relevant to the Query. Answer only "yes" or "no".<|im_end|>
<|im_start|>user
<Query>: {{ query }}
<Document>: {{ document }}<|im_end|>
<|im_start|>assistant
"""
FLAT = _TEMPLATE.replace(
    "QUERY", 'messages | selectattr("role", "eq", "query") | map(attribute="content") | first'
).replace("DOCUMENT", 'messages | selectattr("role", "eq", "document") | map(attribute="content") | first')
STRUCTURED = _TEMPLATE.replace(
    "QUERY", '(messages | selectattr("role", "eq", "query") | first).content[0].text'
).replace("DOCUMENT", '(messages | selectattr("role", "eq", "document") | first).content[0].text')


@pytest.mark.parametrize(("chat_format", "template"), [("flat", FLAT), ("structured", STRUCTURED)])
def test_logit_score_chat_template_pairs_equal_cross_encoder(
    tmp_path, tokenizer_sources, chat_format, template
):
    """With a chat template, CrossEncoder renders each pair through it (the message modality): the same
    token ids as its preprocess, to the id, including rows cut at the max length with the template's tail
    written back; the same scores."""
    from embed_service.models.spec import load_spec

    path = build(
        "Qwen3ForCausalLM",
        QWEN3,
        "bpe",
        tmp_path / "chat",
        tokenizer_sources,
        chat_template=template,
        max_length=64,
    )
    spec = load_spec(path)
    assert spec.score is not None and spec.score.chat_format == chat_format
    model = cross_encoder(path)
    query, documents = QUERIES[0], DOCUMENTS[::3]  # passages past 64 tokens and short edge texts
    ours, tokens = _in_process_scores(path, query, documents)
    features = model[0].preprocess([(query, d) for d in documents])
    expected = [
        row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"])
    ]
    assert tokens == expected
    assert any(len(t) == 64 for t in tokens) and any(len(t) < 64 for t in tokens)
    reference = model.predict([(query, d) for d in documents]).astype(np.float32)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(
    ("file", "changes", "message"),
    [
        ("1_LogitScore/config.json", {"module_input_name": "token_embeddings"}, "module_input_name"),
        ("1_LogitScore/config.json", {"true_token_id": 10**6}, "true_token_id"),
        (
            "sentence_bert_config.json",
            {
                "modality_config": {
                    "text": {"method": "forward", "method_output_name": "logits"},
                    "message": {},
                }
            },
            "chat template",
        ),
    ],
)
def test_an_unsupported_logit_score_folder_is_refused_at_start(served, tmp_path, file, changes, message):
    from embed_service.models.spec import load_spec

    path = _edited_copy(served["logit-score"].path, tmp_path / "bad", file, **changes)
    with pytest.raises(ValueError, match=message):
        load_spec(path)
