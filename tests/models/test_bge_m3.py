"""bge-m3's three outputs (dense, sparse, ColBERT) from one forward, against FlagEmbedding's formulas.

A tiny random XLM-RoBERTa with random heads, saved in bge-m3's layout (``sparse_linear.pt``,
``colbert_linear.pt`` beside the weights; CLS pooling and Normalize as sentence-transformers files), served
by a real server in float32. The reference is BGEM3FlagModel's computation written out in plain torch over
transformers' hidden states (right-padded batches with an attention mask): FlagEmbedding 1.4.2 cannot be
imported beside transformers 5 (its package imports ``transformers.modeling_attn_mask_utils``, which
transformers 5 removed). Formulas from FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py and
inference/embedder/encoder_only/m3.py:
dense = normalize(h[:, 0]); sparse = relu(sparse_linear(h)) per token, cls/eos/pad/unk dropped, weights
> 0, the maximum per token id; colbert = normalize(colbert_linear(h[:, 1:]) * mask[:, 1:]), the first
(tokens - 1) rows.
"""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers as T

from tests.models.tiny import Tiny, build, texts
from tests.server import ServerProcess

TINY = Tiny(
    "bge-m3",
    "XLMRobertaModel",
    lambda: T.XLMRobertaConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=96,
        num_hidden_layers=3,
        vocab_size=49152,
        pad_token_id=3,
        max_position_embeddings=300,
        type_vocab_size=1,
    ),
    tokenizer="bpe-template",
    pooling="cls",
    normalize=True,
    max_seq_length=96,
)
COLBERT_DIM = 48  # not the hidden size: a wrong head shape cannot pass


def write_bge_m3(path: Path, sources: dict[str, Path]) -> Path:
    build(TINY, path, sources)
    from transformers import AutoTokenizer

    # XLM-R's special tokens: <s> is the CLS token and </s> the EOS token (here SmolLM2's chat markers,
    # which the template puts around every text), as bge-m3's tokenizer declares them.
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.cls_token, tok.eos_token = "<|im_start|>", "<|im_end|>"
    tok.save_pretrained(str(path))
    g = torch.Generator().manual_seed(1)
    hidden = TINY.config().hidden_size
    sparse = torch.nn.Linear(hidden, 1)
    colbert = torch.nn.Linear(hidden, COLBERT_DIM)
    with torch.no_grad():
        for layer in (sparse, colbert):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.3)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    return path


def reference(path: Path, inputs: list[str]) -> tuple[np.ndarray, list[dict[int, float]], list[np.ndarray]]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    sparse_linear = torch.nn.Linear(model.config.hidden_size, 1)
    sparse_linear.load_state_dict(torch.load(path / "sparse_linear.pt", weights_only=True))
    colbert_linear = torch.nn.Linear(model.config.hidden_size, COLBERT_DIM)
    colbert_linear.load_state_dict(torch.load(path / "colbert_linear.pt", weights_only=True))
    unused = {
        tok.convert_tokens_to_ids(tok.special_tokens_map[t])
        for t in ("cls_token", "eos_token", "pad_token", "unk_token")
        if t in tok.special_tokens_map
    }
    dense, sparse, colbert = [], [], []
    with torch.inference_mode():
        for start in range(0, len(inputs), 16):
            enc = tok(
                inputs[start : start + 16],
                truncation=True,
                max_length=TINY.max_seq_length,
                padding=True,
                return_tensors="pt",
            )
            h = model(**enc).last_hidden_state
            dense.append(torch.nn.functional.normalize(h[:, 0], dim=-1).numpy())
            weights = torch.relu(sparse_linear(h)).squeeze(-1)
            vecs = colbert_linear(h[:, 1:]) * enc["attention_mask"][:, 1:][:, :, None].float()
            vecs = torch.nn.functional.normalize(vecs, dim=-1)
            for row in range(h.shape[0]):
                result: dict[int, float] = {}
                for w, idx in zip(weights[row].tolist(), enc["input_ids"][row].tolist()):
                    if idx not in unused and w > 0 and w > result.get(idx, 0):
                        result[idx] = w
                sparse.append(result)
                n = int(enc["attention_mask"][row].sum())
                colbert.append(vecs[row, : n - 1].numpy())
    return np.concatenate(dense), sparse, colbert


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_sources):
    path = write_bge_m3(tmp_path_factory.mktemp("bge-m3"), tokenizer_sources)
    plain = tmp_path_factory.mktemp("xlmr-plain") / "model"
    shutil.copytree(path, plain, ignore=shutil.ignore_patterns("*.pt"))
    servers = [ServerProcess("--model", str(p), "--dtype", "float32") for p in (path, plain)]
    try:
        for s in servers:
            s.wait_healthy()
        yield path, servers[0].url, servers[1].url
    finally:
        for s in servers:
            s.stop()


