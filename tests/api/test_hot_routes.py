"""The POST routes answered without FastAPI's routing (api/hot_routes.py) answer exactly as FastAPI's routing
answers them: the same status, headers and body for good requests and for every kind of refusal.

In process, one app from `create_app` with a real engine (worker processes on the packaged model, float32):
each request goes once through the app's own middleware stack (the hot routes inside the access line) and
once through the stack FastAPI builds without them, the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from embed_service.api import cohere, rerank, routes
from embed_service.api.hot_routes import HotRoutes, hot_endpoints
from embed_service.config import Settings
from tests.server import in_process_app

MODEL = "all-MiniLM-L6-v2"
KEY = "hot-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 4096  # --max-request-bytes


class Paths:
    """One app, its two middleware stacks: `hot` (as served) and `routed` (FastAPI's, without HotRoutes)."""

    def __init__(self, client: TestClient):
        self.client = client
        app: Any = client.app
        self.app = app
        self.hot = app.middleware_stack
        kept = app.user_middleware
        app.user_middleware = [m for m in kept if m.cls is not HotRoutes]
        try:
            self.routed = app.build_middleware_stack()
        finally:
            app.user_middleware = kept

    def send(self, stack: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self.app.middleware_stack = stack
        try:
            return self.client.request(method, path, **kwargs)
        finally:
            self.app.middleware_stack = self.hot

    def both(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
        return self.send(self.hot, method, path, **kwargs), self.send(self.routed, method, path, **kwargs)


@pytest.fixture(scope="module")
def paths(default_model_path) -> Iterator[Paths]:
    settings = Settings(
        dtype="float32", api_key=KEY, max_request_bytes=LIMIT, max_client_batch_size=4, max_batch_tokens=256
    )
    with in_process_app(settings, default_model_path, MODEL) as client:
        yield Paths(client)


def same(hot: httpx.Response, routed: httpx.Response) -> None:
    assert hot.status_code == routed.status_code, (hot.text, routed.text)
    for name in (
        "content-type",
        "content-length",
        "www-authenticate",
        "retry-after",
        "connection",
        "location",
    ):
        assert hot.headers.get(name) == routed.headers.get(name), name
    assert hot.headers["x-request-id"] and routed.headers["x-request-id"]
    if hot.headers.get("content-type") == "application/json" and hot.status_code == 200:
        hot_body, routed_body = orjson.loads(hot.content), orjson.loads(routed.content)
        if isinstance(hot_body, dict) and "id" in hot_body:  # Cohere's answers: a new uuid4 each
            assert hot_body.pop("id") != routed_body.pop("id")
        assert hot_body == routed_body
    else:
        assert hot.content == routed.content


JSON = {"Content-Type": "application/json"}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/v1/embeddings", {"json": {"input": ["hello world", "a second text"]}, "headers": AUTH}),
    ("POST", "/embeddings", {"json": {"input": "one text", "encoding_format": "base64"}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": [[101, 7592, 102]], "dimensions": 8}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": "no key"}}),
    ("POST", "/v1/embeddings", {"json": {"input": "bad key"}, "headers": {"Authorization": "Bearer nope"}}),
    (
        "POST",
        "/v1/embeddings",
        {"content": b'{"input": "x"}', "headers": {**AUTH, "Content-Type": "text/plain"}},
    ),
    ("POST", "/v1/embeddings", {"content": b'{"input": ', "headers": {**AUTH, **JSON}}),
    ("POST", "/v1/embeddings", {"content": b"[1, 2]", "headers": {**AUTH, **JSON}}),
    ("POST", "/v1/embeddings", {"json": {"input": "x" * (2 * LIMIT)}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": 5}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": ["a"] * 5}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": "x", "model": "no-such-model"}, "headers": AUTH}),
    ("POST", "/v1/embeddings", {"json": {"input": "x", "encoding_format": "hex"}, "headers": AUTH}),
    ("POST", "/tokenize", {"json": {"input": ["hello world"]}, "headers": AUTH}),
    ("POST", "/embed_sparse", {"json": {"inputs": ["hello"]}, "headers": AUTH}),
    ("POST", "/v2/embed", {"json": {"texts": ["hello"], "input_type": "search_query"}, "headers": AUTH}),
    ("POST", "/v1/embed", {"json": {"texts": []}, "headers": AUTH}),
    ("POST", "/rerank", {"json": {"query": "q", "documents": ["d"]}, "headers": AUTH}),
    ("GET", "/v1/embeddings", {"headers": AUTH}),
    ("POST", "/v1/embeddings/", {"json": {"input": "x"}, "headers": AUTH, "follow_redirects": False}),
    ("POST", "/v1/models", {"headers": AUTH}),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs"), CASES, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(CASES)]
)
def test_the_hot_path_answers_as_fastapis_routing_does(paths, method, path, kwargs):
    same(*paths.both(method, path, **kwargs))


def test_good_answers_carry_the_vectors(paths):
    hot, _ = paths.both("POST", "/v1/embeddings", json={"input": ["hello world"]}, headers=AUTH)
    body = orjson.loads(hot.content)
    assert hot.status_code == 200 and len(body["data"][0]["embedding"]) == 384


def test_a_bug_in_a_route_is_one_500_in_the_error_shape_on_both_paths(paths, monkeypatch, caplog):
    engine = paths.app.state.server.models.default

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "embed", broken)
    hot, routed = paths.both("POST", "/v1/embeddings", json={"input": "x"}, headers=AUTH)
    same(hot, routed)
    assert hot.status_code == 500
    assert orjson.loads(hot.content)["error"]["type"] == "server_error"
    assert "a bug" not in hot.text
    assert caplog.text.count("RuntimeError: a bug") == 2  # one traceback per request, with its request id


def test_every_post_route_of_the_api_takes_the_hot_path():
    api = [*routes.router.routes, *cohere.router.routes, *rerank.router.routes]
    posts = {r.path for r in api if isinstance(r, APIRoute) and "POST" in r.methods}
    assert set(hot_endpoints(api, routes.check_api_key)) == posts
