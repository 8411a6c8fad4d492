"""The Grafana dashboard and the metrics that the rules, the dashboard and autoscaling name: every one of the
server's own is exported by a live server, every query parses, and docker-compose.yml wires them together."""

from __future__ import annotations

import json
import re
import subprocess
import warnings
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.tools import ROOT, dockerfile_env, tool

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "embed-service.json"
# Series that come from elsewhere: Prometheus itself (up) and kube-state-metrics (kube_*).
FROM_ELSEWHERE = {"up", "kube_deployment_spec_replicas", "kube_deployment_status_replicas_available"}
# The worker restart counter ships with the worker supervision change; until a server exports it, it is the
# one name allowed to be missing (and only while it is missing).
PENDING: set[str] = set()  # named in the rules or the dashboard ahead of the server exporting it
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "avg_over_time", "min_over_time", "max_over_time",
    "min", "max", "count", "and", "on", "le", "job", "model", "status", "instance", "namespace", "pod",
}  # fmt: skip


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def autoscaling_exprs() -> list[str]:
    k8s = ROOT / "deploy" / "kubernetes"
    adapter = yaml.safe_load((k8s / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    keda = yaml.safe_load((k8s / "components" / "keda" / "scaledobject.yaml").read_text())
    return [r["seriesQuery"] for r in adapter["rules"]["custom"]] + [
        t["metadata"]["query"] for t in keda["spec"]["triggers"]
    ]


def metric_names(expr: str) -> set[str]:
    """Identifiers that are series names: not functions, keywords, label names, durations or strings."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # ranges
    expr = re.sub(r"\b(by|on|without|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set(re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*\b", expr)) - PROMQL_WORDS
    return {n for n in names if not n.startswith("__")}


@pytest.fixture(scope="module")
def exported(live_server) -> set[str]:
    """Sample names a live server (the packaged default model) exports, after one request."""
    body = {"input": ["a metric check"], "model": "all-MiniLM-L6-v2"}
    assert httpx.post(live_server.url + "/v1/embeddings", json=body, timeout=60).status_code == 200
    text = httpx.get(live_server.url + "/metrics", timeout=10).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("source", [rule_exprs, dashboard_exprs, autoscaling_exprs], ids=lambda f: f.__name__)
def test_every_metric_named_is_exported_by_the_server(exported, source):
    named = set().union(*(metric_names(e) for e in source()))
    assert named, "no metric names found: the parser is broken"
    missing = named - exported - FROM_ELSEWHERE
    assert missing <= PENDING, f"named but not exported: {sorted(missing - PENDING)}"
    if missing:
        warnings.warn(f"not exported yet (pending): {sorted(missing)}", stacklevel=1)
    # Every embed_* series the server has is something the dashboard shows (a new metric gets a panel).
    if source is dashboard_exprs:

        def family(name: str) -> str:
            return re.sub(r"_(bucket|sum|count)$", "", name)

        server_side = {family(n) for n in exported if n.startswith("embed_") and not n.endswith("_created")}
        assert server_side <= {family(n) for n in named}, "a metric without a panel"


def test_dashboard_queries_parse(tmp_path):
    """Each panel's query, Grafana's variables filled in, as a recording rule: promtool parses it."""
    exprs = [
        e.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$model", ".*")
        for e in dashboard_exprs()
    ]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"panel:{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_covers_what_operators_look_at():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "throughput",
        "latency percentiles",
        "queue",
        "batch size",
        "in-flight",
        "errors by status",
    ):
        assert topic in titles, topic
    ids = [t["refId"] for p in dash["panels"] for t in p.get("targets", [])]
    assert all(ids)
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "job", "model"}


def test_compose_stack_wires_the_rules_and_the_dashboard():
    r = subprocess.run(
        [tool("docker-compose"), "config"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    stack = yaml.safe_load(r.stdout)["services"]
    server, prometheus, grafana = stack["embed-service"], stack["prometheus"], stack["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"] + grafana["volumes"]}
    assert mounts["/etc/prometheus/alerts.yml"].endswith("deploy/prometheus/alerts.yml")
    assert mounts["/var/lib/grafana/dashboards"].endswith("deploy/grafana/dashboards")
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (target,) = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"embed-service:{server['ports'][0]['target']}"
    source = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == f"http://prometheus:{prometheus['ports'][0]['target']}"
    assert server["read_only"] is True and server["cap_drop"] == ["ALL"]
    # Writable: the model cache (a volume: repo-id downloads go there) and tmpfs where the server writes.
    writable = {v.split(":")[1] for v in server["volumes"]} | {t.split(":")[0] for t in server["tmpfs"]}
    cache = dockerfile_env("HF_HUB_CACHE")
    assert any(cache.startswith(w + "/") for w in writable), cache
    assert {
        "/tmp",
        dockerfile_env("HOME") + "/.cache",
        str(Path(dockerfile_env("EMBED_KERNEL_CACHE")).parent),
    } <= writable
    assert int(server["stop_grace_period"].rstrip("s")) > 30  # the drain
