"""SPLADE (sentence-transformers' SparseEncoder layout) against SparseEncoder itself.

A tiny random BertForMaskedLM written with save_pretrained, plus the SparseEncoder module files
(MLMTransformer, then SpladePooling) saved by sentence-transformers, served by real servers in float32 (one
with --tensor-parallel-size 2). The reference is SparseEncoder.encode on the same folder: the same token
sets and the same weights, with and without max_active_dims. The MLM bias is drawn around -1.6, so that a
text activates a few hundred vocabulary entries as real SPLADE models do, not half the vocabulary.

The sum pooling, the log1p_relu activation, the RoBERTa/XLM-R head (``lm_head.*``) and ModernBERT's
(``head.*``, ``decoder.*``) are checked in-process
(the EmbeddingModel the workers run, on the same folders) against SparseEncoder, without a server each.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers as T

from tests.models.test_families import CASES
from tests.models.tiny import Tiny, build, texts
from tests.server import ServerProcess

BERT = Tiny(
    "splade-bert",
    "BertForMaskedLM",
    # 30,523 rows: one more than the tokenizer's, so TP=2 pads no row and TP=3 would; odd on purpose.
    lambda: T.BertConfig(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=30523,
        max_position_embeddings=128,
        type_vocab_size=2,
    ),
    tokenizer="wordpiece",
)
XLMR = Tiny(
    "splade-xlmr",
    "XLMRobertaForMaskedLM",
    lambda: T.XLMRobertaConfig(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=49152,
        pad_token_id=3,
        max_position_embeddings=130,
        type_vocab_size=1,
    ),
    tokenizer="bpe-template",
)
# test_families' ModernBERT (local and global layers, biased norms), without its sentence-transformers files.
MODERNBERT = replace(next(c for c in CASES if c.name == "modernbert"), name="splade-modernbert", pooling=None)
MAX_LENGTH = 64
TEXTS = texts()


def write_splade(
    tiny: Tiny, path: Path, sources: dict[str, Path], pooling: str = "max", activation: str = "relu"
) -> Path:
    """A random masked LM (tiny.build: save_pretrained and the tokenizer) with its MLM bias shifted down,
    then SparseEncoder's own save of its module files."""
    from safetensors.torch import load_file, save_file
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    build(tiny, path, sources)
    weights = load_file(path / "model.safetensors")
    name = next(k for k in ("cls.predictions.bias", "lm_head.bias", "decoder.bias") if k in weights)
    g = torch.Generator().manual_seed(2)
    weights[name] = -1.6 + 0.3 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    modules = [MLMTransformer(str(path), max_seq_length=MAX_LENGTH), SpladePooling(pooling, activation)]
    SparseEncoder(modules=modules, device="cpu").save(str(path))
    return path


@functools.cache
def sparse_encoder(path: Path):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(path), device="cpu")


def reference(path: Path, inputs: list[str], **kw) -> list[dict[int, float]]:
    """SparseEncoder.encode on the folder, as {token id: weight} per text."""
    out = sparse_encoder(path).encode(inputs, batch_size=16, convert_to_tensor=True, **kw).coalesce()
    idx, vals = out.indices().numpy(), out.values().numpy()
    rows: list[dict[int, float]] = [{} for _ in inputs]
    for (r, c), v in zip(idx.T, vals):
        if v != 0:
            rows[r][int(c)] = float(v)
    return rows


@pytest.fixture(scope="module")
def splade_path(tmp_path_factory, tokenizer_sources) -> Path:
    return write_splade(BERT, tmp_path_factory.mktemp("splade"), tokenizer_sources)


@pytest.fixture(scope="module")
def servers(splade_path):
    """TP=1 and TP=2, started side by side."""
    tp1 = ServerProcess("--model", str(splade_path), "--dtype", "float32")
    tp2 = ServerProcess("--model", str(splade_path), "--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        tp1.wait_healthy()
        tp2.wait_healthy()
        yield tp1.url, tp2.url
    finally:
        with ThreadPoolExecutor(2) as pool:  # both drain at once
            list(pool.map(ServerProcess.stop, (tp1, tp2)))


def post(url: str, body: dict, route: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=300)


def sparse_rows(url: str, inputs, **kw) -> list[dict[int, float]]:
    r = post(url, {"input": inputs, **kw})
    assert r.status_code == 200, r.text
    rows = []
    for item in r.json()["data"]:
        assert "embedding" not in item, "a SPLADE model answers sparse only"
        s = item["sparse"]
        assert s["indices"] == sorted(s["indices"])
        rows.append(dict(zip(s["indices"], s["values"])))
    return rows


def compare(ours: list[dict[int, float]], ref: list[dict[int, float]]) -> tuple[float, float]:
    """Same token sets, values within rtol 1e-5 (atol 5e-6: float32 logits are good to ~1e-6 whatever their
    size, so a weight near 0 is not good to 1e-5 of itself in any float32 implementation); the worst
    (relative diff over the weights >= 0.1, absolute diff over all)."""
    worst_rel, worst_abs = 0.0, 0.0
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert set(a) == set(b), f"text {i}: token sets differ by {sorted(set(a) ^ set(b))[:10]}"
        if not a:
            continue
        keys = sorted(a)
        x, y = np.array([a[k] for k in keys]), np.array([b[k] for k in keys])
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=5e-6, err_msg=f"text {i}")
        big = y >= 0.1
        worst_abs = max(worst_abs, float(np.abs(x - y).max()))
        if big.any():
            worst_rel = max(worst_rel, float((np.abs(x - y)[big] / y[big]).max()))
    return worst_rel, worst_abs


