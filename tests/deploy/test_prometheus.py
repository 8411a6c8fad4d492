"""deploy/prometheus: the alert rules and their unit tests (promtool), the scrape config, the PrometheusRule
made from the same rules, and the autoscaling queries run on test series."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.tools import ROOT, tool

PROM = ROOT / "deploy" / "prometheus"
K8S = ROOT / "deploy" / "kubernetes"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=PROM)


def alerts() -> list[dict]:
    (group,) = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return group["rules"]


def test_rules_pass_promtool_check():
    r = promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


@pytest.mark.parametrize("tests", ["alerts_test.yml", "autoscaling_test.yml"])
def test_rule_unit_tests_pass(tests):
    r = promtool("test", "rules", tests)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_tested_firing_and_silent():
    cases = [
        c
        for t in yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
        for c in t["alert_rule_test"]
    ]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it stays silent"


def test_every_alert_has_a_runbook_section():
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for rule in alerts():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == rule["alert"].lower()
        assert f"### {rule['alert']}" in docs, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_scrape_config_passes_promtool_check():
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheusrule_is_made_from_the_rules_file():
    generated = yaml.safe_load((K8S / "components" / "monitoring" / "prometheusrule.yaml").read_text())
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    assert generated["spec"]["groups"] == rules["groups"], "run: python scripts/prometheusrule.py"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, 'scripts'); import prometheusrule, yaml; "
            "assert prometheusrule.prometheus_rule() == yaml.safe_load(open(prometheusrule.OUT))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def promql_tests() -> list[str]:
    (case,) = yaml.safe_load((PROM / "autoscaling_test.yml").read_text())["tests"]
    return [t["expr"] for t in case["promql_expr_test"]]


def test_autoscaling_queries_are_the_tested_ones():
    values = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    # The adapter's template for the HPA asking about pods a and b of the namespace.
    adapter = (
        rule["metricsQuery"]
        .replace("<<.Series>>", re.match(r"\w+", rule["seriesQuery"]).group(0))
        .replace("<<.LabelMatchers>>", 'namespace="embed-service",pod=~"a|b"')
        .replace("<<.GroupBy>>", "pod")
    )
    scaled = yaml.safe_load((K8S / "components" / "keda" / "scaledobject.yaml").read_text())
    keda = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert promql_tests() == [adapter, keda]
