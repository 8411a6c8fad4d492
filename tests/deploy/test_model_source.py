"""``--model`` by Hugging Face repo id and cache folder, against a hub cache laid out by the test (no network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from embed_service.model_source import ModelSourceError, resolve_model
from tests.deploy.hf_cache import lay_out_cache
from tests.server import ServerProcess, free_port

MAIN = "a" * 40
OLD = "b" * 40
REPO = "acme/mini-embedder"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, default_model_path: Path) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    lay_out_cache(cache, REPO, default_model_path, {MAIN: ["main"], OLD: ["v1"]})
    return cache


def test_repo_id_resolves_to_the_cached_snapshot_of_main(hub_cache):
    source = resolve_model(REPO, cache_dir=hub_cache)
    assert source.path.name == MAIN and source.path.parent.name == "snapshots"
    assert (source.path / "config.json").is_file()
    assert source.name == REPO


@pytest.mark.parametrize(("revision", "commit"), [("v1", OLD), (OLD, OLD), ("main", MAIN)])
def test_revision_picks_a_tag_or_a_commit(hub_cache, revision, commit):
    assert resolve_model(REPO, revision, cache_dir=hub_cache).path.name == commit


def test_cache_folder_as_a_path_resolves_to_its_snapshot(hub_cache):
    folder = hub_cache / "models--acme--mini-embedder"
    source = resolve_model(str(folder))
    assert source.path == folder / "snapshots" / MAIN
    assert source.name == REPO
    assert resolve_model(str(folder), "v1").path.name == OLD


def test_unknown_revision_of_a_cache_folder_names_what_is_there(hub_cache):
    with pytest.raises(ModelSourceError, match=r"no snapshot for revision v9 \(refs: main, v1"):
        resolve_model(str(hub_cache / "models--acme--mini-embedder"), "v9")


def test_missing_repo_offline_says_so(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ModelSourceError,
        match="no such directory, and not in the Hugging Face cache .*; HF_HUB_OFFLINE is set",
    ):
        resolve_model("acme/absent", cache_dir=hub_cache)


def test_plain_folder_keeps_its_name_and_refuses_a_revision(default_model_path):
    assert resolve_model(str(default_model_path)).path == default_model_path
    assert resolve_model(str(default_model_path)).name == default_model_path.name
    with pytest.raises(ModelSourceError, match="a revision applies to a Hugging Face repo id"):
        resolve_model(str(default_model_path), "main")


@pytest.mark.parametrize("name", ["./no/such/dir/here", "not a repo", "a--b/c"])
def test_neither_a_folder_nor_a_repo_id(name):
    with pytest.raises(ModelSourceError, match="no such directory, and not a Hugging Face repo id"):
        resolve_model(name)


def test_server_serves_a_repo_id_from_the_cache_offline(hub_cache, live_server):
    """The user's view: `--model org/name` with HF_HUB_OFFLINE=1 serves that model under that name; its
    embeddings are the packaged model's (the cache links to its files), as the package's own server gives them."""
    texts = ["a cached model, served by its repo id", "offline"]
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    with ServerProcess("--model", REPO, "--dtype", "float32", env=env) as server:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        body = httpx.post(server.url + "/v1/embeddings", json={"model": REPO, "input": texts}, timeout=60)
    assert [m["id"] for m in models["data"]] == [REPO]
    assert body.status_code == 200, body.text
    ref = httpx.post(
        live_server.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts}, timeout=60
    )
    got = np.array([d["embedding"] for d in body.json()["data"]])
    assert np.allclose(got, np.array([d["embedding"] for d in ref.json()["data"]]), atol=1e-6)


def test_server_refuses_a_missing_repo_offline_with_a_clear_message(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    server = ServerProcess("--model", "acme/absent", env=env)
    assert server.proc.wait(60) != 0
    assert "--model acme/absent: no such directory, and not in the Hugging Face cache" in server.output()


def test_missing_repo_with_the_hub_unreachable_says_so(hub_cache):
    """Online mode tries the hub (here a closed port on loopback) and reports both failures at once."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run(
        [sys.executable, "-m", "embed_service.model_source", "acme/absent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "not in the Hugging Face cache" in r.stderr and "downloading it failed" in r.stderr