@pytest.fixture(scope="module")
def ours_and_ref(servers, splade_path):
    url, _ = servers
    return sparse_rows(url, TEXTS), reference(splade_path, TEXTS)


def test_default_output_matches_sparse_encoder(ours_and_ref):
    ours, ref = ours_and_ref
    rel, abs_ = compare(ours, ref)
    active = [len(r) for r in ref]
    print(
        f"\nSPLADE tiny BERT over {len(TEXTS)} texts: same token sets; max rel diff {rel:.2e} (weights >= 0.1), "
        f"max abs diff {abs_:.2e}; active dims {min(active)}..{max(active)} of {BERT.config().vocab_size}"
    )
    # The test can fail: texts activate entries, and not the whole vocabulary.
    assert min(active) > 0 and max(active) < BERT.config().vocab_size // 4


def test_max_active_dims_matches_the_reference_top_k(servers, splade_path, ours_and_ref):
    url, _ = servers
    ours_all, ref_all = ours_and_ref
    for k in (1, 7, 100):
        ours = sparse_rows(url, TEXTS[:12], max_active_dims=k)
        compare(ours, reference(splade_path, TEXTS[:12], max_active_dims=k))
        assert all(len(o) == min(k, len(a)) for o, a in zip(ours, ours_all))
    # A threshold keeps exactly the reference's weights at or above it; then max_active_dims of those.
    t = float(np.median([v for r in ref_all[:12] for v in r.values()]))
    ours = sparse_rows(url, TEXTS[:12], sparse_threshold=t)
    compare(ours, [{k: v for k, v in r.items() if v >= t} for r in ref_all[:12]])
    ours = sparse_rows(url, TEXTS[:12], sparse_threshold=t, max_active_dims=5)
    for o, r in zip(ours, ref_all[:12]):
        kept = sorted((v for v in r.values() if v >= t), reverse=True)[:5]
        assert sorted(o.values(), reverse=True) == pytest.approx(kept, rel=1e-5)


def test_tp2_equals_tp1(servers, ours_and_ref):
    """The vocabulary projection is split by rows across the ranks, like the embedding table it is tied to;
    each rank pools its rows and rank 0 gathers them."""
    _, tp2 = servers
    ours, _ = ours_and_ref
    compare(sparse_rows(tp2, TEXTS), ours)
    info = httpx.get(tp2 + "/info").json()
    assert info["tensor_parallel_size"] == 2
    assert info["parameter_bytes_per_rank"][0] == info["parameter_bytes_per_rank"][1]


def test_alone_equals_in_a_batch_and_token_ids_equal_text(servers, ours_and_ref):
    """A text alone, or in concurrent requests of other texts, other lengths and other top-k, gives what it
    gets inside the 56-text batch; its token ids give what its text gives."""
    url, _ = servers
    ours, _ = ours_and_ref
    picks = (0, 23, 40, len(TEXTS) - 2)
    with ThreadPoolExecutor(8) as pool:
        alone = list(pool.map(lambda i: sparse_rows(url, TEXTS[i])[0], picks))
        list(pool.map(lambda i: sparse_rows(url, TEXTS[i : i + 3], max_active_dims=3), range(8)))
    for i, got in zip(picks, alone):
        compare([got], [ours[i]])
    ids = httpx.post(url + "/tokenize", json={"input": [TEXTS[i] for i in picks]}).json()["data"]
    compare(sparse_rows(url, [d["tokens"] for d in ids]), [ours[i] for i in picks])


def test_embed_sparse_route_and_sparse_tokens(servers, ours_and_ref, splade_path):
    from transformers import AutoTokenizer

    url, _ = servers
    ours, _ = ours_and_ref
    r = post(url, {"inputs": TEXTS[:3], "max_active_dims": 4}, route="/embed_sparse")
    assert r.status_code == 200, r.text
    for got, want in zip(r.json(), ours[:3]):
        top = sorted(want, key=want.get, reverse=True)[:4]
        assert [p["index"] for p in got] == sorted(top)
    r = post(url, {"input": TEXTS[0], "outputs": ["sparse"], "sparse_tokens": True, "max_active_dims": 3})
    s = r.json()["data"][0]["sparse"]
    tok = AutoTokenizer.from_pretrained(str(splade_path))
    assert s["tokens"] == tok.convert_ids_to_tokens(s["indices"])


