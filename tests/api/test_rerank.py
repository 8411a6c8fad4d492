"""The rerank routes through the official cohere client, unchanged, and in Jina's shape over plain HTTP: the
scores and order of sentence-transformers' CrossEncoder, every bad input a 400 in the error shape, and an
embedding model asked to rerank (or a cross-encoder asked to embed) a clear 400.

The models: a tiny random BERT cross-encoder (the packaged model's WordPiece tokenizer) and the packaged
all-MiniLM-L6-v2, served together by one live server for the module (embed, then rerank, as a retrieval
pipeline does).
"""

from __future__ import annotations

import cohere
import httpx
import numpy as np
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.api.test_openapi import CHECKS
from tests.models.cross_encoders import bert_config, build
from tests.server import ServerProcess, read_corpus

KEY = "rerank-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = read_corpus("queries.jsonl", 1)[0]
DOCUMENTS = read_corpus("passages.jsonl", 12) + ["a", "short document"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("ce") / "tiny-ce"
    return build(
        "BertForSequenceClassification",
        bert_config(num_labels=1),
        "wordpiece",
        path,
        {"wordpiece": default_model_path},
    )


@pytest.fixture(scope="module")
def server(model_path, default_model_path):
    with ServerProcess(
        "--dtype",
        "float32",
        "--data-parallel-size",
        "1",
        "--model",
        str(model_path),
        "--served-model-name",
        "tiny-ce",
        # Capacity below a large request's documents: it is admitted piecewise, batched by tokens.
        "--max-client-batch-size",
        "4096",
        "--max-concurrent-requests",
        "512",
        "--model",
        str(default_model_path),
        "--served-model-name",
        "minilm",
        env={"EMBED_API_KEY": KEY},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_path):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_path), device="cpu")
    return model, model.predict([(QUERY, d) for d in DOCUMENTS]).astype(np.float32)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def test_cohere_v2_rerank_equals_cross_encoder_rank(server, reference):
    model, scores = reference
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=120)
    res = client.rerank(model="tiny-ce", query=QUERY, documents=DOCUMENTS, top_n=5)
    ranked = model.rank(QUERY, DOCUMENTS, top_k=5)
    assert len(res.results) == 5
    got = [r.index for r in res.results]
    assert np.all(np.diff(scores[got]) <= 2 * TOLERANCE)  # best first by the reference's scores
    for r in res.results:
        assert abs(r.relevance_score - scores[r.index]) <= TOLERANCE
    assert abs(res.results[0].relevance_score - ranked[0]["score"]) <= TOLERANCE
    assert res.meta.tokens.input_tokens > len(DOCUMENTS)


def test_cohere_v1_rerank_returns_documents(server, reference):
    _, scores = reference
    client = cohere.Client(base_url=server.url, api_key=KEY, timeout=120)
    docs = [{"text": d} if i % 2 else d for i, d in enumerate(DOCUMENTS)]  # both document shapes
    res = client.rerank(model="tiny-ce", query=QUERY, documents=docs, return_documents=True)
    assert sorted(r.index for r in res.results) == list(range(len(DOCUMENTS)))
    for r in res.results:
        assert r.document.text == DOCUMENTS[r.index]
        assert abs(r.relevance_score - scores[r.index]) <= TOLERANCE


def test_cohere_v2_rerank_returns_documents_through_request_options(server, reference):
    """cohere 7.x's ClientV2.rerank has no return_documents argument; the body parameter docs/api.md gives
    for it is sent and honoured."""
    _, scores = reference
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=120)
    res = client.rerank(
        model="tiny-ce",
        query=QUERY,
        documents=DOCUMENTS,
        top_n=3,
        request_options={"additional_body_parameters": {"return_documents": True}},
    )
    assert len(res.results) == 3
    for r in res.results:
        assert r.document == {"text": DOCUMENTS[r.index]}
        assert abs(r.relevance_score - scores[r.index]) <= TOLERANCE


