"""Every number a request can send is checked for type and range before anything is computed from it.

A `dimensions` of 300,000,000 with `embed_dtype: uint8` once sized the int8 ranges (`np.repeat`) before the
model's dimension was checked: 12 s and 5 GB of one request, the event loop blocked; 2**32 answered 500.
Here each numeric field of each route gets the edge values a fuzzer or a careless client sends (0, -1,
2**31 - 1, 2**31, 2**63, 2**64 (a float once parsed), +-1e308, a float for an int, a bool, a huge literal,
NaN and Infinity as raw JSON tokens) on one live server serving an embedding model, a SPLADE model, a
cross-encoder and a classifier. A value the field accepts answers 200; any other a 400 in the error shape
naming the field. The server's CPU seconds per request and its resident memory over the whole run bound
the cost (the bug cost 12 CPU s and 5 GB for one request). CPU time, not wall time: what a request costs
the server does not change when other work shares the machine.

The field list is the one /openapi.json declares: a numeric field added to a request schema without
bounds fails `test_every_number_in_every_request_schema_declares_its_bounds`, and its edges are then sent
by `test_every_declared_bound_is_enforced_at_its_edges` with no further code.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from embed_service import Embedder
from embed_service.engine.errors import InvalidInputError
from tests.models.cross_encoders import bert_config
from tests.models.cross_encoders import build as build_scorer
from tests.models.test_splade import BERT, write_splade
from tests.server import ServerProcess

MINI_DIMENSION = 384
MINI_MAX_LENGTH = 256
MINI_VOCAB = 30522
INT32 = 2**31 - 1

# The raw JSON of each value tried (so NaN, Infinity and a 400-digit literal reach the server as sent).
VALUES: dict[str, str] = {
    "0": "0",
    "-1": "-1",
    "1": "1",
    "3*10**8": str(3 * 10**8),
    "2**31-1": str(2**31 - 1),
    "2**31": str(2**31),
    "2**63": str(2**63),
    "2**64": str(2**64),
    "1e308": "1e308",
    "-1e308": "-1e308",
    "1.5": "1.5",
    "true": "true",
    "10**400": "1" + "0" * 400,
    "NaN": "NaN",
    "Infinity": "Infinity",
}


@dataclass(frozen=True)
class Field:
    route: str
    name: str
    body: dict[str, Any]
    """The rest of a valid request; the field's value goes in at `path`."""
    valid: Callable[[Any], bool]
    """Whether the parsed value is one the field accepts for this model (then 200)."""
    path: tuple[str, ...] = ()

    @property
    def where(self) -> tuple[str, ...]:
        return self.path or (self.name,)


