"""API keys: the official client with a right and a wrong key, raw headers, and where keys may come from."""

from __future__ import annotations

import logging
import os

import httpx
import openai
import pytest

from embed_service.api.auth import load_api_keys, read_key_file
from embed_service.config import Settings
from tests.api.conftest import ENV_KEY, FILE_KEYS

MODEL = "all-MiniLM-L6-v2"


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", [*FILE_KEYS, ENV_KEY])
def test_the_openai_client_with_each_key(keyed_server, key):
    res = client(keyed_server, key).embeddings.create(model=MODEL, input=["a key from a file or the env"])
    assert len(res.data) == 1 and len(res.data[0].embedding) == 384
    assert [m.id for m in client(keyed_server, key).models.list()] == [MODEL]


@pytest.mark.parametrize("key", ["wrong", FILE_KEYS[0] + "x", FILE_KEYS[0][:-1], FILE_KEYS[0].upper()])
def test_the_openai_client_with_a_wrong_key_is_refused(keyed_server, key):
    with pytest.raises(openai.AuthenticationError) as e:
        client(keyed_server, key).embeddings.create(model=MODEL, input="x")
    assert e.value.status_code == 401
    assert e.value.response.headers["www-authenticate"] == "Bearer"
    assert e.value.body["type"] == "authentication_error" and e.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {FILE_KEYS[0]}", f"bearer {FILE_KEYS[1]}", f"BEARER {ENV_KEY}", f"Bearer   {ENV_KEY}"],
)
def test_the_scheme_is_case_insensitive(keyed_server, authorization):
    r = httpx.post(
        keyed_server.url + "/tokenize", json={"input": "x"}, headers={"Authorization": authorization}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        FILE_KEYS[0],
        f"Basic {FILE_KEYS[0]}",
        f"Bearer {FILE_KEYS[0]} {ENV_KEY}",
    ],
)
def test_a_missing_or_malformed_key_is_401_with_www_authenticate(keyed_server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = httpx.post(keyed_server.url + "/v1/embeddings", json={"input": "x"}, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path", ["/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui-bundle.js", "/info", "/v1/models"]
)
def test_docs_and_routes_are_behind_the_key(keyed_server, path):
    assert httpx.get(keyed_server.url + path).status_code == 401
    r = httpx.get(keyed_server.url + path, headers={"Authorization": f"Bearer {ENV_KEY}"})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/live", "/health", "/metrics"])
def test_probes_stay_open(keyed_server, path):
    assert httpx.get(keyed_server.url + path).status_code == 200


def test_keys_given_the_safe_ways_are_not_warned_about_nor_logged(keyed_server):
    log = keyed_server.output()
    assert "visible to every user" not in log
    assert "can be read by other users" not in log
    assert not any(k in log for k in [*FILE_KEYS, ENV_KEY])


def test_a_key_on_the_command_line_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, "embed_service.api.auth"):
        keys = load_api_keys(Settings(api_key="k1,k2"), argv=["embed-service", "serve", "--api-key", "k1,k2"])
    assert len(keys) == 2
    assert "visible to every user" in caplog.text and "k1" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "embed_service.api.auth"):
        load_api_keys(Settings(api_key="k1"), argv=["embed-service", "serve"])  # from EMBED_API_KEY
    assert caplog.text == ""


def test_key_files(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("# comment\n\n  key-a  \nkey-b\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, "embed_service.api.auth"):
        assert read_key_file(str(path)) == ["key-a", "key-b"]
    assert "can be read by other users" in caplog.text
    path.write_text("# no key\n\n")
    with pytest.raises(SystemExit, match="--api-key-file .*holds no key"):
        read_key_file(str(path))
    with pytest.raises(SystemExit, match="--api-key-file .*No such file"):
        read_key_file(str(tmp_path / "missing"))