def post(url: str, body: dict, route: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=300)


def all_outputs(url: str, inputs, **kw) -> list[dict]:
    r = post(url, {"input": inputs, "outputs": ["dense", "sparse", "colbert"], **kw})
    assert r.status_code == 200, r.text
    return r.json()["data"]


@pytest.fixture(scope="module")
def ours_and_ref(served):
    path, url, _ = served
    inputs = texts()
    return inputs, all_outputs(url, inputs), reference(path, inputs)


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_three_outputs_match_flagembedding_formulas(served, ours_and_ref):
    from transformers import AutoTokenizer

    inputs, data, (dense, sparse, colbert) = ours_and_ref
    tok = AutoTokenizer.from_pretrained(str(served[0]))
    special = {tok.cls_token_id, tok.eos_token_id, tok.pad_token_id}
    ours_dense = np.array([d["embedding"] for d in data], dtype=np.float32)
    dense_cos = cos_rows(ours_dense, dense)
    worst_colbert, worst_sparse = 1.0, 0.0
    for i, item in enumerate(data):
        got = dict(zip(item["sparse"]["indices"], item["sparse"]["values"]))
        assert set(got) == set(sparse[i]), f"text {i}: token sets differ"
        assert not set(got) & special, f"text {i}: a special token has a weight"
        assert item["sparse"]["indices"] == sorted(got)
        if got:
            worst_sparse = max(worst_sparse, max(abs(got[k] - sparse[i][k]) for k in got))
        matrix = np.array(item["colbert"], dtype=np.float32)
        assert matrix.shape == colbert[i].shape, f"text {i}"
        worst_colbert = min(worst_colbert, float(cos_rows(matrix, colbert[i]).min()))
    print(
        f"\nbge-m3 tiny over {len(inputs)} texts: dense min cosine {dense_cos.min():.8f}, colbert min cosine "
        f"{worst_colbert:.8f}, sparse max |diff| {worst_sparse:.2e}"
    )
    assert dense_cos.min() >= 0.99999
    assert worst_colbert >= 0.99999
    assert worst_sparse <= 1e-5
    assert sum(len(s) for s in sparse) > len(inputs)  # the heads are not all-zero: the test can fail


def test_dense_alone_is_the_openai_shape(served, ours_and_ref):
    _, url, _ = served
    inputs, data, _ = ours_and_ref
    body = post(url, {"input": inputs[:5]}).json()
    assert set(body["data"][0]) == {"object", "index", "embedding"}
    np.testing.assert_allclose(
        [d["embedding"] for d in body["data"]], [d["embedding"] for d in data[:5]], atol=1e-6
    )


def test_batch_invariance_across_output_kinds(served, ours_and_ref):
    """A text asking for one output alone gives what it gets in the mixed batch that asks for all three."""
    _, url, _ = served
    inputs, data, _ = ours_and_ref
    for i in (0, 23, len(inputs) - 7):
        for kind in ("dense", "sparse", "colbert"):
            r = post(url, {"input": inputs[i], "outputs": [kind]})
            assert r.status_code == 200, r.text
            item = r.json()["data"][0]
            key = {"dense": "embedding"}.get(kind, kind)
            assert set(item) == {"object", "index", key}
            if kind == "sparse":
                assert item["sparse"]["indices"] == data[i]["sparse"]["indices"]
                np.testing.assert_allclose(item["sparse"]["values"], data[i]["sparse"]["values"], atol=1e-5)
            else:
                np.testing.assert_allclose(item[key], data[i][key], atol=1e-5, err_msg=f"{kind} text {i}")


def test_token_ids_equal_text(served, ours_and_ref):
    _, url, _ = served
    inputs, data, _ = ours_and_ref
    ids = httpx.post(url + "/tokenize", json={"input": inputs[:4]}).json()["data"]
    by_ids = all_outputs(url, [d["tokens"] for d in ids])
    for a, b in zip(by_ids, data[:4]):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)
        assert a["sparse"]["indices"] == b["sparse"]["indices"]
        np.testing.assert_allclose(a["colbert"], b["colbert"], atol=1e-6)


