"""One stop timeout everywhere, derived from the settings; compose's monitoring services optional.

SIGTERM drains for up to EMBED_DRAIN_TIMEOUT, then the workers get WorkerGroup.close's timeout, then the
process exits: `docker stop -t`, compose's stop_grace_period and the docs must allow all of it (Docker's
default 10 s cut off 19 of 40 requests in flight). Kubernetes adds its preStop pause instead of the exit
allowance (tests/deploy/test_kubernetes.py), which comes to the same number.
"""

from __future__ import annotations

import inspect
import re
import subprocess

import yaml

from embed_service.config import Settings
from embed_service.workers.group import WorkerGroup
from tests.deploy.tools import DOCKERFILE, ROOT, tool

EXIT_ALLOWANCE_S = 5  # uvicorn's connections closed and the interpreter gone, after the workers


def stop_timeout() -> int:
    drain = Settings.model_fields["drain_timeout"].default
    workers = inspect.signature(WorkerGroup.close).parameters["timeout"].default
    return int(drain + workers + EXIT_ALLOWANCE_S)


def compose(*args: str) -> dict:
    r = subprocess.run(
        [tool("docker-compose"), *args, "config"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def test_one_stop_timeout_in_the_dockerfile_compose_and_the_docs():
    t = stop_timeout()
    assert t == 45
    assert re.findall(r"docker stop -t (\d+)", DOCKERFILE) == [str(t)]
    docs = (ROOT / "docs" / "deployment.md").read_text()
    in_docs = re.findall(r"docker stop -t (\d+)", docs) + re.findall(r"stop_grace_period: (\d+)s", docs)
    assert in_docs and set(in_docs) == {str(t)}, in_docs
    assert compose()["embed-service"]["stop_grace_period"] in (f"{t}s", t, f"{t}.0s")
    assert "STOPSIGNAL SIGTERM" in DOCKERFILE


def test_the_server_starts_without_the_monitoring_images():
    """Services in a profile are started only when it is named: `docker compose up` starts the server alone,
    and nothing it depends on needs the Prometheus or Grafana image."""
    services = compose()
    assert "profiles" not in services["embed-service"]
    assert not services["embed-service"].get("depends_on")
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