def _int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _number(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: type(v) in (int, float) and lo <= v <= hi


ONE = {"input": ["a"]}
FIELDS = [
    # /v1/embeddings: dimensions sizes the int8/uint8 ranges and the answer; the float path too.
    Field("/v1/embeddings", "dimensions", {**ONE, "embed_dtype": "uint8"}, _int(1, MINI_DIMENSION)),
    Field("/v1/embeddings", "dimensions", {**ONE, "embed_dtype": "int8"}, _int(1, MINI_DIMENSION)),
    Field("/v1/embeddings", "dimensions", {**ONE, "encoding_format": "base64"}, _int(1, MINI_DIMENSION)),
    Field(
        "/v1/embeddings",
        "embed_ranges",
        {**ONE, "embed_dtype": "int8", "dimensions": 2},
        lambda v: type(v) in (int, float) and -3.4e38 < v <= 0,  # [v, 0]: low <= high, float32-finite
        path=("embed_ranges", "0"),
    ),
    Field(
        "/v1/embeddings",
        "chunking.overlap",
        {"input": ["a"], "chunking": {}},
        _int(0, 63),  # at most half a window's text tokens (254 / 2 - ... for MiniLM's 256)
        path=("chunking", "overlap"),
    ),
    Field("/v1/embeddings", "input (a token id)", {}, _int(0, MINI_VOCAB - 1), path=("input", "0", "0")),
    Field(
        "/v1/embeddings",
        "max_active_dims",
        {**ONE, "model": "splade"},
        _int(1, 2**24),
    ),
    Field("/v1/embeddings", "sparse_threshold", {**ONE, "model": "splade"}, _number(0, 3.4e38)),
    Field("/embed_sparse", "max_active_dims", {"inputs": ["a"], "model": "splade"}, _int(1, 2**24)),
    Field("/embed_sparse", "sparse_threshold", {"inputs": ["a"], "model": "splade"}, _number(0, 3.4e38)),
    # Cohere's embed: output_dimension sizes the ranges of the integer types.
    Field(
        "/v2/embed",
        "output_dimension",
        {"texts": ["a"], "input_type": "search_query", "embedding_types": ["uint8", "int8"]},
        _int(1, MINI_DIMENSION),
    ),
    Field("/v1/embed", "output_dimension", {"texts": ["a"]}, _int(1, MINI_DIMENSION)),
    Field("/v2/embed", "max_tokens", {"texts": ["a"]}, _int(MINI_MAX_LENGTH, INT32)),
    Field("/v2/embed", "priority", {"texts": ["a"]}, _int(-INT32 - 1, INT32)),
    # Rerank: top_n past the documents answers every document (as vLLM and Cohere do).
    Field("/v2/rerank", "top_n", {"model": "ce", "query": "q", "documents": ["a", "b"]}, _int(1, INT32)),
    Field(
        "/v2/rerank",
        "max_tokens_per_doc",
        {"model": "ce", "query": "q", "documents": ["a", "b"]},
        _int(1, INT32),
    ),
    Field(
        "/v1/rerank", "priority", {"model": "ce", "query": "q", "documents": ["a"]}, _int(-INT32 - 1, INT32)
    ),
]


def raw_body(field: Field, raw: str) -> bytes:
    """The request's JSON with the raw value text at the field's place."""
    body: Any = json.loads(json.dumps(field.body))
    if field.name.startswith("input"):
        body["input"] = [["@V@"]]
    elif field.name == "embed_ranges":
        body["embed_ranges"] = ["@V@", 0]
    else:
        node = body
        for key in field.where[:-1]:
            node = node.setdefault(key, {})
        node[field.where[-1]] = "@V@"
    return json.dumps(body).replace('"@V@"', raw).encode()


def bounds_server(root: Path, default_model_path: Path) -> ServerProcess:
    """A server (not yet healthy) of the packaged MiniLM (`mini`, the default), a tiny random SPLADE model
    (`splade`) and a tiny random cross-encoder (`ce`), float32, one replica each."""
    tokenizer_sources = {"wordpiece": default_model_path}  # both tiny models: MiniLM's WordPiece
    splade = write_splade(BERT, root / "splade", tokenizer_sources)
    ce = build_scorer(
        "BertForSequenceClassification",
        bert_config(num_labels=1),
        "wordpiece",
        root / "ce",
        tokenizer_sources,
    )
    args = ["--dtype", "float32", "--data-parallel-size", "1"]
    for path, name in ((default_model_path, "mini"), (splade, "splade"), (ce, "ce")):
        args += ["--model", str(path), "--served-model-name", name]
    return ServerProcess(*args)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path) -> Iterator[ServerProcess]:
    with bounds_server(tmp_path_factory.mktemp("bounds"), default_model_path) as s:
        yield s


def server_processes(server: ServerProcess) -> list[psutil.Process]:
    first = psutil.Process(server.proc.pid)
    return [first, *first.children(recursive=True)]


def server_cpu(server: ServerProcess) -> float:
    """CPU seconds of the server and its workers, summed."""
    total = 0.0
    for p in server_processes(server):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peaks(server: ServerProcess) -> dict[int, int]:
    """Reset each server process's peak resident size to its current one (Linux: clear_refs 5); returns
    the current sizes (KiB) by pid."""
    now: dict[int, int] = {}
    for p in server_processes(server):
        now |= reset_peaks_of(p.pid)
    return now


def peak_growth(before: dict[int, int]) -> int:
    """The largest growth (bytes) of any process's peak resident size since `reset_peaks`."""
    return max(1024 * (_status_kib(pid, "VmHWM") - kib) for pid, kib in before.items())


def send(client: httpx.Client, field: Field, raw: str) -> httpx.Response:
    return client.post(
        field.route, content=raw_body(field, raw), headers={"content-type": "application/json"}
    )


def parsed(raw: str) -> Any:
    """The value as the server's JSON parser gives it (None: not JSON)."""
    try:
        return json.loads(
            raw, parse_constant=lambda _: None, parse_int=lambda s: int(s) if len(s) < 30 else None
        )
    except ValueError:
        return None


def expected_status(field: Field, raw: str) -> int:
    v = parsed(raw)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 2**64:
        v = float(v)  # orjson reads integers past 64 bits as floats
    if isinstance(v, float) and v == 2**64:
        v = float(v)
    return 200 if v is not None and field.valid(v) else 400


@pytest.fixture(scope="module")
def results(server) -> list[tuple[Field, str, int, int, float, str]]:
    """(field, value name, expected, status, server CPU s, error param or '') for every case, after one
    warm-up request per route (the first request's one-time costs are not a field's)."""
    out = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for field in FIELDS:
            assert client.post(field.route, json=field.body or ONE).status_code == 200, field
        for field in FIELDS:
            for name, raw in VALUES.items():
                before = server_cpu(server)
                r = send(client, field, raw)
                after = server_cpu(server)
                param = r.json()["error"]["param"] if r.status_code != 200 else ""
                out.append((field, name, expected_status(field, raw), r.status_code, after - before, param))
                if r.status_code != 200:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    return out


def test_each_value_of_each_field_answers_as_the_field_allows(results):
    wrong = [
        (f.route, f.name, name, status, expected)
        for f, name, expected, status, _, _ in results
        if status != expected
    ]
    assert not wrong, wrong


