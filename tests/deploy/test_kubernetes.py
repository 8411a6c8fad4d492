"""deploy/kubernetes: every overlay rendered with kustomize and validated, and the parts that must agree do.

Built-in kinds are validated with kubernetes-validate --strict (unknown fields rejected). The custom resources
(ServiceMonitor, PrometheusRule, ScaledObject) have no schema there: their CRDs live with the Prometheus
Operator and KEDA, so they are checked here for what makes them work (they select the Service and the
Deployment, name the port, query the metric the HPA scales on); the PrometheusRule's rules are promtool's
(test_prometheus.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from embed_service.config import Settings
from tests.deploy.tools import DOCKERFILE, ROOT, dockerfile_env, tool

K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu", "gpu-tp2"]
COMPONENTS = ["monitoring", "keda"]
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
# Variables the server reads that are not settings (ops/cpu_kernels.py).
KERNEL_VARIABLES = {"EMBED_KERNEL_CACHE", "EMBED_CPU_KERNELS", "EMBED_CPU_AMX"}
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def render(tmp_path: Path, overlay: str, components: list[str]) -> str:
    """`kubectl kustomize` of an overlay, with components added the way a user adds them."""
    if not components:
        target = K8S / "overlays" / overlay
    else:
        target = tmp_path / f"{overlay}-{'-'.join(components)}"
        target.mkdir()
        rel = os.path.relpath(K8S, target)  # kustomize refuses absolute paths
        (target / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [f"{rel}/overlays/{overlay}"],
                    "components": [f"{rel}/components/{c}" for c in components],
                }
            )
        )
    r = subprocess.run(
        [tool("kubectl"), "kustomize", str(target)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


CASES = (
    [(o, []) for o in OVERLAYS]
    + [(o, COMPONENTS) for o in OVERLAYS]
    + [("cpu", ["monitoring"]), ("gpu", ["model-volume"])]
)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[tuple[str, tuple[str, ...]], list[dict]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {(o, tuple(c)): list(yaml.safe_load_all(render(tmp, o, c))) for o, c in CASES}


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for d in docs:
        assert d["kind"] not in kinds, f"two {d['kind']}s"
        kinds[d["kind"]] = d
    return kinds


@pytest.mark.parametrize("kubernetes_version", ["1.37.0", "1.30.0"])
@pytest.mark.parametrize(
    ("overlay", "components"), CASES, ids=lambda v: "+".join(v) if isinstance(v, list) else v
)
def test_overlay_passes_strict_validation(rendered, tmp_path, overlay, components, kubernetes_version):
    docs = rendered[(overlay, tuple(components))]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", kubernetes_version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    passed = re.findall(r"passed for resource (\w+)/", r.stdout)
    builtin = [d["kind"].lower() for d in docs if d["kind"] not in CUSTOM_KINDS]
    assert sorted(passed) == sorted(builtin), r.stdout
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", r.stdout + r.stderr))
    assert unknown == {d["kind"] for d in docs} & CUSTOM_KINDS


@pytest.mark.parametrize(
    ("overlay", "components"), CASES, ids=lambda v: "+".join(v) if isinstance(v, list) else v
)
def test_everything_lands_in_one_namespace(rendered, overlay, components):
    for d in rendered[(overlay, tuple(components))]:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "embed-service", d["kind"]


def pod(docs: list[dict]) -> dict:
    return by_kind(docs)["Deployment"]["spec"]["template"]


def container(docs: list[dict]) -> dict:
    (c,) = pod(docs)["spec"]["containers"]
    return c


def env(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(docs)["env"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_drain_and_security(rendered, overlay):
    docs = rendered[(overlay, ())]
    spec, c = pod(docs)["spec"], container(docs)
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port_names == {"http": int(env(docs)["EMBED_PORT"])}
    for probe, path in (
        ("startupProbe", "/health"),
        ("readinessProbe", "/health"),
        ("livenessProbe", "/live"),
    ):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    # The grace period covers the preStop pause, the whole drain and the shutdown after it.
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env(docs)["EMBED_DRAIN_TIMEOUT"])
    assert drain == Settings.model_fields["drain_timeout"].default
    assert spec["terminationGracePeriodSeconds"] == sleep + drain + 10
    sc, psc = c["securityContext"], spec["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"]
        and not sc["allowPrivilegeEscalation"]
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    assert psc["runAsNonRoot"] and psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert f"USER {psc['runAsUser']}:{psc['runAsGroup']}" in DOCKERFILE
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_volumes_are_exactly_where_the_server_writes(rendered, overlay):
    """The kernel cache, HOME/.cache and /tmp (measured: the kernel build and its temporary files)."""
    docs = rendered[(overlay, ())]
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod(docs)["spec"]["volumes"]}
    assert set(mounts.values()) == set(volumes)
    assert all("emptyDir" in v and v["emptyDir"].get("sizeLimit") for v in volumes.values())
    kernel_cache = env(docs)["EMBED_KERNEL_CACHE"]
    assert kernel_cache == dockerfile_env("EMBED_KERNEL_CACHE")
    home_cache = dockerfile_env("HOME") + "/.cache"
    expected = {"/tmp", home_cache, str(Path(kernel_cache).parent)}
    if overlay == "gpu-tp2":
        expected.add("/dev/shm")  # NCCL between the ranks
    assert set(mounts) == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_embed_variable_is_a_setting(rendered, overlay):
    settings = {f"EMBED_{name.upper()}" for name in Settings.model_fields}
    for name in env(rendered[(overlay, ())]):
        if name.startswith("EMBED_"):
            assert name in settings | KERNEL_VARIABLES, f"{name}: no such setting"
    Settings(
        **{
            k[6:].lower(): v
            for k, v in env(rendered[(overlay, ())]).items()
            if k[6:].lower() in Settings.model_fields
        }
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select_the_pods(rendered, overlay):
    docs = rendered[(overlay, ("monitoring", "keda"))]
    kinds = by_kind(docs)
    labels = pod(docs)["metadata"]["labels"]

    def selects(selector: dict, target: dict) -> bool:
        return bool(selector) and all(target.get(k) == v for k, v in selector.items())

    deployment, service = kinds["Deployment"], kinds["Service"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert selects(service["spec"]["selector"], labels)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert selects(kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels)
    policy = kinds["NetworkPolicy"]["spec"]
    assert selects(policy["podSelector"]["matchLabels"], labels)
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == ["http"]
    monitor = kinds["ServiceMonitor"]["spec"]
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert kinds["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "HorizontalPodAutoscaler" not in kinds  # KEDA owns the scaling then


def adapter_rule() -> dict:
    values = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_reads_the_servers_load_metric(rendered, overlay):
    hpa = by_kind(rendered[(overlay, ())])["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "embed-service"}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    rule = adapter_rule()
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert rule["seriesQuery"].startswith(rule["name"]["as"] + "{")
    assert int(metric["pods"]["target"]["averageValue"]) >= 1
    # KEDA: the same metric and, on the CPU overlay, the same per-pod target.
    trigger = by_kind(rendered[(overlay, ("monitoring", "keda"))])["ScaledObject"]["spec"]["triggers"][0]
    assert rule["name"]["as"] + "{" in trigger["metadata"]["query"]
    if overlay == "cpu":
        assert trigger["metadata"]["threshold"] == metric["pods"]["target"]["averageValue"]


@pytest.mark.parametrize(
    ("overlay", "gpus", "tag"),
    [("cpu", 0, VERSION), ("gpu", 1, f"{VERSION}-cuda"), ("gpu-tp2", 2, f"{VERSION}-cuda")],
)
def test_resources_and_image_per_overlay(rendered, overlay, gpus, tag):
    docs = rendered[(overlay, ())]
    c = container(docs)
    assert c["image"] == f"embed-service:{tag}"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert int(limits.get("nvidia.com/gpu", 0)) == gpus == int(requests.get("nvidia.com/gpu", 0))
    # Whole CPUs: the server sizes threads and replicas from the quota (cgroup cpu.max), rounded down.
    assert re.fullmatch(r"\d+", str(limits["cpu"])), limits["cpu"]
    assert limits["memory"] and requests["memory"]
    e = env(docs)
    assert int(e.get("EMBED_TENSOR_PARALLEL_SIZE", 1)) == max(gpus, 1)
    assert e.get("EMBED_DEVICE", "auto") == ("cuda" if gpus else "auto")


def test_model_volume_is_read_only_where_the_image_looks_for_models(rendered):
    docs = rendered[("gpu", ("model-volume",))]
    (mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == "models"]
    assert mount["readOnly"] is True
    assert dockerfile_env("HF_HUB_CACHE").startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod(docs)["spec"]["volumes"] if v["name"] == "models"]
    claim = by_kind(docs)["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    # Everything else as in the plain overlay: the model volume adds no writable place.
    writable = {m["mountPath"] for m in container(docs)["volumeMounts"] if not m.get("readOnly")}
    assert writable == {m["mountPath"] for m in container(rendered[("gpu", ())])["volumeMounts"]}