def test_refusals(servers):
    """A SPLADE model gives sparse only; the sparse options are checked; the server keeps serving."""
    url, _ = servers
    info = httpx.get(url + "/info").json()
    assert info["outputs"] == ["sparse"] and info["dimension"] == BERT.config().vocab_size
    assert info["pooling"] == "splade_max"  # the SparseEncoder folder's SpladePooling strategy
    cases = [
        ({"input": "x", "outputs": ["dense"]}, "outputs", "/v1/embeddings"),
        ({"input": "x", "outputs": ["sparse", "colbert"]}, "outputs", "/v1/embeddings"),
        ({"input": "x", "max_active_dims": 0}, "max_active_dims", "/v1/embeddings"),
        ({"input": "x", "max_active_dims": "5"}, "max_active_dims", "/v1/embeddings"),
        ({"input": "x", "sparse_threshold": -0.5}, "sparse_threshold", "/v1/embeddings"),
        ({"inputs": "x", "sparse_threshold": "high"}, "sparse_threshold", "/embed_sparse"),
        ({"input": "x", "chunking": {}}, "chunking", "/v1/embeddings"),
        # The encoding fields shape dense vectors, which a SPLADE model does not give (they were ignored).
        ({"input": "x", "dimensions": 16}, "dimensions", "/v1/embeddings"),
        ({"input": "x", "embed_dtype": "uint8"}, "embed_dtype", "/v1/embeddings"),
        ({"input": "x", "embed_dtype": "int8", "embed_ranges": [-1, 1]}, "embed_dtype", "/v1/embeddings"),
        (
            {"texts": ["x"], "input_type": "search_query", "embedding_types": ["float"]},
            "outputs",
            "/v2/embed",
        ),
    ]
    for body, param, route in cases:
        r = post(url, body, route)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert len(sparse_rows(url, "still serving")) == 1


# --- in-process: the other pooling strategy, activation and head ------------------------------------------


def embed_in_process(path: Path, inputs: list[str]) -> list[dict[int, float]]:
    """The EmbeddingModel the workers run, on the tokenizer's ids (truncated as sentence-transformers does)."""
    from transformers import AutoTokenizer

    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import SPARSE, OutputRequest

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = [tok(t, truncation=True, max_length=MAX_LENGTH)["input_ids"] for t in inputs]
    model = EmbeddingModel(load_spec(path), torch.float32, torch.device("cpu")).eval()
    batch = FlatBatch.from_lengths(torch.tensor([i for seq in ids for i in seq]), [len(s) for s in ids])
    outs = model(batch, [OutputRequest(frozenset({SPARSE}))] * len(ids))
    return [dict(zip(o.sparse.indices.tolist(), o.sparse.values.tolist())) for o in outs]


@pytest.mark.parametrize(
    "tiny, pooling, activation",
    [(BERT, "sum", "log1p_relu"), (XLMR, "max", "relu"), (MODERNBERT, "max", "relu")],
    ids=["bert-sum-log1p_relu", "xlmr-max-relu", "modernbert-max-relu"],
)
def test_variants_in_process(tmp_path, tokenizer_sources, tiny, pooling, activation):
    path = write_splade(tiny, tmp_path, tokenizer_sources, pooling, activation)
    inputs = TEXTS[::4]
    ref = reference(path, inputs)
    rel, abs_ = compare(embed_in_process(path, inputs), ref)
    print(f"\n{tiny.name} {pooling}/{activation}: max rel diff {rel:.2e}, max abs diff {abs_:.2e}")
    assert sum(len(r) for r in ref) > len(inputs)


def test_detection_and_its_refusals(splade_path, tmp_path):
    """SpladePooling in modules.json makes a SPLADE model; what it cannot serve is refused by name."""
    import json
    import shutil

    from embed_service.models.spec import load_spec

    spec = load_spec(splade_path)
    assert spec.splade is not None and spec.outputs == {"sparse"} and spec.default_outputs == {"sparse"}
    folder = tmp_path / "m"

    def variant(edit_config=None, edit_modules=None, edit_pooling=None) -> str:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(splade_path, folder)
        for file, edit in (
            ("config.json", edit_config),
            ("modules.json", edit_modules),
            ("1_SpladePooling/config.json", edit_pooling),
        ):
            if edit is not None:
                data = json.loads((folder / file).read_text())
                (folder / file).write_text(json.dumps(edit(data)))
        with pytest.raises(ValueError) as exc:
            load_spec(folder)
        return str(exc.value)

    assert "masked-LM" in variant(edit_config=lambda c: {**c, "architectures": ["BertModel"]})
    assert "pooling_strategy" in variant(edit_pooling=lambda c: {**c, "pooling_strategy": "mean"})
    assert "activation_function" in variant(edit_pooling=lambda c: {**c, "activation_function": "gelu"})
    pooling = {"idx": 2, "name": "2", "path": "", "type": "sentence_transformers.models.Pooling"}
    assert "transformer then SpladePooling" in variant(edit_modules=lambda m: [m[0], pooling, m[1]])
    # A plain masked LM without the SparseEncoder files stays a dense embedder: no vocabulary head.
    shutil.rmtree(folder)
    shutil.copytree(splade_path, folder, ignore=shutil.ignore_patterns("modules.json", "1_SpladePooling"))
    plain = load_spec(folder)
    assert plain.splade is None and plain.outputs == {"dense"}