def test_each_refusal_names_its_field(results):
    unnamed = [
        (f.route, f.name, name, param)
        for f, name, expected, status, _, param in results
        if status == 400
        and VALUES[name] not in ("NaN", "Infinity")
        and not VALUES[name].startswith("1000")
        and param not in (f.where[0], "body")
    ]
    assert not unnamed, unnamed


def test_no_value_costs_the_server_more_than_a_small_request(results):
    # A forward pass of one short text costs a few CPU ms here; the bound is 100x that, and 1/24 of what
    # the unchecked `dimensions` once cost.
    costly = [(f.route, f.name, name, round(cpu, 3)) for f, name, _, _, cpu, _ in results if cpu > 0.5]
    assert not costly, costly


def test_no_refusal_raises_the_server_peak_memory(server, results):
    # `results` ran first (module fixture): every one-time allocation is made. A second pass over the
    # refusals must not raise any server process's peak resident size by 16 MiB (allocator noise), where
    # one unchecked field once took 5 GB. The peak, not the size after: the memory is freed once refused.
    before = reset_peaks(server)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for field, name, expected, _, _, _ in results:
            if expected == 400:
                assert send(client, field, VALUES[name]).status_code == 400
    assert peak_growth(before) < 16 * 2**20


# --- the schema states every bound, and the server holds each one at its edge ------------------------


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(server.url + "/openapi.json").json()


def numbers(spec: dict, node: dict, where: str) -> Iterator[tuple[str, dict]]:
    """Every integer or number schema under `node`, with its dotted place."""
    ref = node.get("$ref")
    if ref:
        yield from numbers(spec, spec["components"]["schemas"][ref.rsplit("/", 1)[1]], where)
        return
    if node.get("type") in ("integer", "number"):
        yield where, node
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for sub in node.get(key, ()):
            yield from numbers(spec, sub, where)
    if isinstance(node.get("items"), dict):
        yield from numbers(spec, node["items"], where + "[]")
    for name, sub in node.get("properties", {}).items():
        yield from numbers(spec, sub, f"{where}.{name}" if where else name)


def request_schemas(spec: dict) -> Iterator[tuple[str, dict]]:
    for path, item in spec["paths"].items():
        post = item.get("post")
        if post:
            yield path, post["requestBody"]["content"]["application/json"]["schema"]


def test_every_number_in_every_request_schema_declares_its_bounds(spec):
    found = [
        (path, where, node)
        for path, schema in request_schemas(spec)
        for where, node in numbers(spec, schema, "")
    ]
    assert len({w for _, w, _ in found}) >= 12, found  # the fields of FIELDS, at least
    unbounded = [(p, w) for p, w, n in found if "minimum" not in n or "maximum" not in n]
    assert not unbounded, unbounded


def test_every_declared_bound_is_enforced_at_its_edges(server, spec):
    """Each top-level integer field of each route at min - 1, min, max and max + 1: never a 5xx, and past
    an edge a 400 naming the field."""
    bodies = {f.route: f.body for f in FIELDS}
    bodies |= {
        "/v1/embed": {"texts": ["a"]},
        "/rerank": bodies["/v2/rerank"],
        "/v1/rerank": bodies["/v2/rerank"],
    }
    tried = 0
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for path, schema in request_schemas(spec):
            for where, node in numbers(spec, schema, ""):
                if "." in where or "[]" in where or node.get("type") != "integer" or path not in bodies:
                    continue
                for v in (node["minimum"] - 1, node["minimum"], node["maximum"], node["maximum"] + 1):
                    r = client.post(path, json={**bodies[path], where: v})
                    tried += 1
                    assert r.status_code < 500, (path, where, v, r.text)
                    if not node["minimum"] <= v <= node["maximum"]:
                        assert r.status_code == 400 and r.json()["error"]["param"] == where, (path, where, v)
    assert tried >= 40


@pytest.mark.parametrize(
    "options, param",
    [
        ({"dimensions": 2**32, "embed_dtype": "int8"}, "dimensions"),
        ({"dimensions": 3 * 10**8, "embed_dtype": "uint8"}, "dimensions"),
        ({"dimensions": 385, "embed_dtype": "uint8"}, "dimensions"),
        ({"dimensions": 1.5}, "dimensions"),
        ({"embed_dtype": "int8", "embed_ranges": [float("nan"), 1.0]}, "embed_ranges"),
    ],
)
def test_the_python_api_applies_the_same_bounds(embedder, options, param):
    before = reset_peaks_of(os.getpid())
    with pytest.raises(InvalidInputError) as raised:
        embedder.encode(["a"], **options)
    assert raised.value.param == param
    assert peak_growth(before) < 16 * 2**20


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    with Embedder(dtype="float32", data_parallel_size=1) as e:
        yield e


def reset_peaks_of(pid: int) -> dict[int, int]:
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return {pid: _status_kib(pid, "VmRSS")}