def test_jina_shape_on_every_route(server, reference):
    _, scores = reference
    body = {"model": "tiny-ce", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 3}
    answers = [post(server, path, body) for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
    for r in answers:
        assert r.status_code == 200, r.text
        out = r.json()
        assert [x["index"] for x in out["results"]] == [x["index"] for x in answers[0].json()["results"]]
        assert out["usage"]["total_tokens"] == out["meta"]["tokens"]["input_tokens"]
        assert "document" not in out["results"][0]
    best = int(np.argmax(scores))
    assert answers[0].json()["results"][0]["index"] == best


def test_max_tokens_per_doc_cuts_each_document_first(server, model_path):
    """Against transformers: the pair [CLS] query [SEP] document [SEP] of the query's tokens and the
    document's first N tokens."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_path), dtype=torch.float32).eval()
    n = 9
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=120)
    res = client.rerank(model="tiny-ce", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=n)
    q = tok(QUERY, add_special_tokens=False)["input_ids"]
    for r in res.results:
        d = tok(DOCUMENTS[r.index], add_special_tokens=False)["input_ids"][:n]
        ids = [tok.cls_token_id, *q, tok.sep_token_id, *d, tok.sep_token_id]  # BERT's pair template
        types = [0] * (len(q) + 2) + [1] * (len(d) + 1)
        with torch.inference_mode():
            logit = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        assert abs(r.relevance_score - torch.sigmoid(logit).item()) <= TOLERANCE


def test_thousands_of_documents_are_admitted_and_batched(server):
    docs = [f"document number {i} about topic {i % 17}" for i in range(2000)]
    r = post(server, "/rerank", {"query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(x["index"] for x in results) == list(range(2000))
    sample = list(range(0, 2000, 400))
    alone = post(server, "/rerank", {"query": QUERY, "documents": [docs[i] for i in sample]}).json()[
        "results"
    ]
    by_index = {x["index"]: x["relevance_score"] for x in results}
    for x in alone:
        assert abs(x["relevance_score"] - by_index[sample[x["index"]]]) <= 1e-6


@pytest.mark.parametrize(
    "body, param",
    [
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": QUERY, "documents": ["a", "b"], "top_n": 0}, "top_n"),
        ({"documents": ["a", "b"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": QUERY, "documents": "a"}, "documents"),
        ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
        ({"query": QUERY, "documents": [{"txt": "a typo"}]}, "documents"),
        ({"query": QUERY, "documents": [3]}, "documents"),
        ({"query": QUERY, "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ({"query": QUERY, "documents": ["a"], "instruction": "rank"}, "instruction"),
        ({"query": QUERY, "documents": ["a"], "model": "no-such-model"}, None),
    ],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, body, param):
    r = post(server, "/v2/rerank", body)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is None:
        assert r.status_code == 404
    else:
        assert r.status_code == 400, r.text
        assert param in (error["param"] or "") + error["message"]
    assert post(server, "/rerank", {"query": QUERY, "documents": ["a"]}).status_code == 200


def test_refusals_name_the_field_and_the_form_a_client_meant(server):
    """A document object without a text says which document and which form is accepted (not a pydantic
    union branch); a pair past the max length with truncate false names documents (the route has no
    input field) and the document's index."""
    r = post(server, "/v2/rerank", {"model": "tiny-ce", "query": QUERY, "documents": ["ok", {"txt": "x"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "documents"
    assert "document 1" in error["message"] and '{"text": ...}' in error["message"], error
    assert ".str" not in error["message"]
    long = " ".join(["word"] * 600)
    body = {"model": "tiny-ce", "query": QUERY, "documents": ["short", long], "truncate": False}
    r = post(server, "/v2/rerank", body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "documents", error
    assert "document 1" in error["message"] and "truncate" in error["message"], error


def test_cohere_embed_refusals_name_texts(server):
    long = " ".join(["word"] * 600)
    body = {"model": "minilm", "texts": ["a", long], "truncate": "NONE"}
    r = post(server, "/v2/embed", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "texts", r.text


def test_cohere_client_raises_bad_request(server):
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=60)
    with pytest.raises(cohere.BadRequestError):
        client.rerank(model="tiny-ce", query=QUERY, documents=["a", "b"], top_n=0)


@pytest.mark.parametrize("top_n", [3, 2**31 - 1])
def test_top_n_past_the_documents_returns_every_document_best_first(server, reference, top_n):
    """LangChain's CohereRerank asks top_n=3 whatever the retrieval found: two documents answer both, in
    CrossEncoder.rank's order (as Cohere's and vLLM's rerank do), not a 400."""
    model, _ = reference
    docs = DOCUMENTS[:2]
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=60)
    res = client.rerank(model="tiny-ce", query=QUERY, documents=docs, top_n=top_n)
    expected = model.rank(QUERY, docs)
    assert [r.index for r in res.results] == [r["corpus_id"] for r in expected]
    for got, want in zip(res.results, expected):
        assert abs(got.relevance_score - float(want["score"])) <= TOLERANCE


def test_an_embedding_model_does_not_rerank_and_a_cross_encoder_does_not_embed(server):
    r = post(server, "/rerank", {"model": "minilm", "query": QUERY, "documents": ["a"]})
    assert r.status_code == 400
    assert "embedding model" in r.json()["error"]["message"]
    r = post(server, "/classify", {"model": "minilm", "input": ["a"]})
    assert r.status_code == 400
    r = post(server, "/v1/embeddings", {"model": "tiny-ce", "input": ["a"]})
    assert r.status_code == 400
    assert "does not embed" in r.json()["error"]["message"]
    client = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=60)
    with pytest.raises(cohere.BadRequestError):
        client.embed(model="tiny-ce", texts=["a"], input_type="search_query", embedding_types=["float"])
    # The pipeline's two steps on one server: embed with one model, rerank with the other.
    assert post(server, "/v1/embeddings", {"model": "minilm", "input": ["a"]}).status_code == 200
    assert (
        post(server, "/v2/rerank", {"model": "tiny-ce", "query": "q", "documents": ["a"]}).status_code == 200
    )


def test_a_key_is_required(server):
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": ["a"]}, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize("path", ["/v2/rerank", "/classify"])
def test_fuzzed_from_its_own_openapi_no_5xx_and_every_answer_as_described(server, path):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
    )

    @settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases)
    def fuzz(case) -> None:
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    fuzz()
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.get(200) and statuses.get(400), statuses  # both kinds of case reached the server
