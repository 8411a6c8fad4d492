"""Several models in one server: a live server from a YAML config file serving the packaged MiniLM (as `mini`,
alias `mini-alias`) and a tiny random BERT (as `tiny`), each with its own limits. Routing by `model`, the
per-model limits, /v1/models, /info, /health, the per-model metrics and the resource plan at this machine's
cores; the command-line syntax and the refusals, without loading anything."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers as T
from prometheus_client.parser import text_string_to_metric_families

from embed_service.cli import Refusal, build_parser, serve_config
from embed_service.engine.engine import weight_bytes
from embed_service.models.spec import load_spec
from embed_service.plan import ModelRequest, plan_resources
from embed_service.workers.device import this_machine
from tests.models.tiny import Tiny, build, cosines, embed, st_reference
from tests.server import ServerProcess, read_corpus, refusal

TINY = Tiny(
    "tiny-bert",
    "BertModel",
    lambda: T.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=128,
    ),
    tokenizer="wordpiece",
    pooling="mean",
    max_seq_length=64,
)
MINI_BATCH, TINY_BATCH = 8, 2  # --max-client-batch-size of each
TEXTS = read_corpus("queries.jsonl", 2)  # within both models' client batch size


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, default_model_path) -> Path:
    return build(TINY, tmp_path_factory.mktemp("tiny-bert"), {"wordpiece": default_model_path})


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path, tiny_path) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("config") / "models.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            dtype: float32  # every model
            models:
              - model: {json.dumps(str(default_model_path))}
                served_model_name: [mini, mini-alias]
                max_client_batch_size: {MINI_BATCH}
              - model: {json.dumps(str(tiny_path))}
                served-model-name: tiny
                max-client-batch-size: {TINY_BATCH}
                max_batch_tokens: 512
            """
        )
    )
    with ServerProcess("--config", str(config)) as s:
        yield s


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_v1_models_lists_every_served_name_with_its_model(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert {d["id"]: d["root"] for d in data} == {"mini": "mini", "mini-alias": "mini", "tiny": "tiny"}


def test_requests_route_by_model_to_that_models_vectors(server, default_model_path, tiny_path):
    references = {"mini": st_reference(default_model_path, TEXTS), "tiny": st_reference(tiny_path, TEXTS)}
    for name, root in [("mini", "mini"), ("mini-alias", "mini"), ("tiny", "tiny")]:
        vectors, body = embed(server.url, TEXTS, model=name)
        assert body["model"] == name
        assert vectors.shape == references[root].shape  # 384 for mini, 32 for tiny
        assert cosines(vectors, references[root]).min() > 0.99999, name


def test_a_request_without_model_goes_to_the_first_model(server):
    unnamed, body = embed(server.url, TEXTS)
    named, _ = embed(server.url, TEXTS, model="mini")
    assert body["model"] == "mini" and np.array_equal(unnamed, named)


@pytest.mark.parametrize("path, field", [("/v1/embeddings", "input"), ("/tokenize", "input")])
def test_an_unknown_model_is_404_model_not_found(server, path, field):
    r = post(server, path, {field: ["hello"], "model": "nope"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'nope'" in error["message"] and all(n in error["message"] for n in ("mini", "tiny"))


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize"])
def test_each_model_has_its_own_client_batch_limit(server, path):
    three = read_corpus("queries.jsonl", TINY_BATCH + 1)
    tiny = post(server, path, {"input": three, "model": "tiny"})
    assert tiny.status_code == 400 and str(TINY_BATCH) in tiny.json()["error"]["message"]
    assert post(server, path, {"input": three, "model": "mini"}).status_code == 200
    over = read_corpus("queries.jsonl", MINI_BATCH + 1)
    mini = post(server, path, {"input": over, "model": "mini-alias"})
    assert mini.status_code == 400 and str(MINI_BATCH) in mini.json()["error"]["message"]


def test_info_per_model_and_the_plan_for_this_machine(server, default_model_path, tiny_path):
    info = httpx.get(server.url + "/info").json()
    assert (info["model"], info["default_model"]) == ("mini", "mini")
    by_name = {m["model"]: m for m in info["models"]}
    assert set(by_name) == {"mini", "tiny"}
    tiny = httpx.get(server.url + "/info", params={"model": "tiny"}).json()
    assert (tiny["model"], tiny["dimension"], tiny["max_client_batch_size"]) == ("tiny", 32, TINY_BATCH)
    assert tiny["max_batch_tokens"] == 512 and by_name["mini"]["max_client_batch_size"] == MINI_BATCH
    assert httpx.get(server.url + "/info", params={"model": "nope"}).status_code == 404

    # The plan the server made is the planning function's for this machine and these two models.
    expected = plan_resources(
        [
            ModelRequest("mini", "cpu", weight_bytes=weight_bytes(load_spec(default_model_path, None))),
            ModelRequest("tiny", "cpu", weight_bytes=weight_bytes(load_spec(tiny_path, None))),
        ],
        this_machine(cuda=False),
    )
    plan = info["plan"]
    assert plan["models"] == [m.info() for m in expected.models]
    assert plan["threads"] <= max(plan["cores"], 2)  # the cores divided, never oversubscribed
    for name, share in zip(("mini", "tiny"), expected.models):
        replicas = by_name[name]["replicas"]
        assert [r["devices"] for r in replicas] == [list(d) for d in share.devices]
        assert by_name[name]["num_threads"] == share.num_threads
    if plan["cores"] == 2:  # this machine: one single-thread replica each
        assert [(m["replicas"], m["num_threads"]) for m in plan["models"]] == [(1, 1), (1, 1)]
    # ... and printed at start-up, before the models loaded.
    log = server.output()
    assert all(line in log for line in plan["lines"])
    assert log.index("resource plan for") < log.index("loading weights")
    print("\n" + "\n".join(plan["lines"]))


def test_health_lists_every_model(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "models": {"mini": "ready", "tiny": "ready"}}


def metric_samples(server: ServerProcess) -> list:
    text = httpx.get(server.url + "/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def tokens_counted(samples: list, model: str) -> float:
    (value,) = [
        s.value for s in samples if s.name == "embed_input_tokens_total" and s.labels["model"] == model
    ]
    return value


def test_every_per_model_metric_has_a_series_per_model_and_counts_its_own_model(server):
    before = metric_samples(server)
    _, tiny = embed(server.url, TEXTS, model="tiny")
    after = metric_samples(server)
    assert tokens_counted(after, "tiny") - tokens_counted(before, "tiny") == tiny["usage"]["prompt_tokens"]
    assert tokens_counted(after, "mini") == tokens_counted(before, "mini")
    per_model: dict[str, set[str]] = {}
    for s in after:
        if "model" in s.labels:
            per_model.setdefault(s.name.removesuffix("_bucket").removesuffix("_count"), set()).add(
                s.labels["model"]
            )
    families = {name for name in per_model if not name.endswith(("_sum", "_created"))}
    assert {"embed_input_tokens_total", "embed_replicas_ready", "embed_queue_size"} <= families
    for name in families:
        assert {"mini", "tiny"} <= per_model[name], name
    statuses = {(s.labels["model"], s.labels["status"]) for s in after if s.name == "embed_requests_total"}
    assert {("mini", "200"), ("tiny", "200")} <= statuses


# --- the command line and the refusals: nothing loads ---------------------------------------------------


def parsed(*argv: str):
    return serve_config(dict(vars(build_parser().parse_args(["serve", *argv]))))


def test_model_flags_after_a_model_are_its_own_and_before_the_first_every_models():
    config = parsed(
        "--dtype", "float32", "--model", "A", "--served-model-name", "a", "--max-batch-tokens", "8192",
        "--port", "9000", "--model", "B", "--no-auto-truncate", "--max-client-batch-size", "4",
    )  # fmt: skip
    a, b = config.models
    assert (a.model, a.served_model_name, a.max_batch_tokens, a.auto_truncate) == ("A", ["a"], 8192, True)
    assert (b.model, b.served_model_name, b.max_batch_tokens, b.auto_truncate) == ("B", [], None, False)
    assert (a.dtype, b.dtype, b.max_client_batch_size, a.max_client_batch_size) == ("float32",) * 2 + (
        4,
        2048,
    )
    assert config.server.port == a.port == b.port == 9000
    # One model: the flags read as they always did, in either order.
    assert parsed("--dtype", "bfloat16", "--model", "X").models[0].dtype == "bfloat16"
    assert parsed("--model", "X", "--dtype", "bfloat16").models[0].dtype == "bfloat16"


def test_a_toml_file_lists_models_and_flags_before_any_model_win(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(
        'port = 9100\nmax_batch_tokens = 2048\n[[models]]\nmodel = "A"\n'
        '[[models]]\nmodel = "B"\nmax_batch_tokens = 8192\nnum-threads = 2\n'
    )
    a, b = parsed("--config", str(file)).models
    assert (a.model, a.max_batch_tokens, b.model, b.max_batch_tokens, b.num_threads) == (
        "A",
        2048,
        "B",
        8192,
        2,
    )
    assert a.port == 9100
    a, b = parsed("--config", str(file), "--max-batch-tokens", "4096", "--port", "9200").models
    assert a.max_batch_tokens == b.max_batch_tokens == 4096 and b.port == 9200


@pytest.mark.parametrize(
    "text, why",
    [
        ("models:\n  - model: A\n    port: 3\n", "models[0].port is a server setting"),
        (
            "models:\n  - model: A\n    max_batch_tokens: 0\n",
            "models[0].max_batch_tokens=0: must be at least 1",
        ),
        ("batch_size: 3\n", "unknown setting 'batch_size'"),
        ("models: [A, B]\nprot: 1\n", "unknown setting 'prot'"),
    ],
)
def test_a_config_file_naming_a_setting_wrongly_is_refused_naming_it(tmp_path, text, why):
    file = tmp_path / "models.yaml"
    file.write_text(text)
    with pytest.raises(Refusal) as refused:
        parsed("--config", str(file))
    assert why in refused.value.lines[0] and str(file) in refused.value.lines[0]


@pytest.mark.parametrize(
    "name, text, why",
    [
        ("models.yaml", "models:\n  - model: [A\n", "not valid YAML: while parsing a flow sequence"),
        ("models.toml", "port = \n", "not valid TOML: Invalid value (at line 1, column 8)"),
        ("models.ini", "port=1\n", "a config file is .yaml, .yml or .toml, not .ini"),
    ],
)
def test_a_config_file_that_does_not_parse_is_refused_saying_where(tmp_path, name, text, why):
    file = tmp_path / name
    file.write_text(text)
    with pytest.raises(Refusal) as refused:
        parsed("--config", str(file))
    assert why in refused.value.lines[0]


def test_models_in_the_file_and_on_the_command_line_are_refused(tmp_path):
    file = tmp_path / "models.yaml"
    file.write_text("models: [A]\n")
    with pytest.raises(Refusal, match="list them in one place"):
        parsed("--config", str(file), "--model", "B")


def test_one_name_for_two_models_is_refused_before_loading(default_model_path):
    path = str(default_model_path)
    line = refusal(
        "--port", "0", "--model", path, "--served-model-name", "x", "--model", path, "--served-model-name", "y,x"
    )  # fmt: skip
    assert "the served name 'x' is given to model 1 and model 2" in line


def test_a_config_file_error_is_one_line_and_exit_2(tmp_path):
    file = tmp_path / "models.yaml"
    file.write_text("models:\n  - model: A\n    host: 0.0.0.0\n")
    line = refusal("--config", str(file), timeout=60)
    assert line.startswith("embed-service: --config: ") and "models[0].host is a server setting" in line
