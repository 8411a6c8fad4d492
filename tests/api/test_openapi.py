"""/openapi.json describes the API as it behaves: schemathesis fuzzes the live server from it."""

from __future__ import annotations

import re
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import ENV_KEY

AUTH = {"Authorization": f"Bearer {ENV_KEY}"}
CASES_PER_ROUTE = 500
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def spec(keyed_server) -> dict:
    r = httpx.get(keyed_server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def resolve(spec: dict, node: dict) -> dict:
    ref = node.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize"])
def test_post_routes_declare_their_body_and_every_error(spec, path):
    op = spec["paths"][path]["post"]
    body = resolve(spec, op["requestBody"]["content"]["application/json"]["schema"])
    assert body["required"] == ["input"] and "input" in body["properties"]
    assert {"200", "400", "401", "404", "408", "413", "415", "429", "500", "503"} <= set(op["responses"])
    for status, response in op["responses"].items():
        schema = resolve(spec, response["content"]["application/json"]["schema"])
        if status != "200":
            assert set(schema["properties"]) == {"error"}, status
    assert "Retry-After" in op["responses"]["503"]["headers"]
    assert "WWW-Authenticate" in op["responses"]["401"]["headers"]
    assert op["security"] == [{"bearer": []}]


@pytest.mark.parametrize("path", ["/v2/embed", "/v1/embed"])
def test_cohere_routes_declare_their_body_and_every_error(spec, path):
    op = spec["paths"][path]["post"]
    body = resolve(spec, op["requestBody"]["content"]["application/json"]["schema"])
    assert {"texts", "inputs", "input_type", "embedding_types", "output_dimension", "truncate"} <= set(
        body["properties"]
    )
    assert {"200", "400", "401", "404", "408", "413", "415", "429", "500", "503"} <= set(op["responses"])
    assert op["security"] == [{"bearer": []}]


def test_every_route_is_described(spec):
    ops = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert ops == {
        ("POST", "/v1/embeddings"),
        ("POST", "/tokenize"),
        ("POST", "/v2/embed"),
        ("POST", "/v1/embed"),
        ("POST", "/embed_sparse"),
        ("POST", "/embed_all"),
        ("POST", "/rerank"),
        ("POST", "/v1/rerank"),
        ("POST", "/v2/rerank"),
        ("POST", "/classify"),
        ("GET", "/v1/models"),
        ("GET", "/info"),
        ("GET", "/live"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    }
    for method, path in ops:
        assert "200" in spec["paths"][path][method.lower()]["responses"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_everything_from_this_server(keyed_server, page):
    html = httpx.get(keyed_server.url + page, headers=AUTH).text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(r"url: ?'([^']+)'", html)
    urls += re.findall(r'spec-url="([^"]+)"', html)
    assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN: works offline
    for url in urls:
        r = httpx.get(keyed_server.url + url, headers=AUTH)
        assert r.status_code == 200, url
        assert len(r.content) > 1000, url


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/v2/embed"])
def test_fuzzed_from_its_own_openapi_no_5xx_and_every_answer_as_described(keyed_server, path):
    schema = schemathesis.openapi.from_url(keyed_server.url + "/openapi.json", headers=AUTH)
    operation = schema[path]["POST"]
    statuses: Counter[int] = Counter()
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
    )

    @settings(
        max_examples=CASES_PER_ROUTE, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(cases)
    def fuzz(case) -> None:
        response = case.call(base_url=keyed_server.url, headers=AUTH, timeout=60)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    fuzz()
    print(f"{path}: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= CASES_PER_ROUTE
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses[200] > 0 and statuses[400] > 0  # both kinds of case reached the server