def test_base64_colbert_is_one_string_per_vector(served, ours_and_ref):
    _, url, _ = served
    inputs, data, _ = ours_and_ref
    item = all_outputs(url, inputs[1], encoding_format="base64")[0]
    rows = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in item["colbert"]]
    np.testing.assert_allclose(rows, data[1]["colbert"], atol=1e-6)


def test_embed_sparse_alias(served, ours_and_ref):
    _, url, _ = served
    inputs, data, _ = ours_and_ref
    r = post(url, {"inputs": inputs[:3]}, route="/embed_sparse")
    assert r.status_code == 200, r.text
    for got, want in zip(r.json(), data[:3]):
        assert [p["index"] for p in got] == want["sparse"]["indices"]
        np.testing.assert_allclose([p["value"] for p in got], want["sparse"]["values"], atol=1e-5)


def test_embed_sparse_writes_each_weight_as_its_float32_short_form(served, ours_and_ref):
    """Was: /embed_sparse wrote the weights as 17-digit doubles (0.18700000643730164) where /v1/embeddings
    writes the shortest text that reads back as the same float32 (0.187): the same weight in two forms."""
    _, url, _ = served
    inputs, _, _ = ours_and_ref
    sparse = post(url, {"inputs": inputs[:3]}, route="/embed_sparse")
    embeddings = post(url, {"input": inputs[:3], "outputs": ["sparse"]})
    assert sparse.status_code == embeddings.status_code == 200
    written = re.findall(r'"value":([^,}]+)', sparse.text)
    assert written == [
        v for lst in re.findall(r'"values":\[([^\]]*)\]', embeddings.text) for v in lst.split(",") if v
    ]
    for text in written:
        assert float(text) == float(str(np.float32(text))), text  # numpy's shortest float32 form
    assert len(written) == sum(len(d["sparse"]["values"]) for d in embeddings.json()["data"]) > 0


