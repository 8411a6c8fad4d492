"""The packaged default model answers a real request through the whole stack."""

import httpx


def test_one_request_end_to_end(exact_server):
    r = httpx.post(exact_server.url + "/v1/embeddings", json={"input": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "all-MiniLM-L6-v2"
    assert len(body["data"][0]["embedding"]) == 384