def test_a_model_without_the_heads_refuses_them(served):
    _, url, plain = served
    assert httpx.get(url + "/info").json()["outputs"] == ["dense", "sparse", "colbert"]
    assert httpx.get(plain + "/info").json()["outputs"] == ["dense"]
    for kind, route, body in (
        ("sparse", "/v1/embeddings", {"input": "x", "outputs": ["dense", "sparse"]}),
        ("colbert", "/v1/embeddings", {"input": "x", "outputs": ["colbert"]}),
        ("sparse", "/embed_sparse", {"inputs": "x"}),
    ):
        r = post(plain, body, route=route)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "outputs" and kind in err["message"]
    r = post(url, {"input": "x", "outputs": ["splade"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "outputs"
    r = post(plain, {"input": "x"})
    assert r.status_code == 200


def test_openai_client_unchanged_with_extra_body(served, ours_and_ref):
    """The official client: plain dense as ever, and the extension through extra_body / model_extra."""
    from openai import OpenAI

    _, url, _ = served
    inputs, data, _ = ours_and_ref
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    name = httpx.get(url + "/info").json()["model"]
    r = client.embeddings.create(model=name, input=inputs[:2])
    np.testing.assert_allclose([d.embedding for d in r.data], [d["embedding"] for d in data[:2]], atol=1e-6)
    r = client.embeddings.create(
        model=name, input=inputs[:2], encoding_format="float", extra_body={"outputs": ["dense", "sparse"]}
    )
    for got, want in zip(r.data, data[:2]):
        assert got.model_extra["sparse"]["indices"] == want["sparse"]["indices"]
        np.testing.assert_allclose(got.model_extra["sparse"]["values"], want["sparse"]["values"], atol=1e-6)


def test_sparse_tokens_name_the_ids(served, ours_and_ref):
    from transformers import AutoTokenizer

    path, url, _ = served
    inputs, data, _ = ours_and_ref
    r = post(url, {"input": inputs[:3], "outputs": ["sparse"], "sparse_tokens": True})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(str(path))
    for got, want in zip(r.json()["data"], data[:3]):
        assert got["sparse"]["indices"] == want["sparse"]["indices"]
        assert got["sparse"]["tokens"] == tok.convert_ids_to_tokens(want["sparse"]["indices"])


def test_chunking_takes_the_dense_output_only(served):
    """Windows are averaged as dense vectors: a chunked request asking for sparse or ColBERT is a 400,
    and the server keeps serving."""
    _, url, _ = served
    for outputs in (["dense", "sparse"], ["colbert"]):
        r = post(url, {"input": "x", "outputs": outputs, "chunking": {}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chunking"
    r = post(url, {"input": "x", "outputs": ["dense"], "chunking": {}})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0


def test_encoding_fields_without_a_dense_output_or_beside_colbert_are_refused(served):
    """dimensions, embed_dtype and embed_ranges shape dense vectors: with sparse or ColBERT outputs alone
    they are a 400 naming the field (they were ignored), and a non-float32 embed_dtype beside ColBERT
    vectors (sent as float32) is too; float32 beside them, and int8 on dense alone, still serve."""
    _, url, _ = served
    for body, param in [
        ({"outputs": ["sparse"], "dimensions": 8}, "dimensions"),
        ({"outputs": ["sparse"], "embed_dtype": "int8"}, "embed_dtype"),
        ({"outputs": ["colbert"], "embed_ranges": [-1, 1]}, "embed_ranges"),
        ({"outputs": ["dense", "colbert"], "embed_dtype": "binary"}, "embed_dtype"),
        ({"outputs": ["colbert"], "embed_dtype": "float16"}, "embed_dtype"),
    ]:
        r = post(url, {"input": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = post(url, {"input": "x", "outputs": ["dense", "colbert"], "embed_dtype": "float32"})
    assert ok.status_code == 200 and ok.json()["data"][0]["colbert"]
    ok = post(url, {"input": "x", "outputs": ["dense"], "embed_dtype": "int8"})
    assert ok.status_code == 200 and all(isinstance(v, int) for v in ok.json()["data"][0]["embedding"])


def test_max_active_dims_and_threshold_on_lexical_weights(served, ours_and_ref):
    """Top-k and the threshold apply after the special tokens are dropped: exactly the k largest of the
    reference's weights; without a sparse output either option is a 400 naming it."""
    _, url, _ = served
    inputs, _, (_, sparse, _) = ours_and_ref
    for k in (1, 3):
        r = post(url, {"input": inputs[:6], "outputs": ["sparse"], "max_active_dims": k})
        assert r.status_code == 200, r.text
        for got, want in zip(r.json()["data"], sparse[:6]):
            top = sorted(want, key=want.get, reverse=True)[:k]
            assert got["sparse"]["indices"] == sorted(top)
    t = float(np.median([v for s in sparse[:6] for v in s.values()]))
    r = post(url, {"input": inputs[:6], "outputs": ["sparse"], "sparse_threshold": t})
    for got, want in zip(r.json()["data"], sparse[:6]):
        assert got["sparse"]["indices"] == sorted(k for k, v in want.items() if v >= t)
    for name, value in (("max_active_dims", 5), ("sparse_threshold", 0.1)):
        r = post(url, {"input": "x", name: value})  # dense only
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_mixed_batch_of_output_kinds_in_the_worker(served):
    """One worker batch whose sequences ask for different kinds (as concurrent requests do) gives each
    sequence what it gets alone: the EmbeddingModel the workers run, on one batch vs one sequence at a time."""
    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import OutputRequest

    path, url, _ = served
    ids = [d["tokens"] for d in httpx.post(url + "/tokenize", json={"input": texts()[20:26]}).json()["data"]]
    asks = [
        {"dense"},
        {"sparse"},
        {"colbert"},
        {"dense", "colbert"},
        {"sparse", "colbert"},
        {"dense", "sparse"},
    ]
    requests = [OutputRequest(frozenset(a)) for a in asks]
    model = EmbeddingModel(load_spec(path), torch.float32, torch.device("cpu")).eval()

    def run(seqs: list[list[int]], reqs: list[OutputRequest]):
        flat = torch.tensor([i for s in seqs for i in s])
        return model(FlatBatch.from_lengths(flat, [len(s) for s in seqs]), reqs)

    mixed = run(ids, requests)
    for seq, req, got in zip(ids, requests, mixed):
        alone = run([seq], [req])[0]
        assert got.kinds() == req.kinds
        if got.dense is not None:
            np.testing.assert_allclose(got.dense, alone.dense, atol=1e-5)
        if got.sparse is not None:
            np.testing.assert_array_equal(got.sparse.indices, alone.sparse.indices)
            np.testing.assert_allclose(got.sparse.values, alone.sparse.values, atol=1e-5)
        if got.colbert is not None:
            np.testing.assert_allclose(got.colbert, alone.colbert, atol=1e-5)
