"""The Dockerfile: hadolint clean, its install steps the Makefile's, its health check and model baking real.

No Docker engine runs here: what needs one (the build, --read-only, the non-root run) is listed in
docs/deployment.md; what can be checked without one is checked here, against a live server where it talks.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.hf_cache import lay_out_cache
from tests.deploy.tools import DOCKERFILE as TEXT
from tests.deploy.tools import ROOT, dockerfile_env, tool
from tests.server import free_port

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    for raw in re.sub(r"\\\n", " ", TEXT).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_is_clean():
    r = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_every_ignored_rule_is_explained():
    lines = TEXT.splitlines()
    pragmas = [i for i, ln in enumerate(lines) if ln.startswith("# hadolint ignore=")]
    assert pragmas, "no ignores: drop this test's premise"
    for i in pragmas:
        for rule in lines[i].split("=", 1)[1].split(","):
            comment = []
            for ln in reversed(lines[:i]):
                if not ln.startswith("#"):
                    break
                comment.append(ln)
            assert any(rule in c and len(c) > len(rule) + 10 for c in comment), f"{rule} at line {i + 1}"


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, by the stage's name."""
    out: dict[str, list[tuple[str, str]]] = {}
    name = ""
    for word, args in instructions():
        if word == "FROM":
            name = args.split(" AS ")[-1].strip() if " AS " in args else args
            out[name] = []
        elif name:
            out[name].append((word, args))
    return out


def test_both_targets_install_with_the_makefile_script():
    runs = [args for word, args in instructions() if word == "RUN" and "install.sh" in args]
    assert any("/opt/venv deps" in r and 'TORCH_INDEX_URL="${TORCH_INDEX_URL}"' in r for r in runs)  # cpu
    assert any("CUDA_TORCH_INDEX_URL" in r and "/opt/venv gpu" in r for r in runs)  # cuda
    assert sum("/opt/venv package" in r for r in runs) == 2
    assert "scripts/install.sh $(VENV)" in (ROOT / "Makefile").read_text()


def test_dependencies_are_installed_in_a_layer_keyed_by_pyproject_alone():
    """A source change must not reinstall torch: the dependencies' RUN comes before any COPY of the sources,
    after COPYs of pyproject.toml and the install script only; the image takes that venv from the
    dependencies' stage and only the package's files from the stage that installs it."""
    for stage in ("cpu-deps", "cuda-build"):
        steps = stages()[stage]
        deps = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "/opt/venv deps" in a)
        copied = [a.split()[:-1] for w, a in steps[:deps] if w == "COPY"]
        assert sorted(src for sources in copied for src in sources) == [
            "pyproject.toml",
            "scripts/install.sh",
        ]
        later = [a for w, a in steps[deps:] if w == "COPY"] + [
            a for w, a in stages().get("cpu-build", []) if w == "COPY"
        ]
        assert any(a.startswith("src ") for a in later)
    cpu = [a for w, a in stages()["cpu"] if w == "COPY"]
    assert cpu[:2] == ["--from=cpu-deps /opt/venv /opt/venv", "--from=cpu-build /stage/ /"]


def test_no_syntax_directive_that_pulls_a_frontend_image():
    """`# syntax=docker/dockerfile:1` pulls docker/dockerfile from Docker Hub at every build (air-gapped
    builds fail); BuildKit's built-in frontend parses RUN --mount."""
    directives = []
    for line in TEXT.splitlines():
        if not line.startswith("#"):
            break
        directives.append(line.replace(" ", "").lower())
    assert not any(d.startswith("#syntax=") for d in directives)
    assert "RUN --mount=type=cache" in TEXT


def test_final_stages_are_non_root_with_a_health_check_and_the_port():
    for target in ("cpu", "cuda"):
        words = dict(stages()[target])
        assert words["USER"] == "10001:10001"
        assert words["EXPOSE"] == "8000"
        assert "/health" in words["HEALTHCHECK"]
        assert json.loads(words["ENTRYPOINT"]) == ["embed-service", "serve"]
        assert words["STOPSIGNAL"] == "SIGTERM"
        assert not any(w == "RUN" and "pip" in a for w, a in stages()[target]), "pip runs in the build stages"
    assert list(stages())[-1] == "default" and instructions()[-1] == ("FROM", "cpu AS default")


def test_the_cpu_image_ships_the_kernel_prebuilt_and_no_compiler():
    cpu_run = " ".join(a for w, a in stages()["cpu"] if w == "RUN")
    assert "gcc" not in cpu_run and "libc6-dev" not in cpu_run
    assert "libgomp1" in cpu_run  # the kernel's OpenMP runtime
    build_run = " ".join(a for w, a in stages()["cpu-build"] if w == "RUN")
    assert "python -m embed_service.ops.cpu_kernels prebuild" in build_run


def test_the_cuda_image_can_run_triton_under_a_read_only_root():
    """Triton compiles a C helper against Python.h at its first launch and caches compiled kernels: the
    image needs a compiler and headers, and Triton's cache in the writable kernel-cache mount, not in
    ~/.triton under the read-only root. Its torch is pinned as the CPU image's is."""
    cuda = stages()["cuda"]
    run = " ".join(a for w, a in cuda if w == "RUN")
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(run.split())
    env = " ".join(a for w, a in cuda if w == "ENV")
    cache = dockerfile_env("EMBED_KERNEL_CACHE")
    writable = str(Path(cache).parent)
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME"):
        value = re.search(rf"\b{name}=(\S+)", env)
        assert value and (value.group(1) + "/").startswith(writable + "/"), name
    spec = re.search(r"ARG CUDA_TORCH_SPEC=(\S+)", TEXT)
    cpu_default = re.search(
        r"TORCH_SPEC=\$\{TORCH_SPEC:-(\S+)\}", (ROOT / "scripts" / "install.sh").read_text()
    )
    assert spec and cpu_default and spec.group(1) == cpu_default.group(1) == "torch==2.13.0"


def test_build_context_holds_what_the_dockerfile_copies():
    patterns = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and ln[0] != "#"]

    def included(path: str) -> bool:
        keep = True
        for pat in patterns:
            negate = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = negate
        return keep

    copied = [args.split()[:-1] for word, args in instructions() if word == "COPY" and "--from" not in args]
    for sources in copied:
        for src in sources:
            assert (ROOT / src).exists(), src
            assert included(src), f"{src} is excluded by .dockerignore"
    assert not included("tests/test_docs.py") and not included(".venv/bin/python")


def healthcheck_command() -> list[str]:
    (args,) = [a for w, a in instructions() if w == "HEALTHCHECK" and "EMBED_PORT" in a][:1]
    return json.loads(args[args.index("CMD") + 3 :].strip())


def test_health_check_passes_on_a_ready_server_and_fails_without_one(live_server):
    cmd = healthcheck_command()
    assert cmd[0] == "python"
    cmd = [sys.executable, *cmd[1:]]
    ok = subprocess.run(cmd, env={"EMBED_PORT": str(live_server.port)}, capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run(cmd, env={"EMBED_PORT": str(free_port())}, capture_output=True, timeout=30)
    assert down.returncode != 0


def test_baking_a_model_fetches_it_into_the_cache(tmp_path, default_model_path):
    """The model stage's command, offline against a laid-out cache (the build itself would download)."""
    lay_out_cache(tmp_path, "acme/baked", default_model_path, {"c" * 40: ["main"]})
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-m", "embed_service.model_source"]
    ok = subprocess.run([*run, "acme/baked"], env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()) == tmp_path / "models--acme--baked" / "snapshots" / ("c" * 40)
    missing = subprocess.run([*run, "acme/other"], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "HF_HUB_OFFLINE is set" in missing.stderr


@pytest.mark.parametrize(
    "script", ["scripts/install.sh", "scripts/image_test.sh", ".ci/run", "benchmarks/gpu_check.sh"]
)
def test_shell_scripts_pass_shellcheck(script):
    r = subprocess.run([tool("shellcheck"), str(ROOT / script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def test_every_embed_variable_the_image_sets_is_a_setting():
    from embed_service.config import Settings

    settings = {f"EMBED_{name.upper()}" for name in Settings.model_fields}
    env = " ".join(args for word, args in instructions() if word == "ENV")
    names = set(re.findall(r"\b(EMBED_[A-Z_]+)=", env))
    assert {"EMBED_HOST", "EMBED_PORT", "EMBED_MODEL", "EMBED_REVISION"} <= names
    assert names <= settings | {"EMBED_KERNEL_CACHE"}, names - settings


def test_an_image_built_without_a_model_serves_the_packaged_one(monkeypatch):
    """The image sets EMBED_MODEL and EMBED_REVISION to its build arguments, empty by default."""
    from embed_service.config import Settings
    from embed_service.server import build_engine

    monkeypatch.setenv("EMBED_MODEL", "")
    monkeypatch.setenv("EMBED_REVISION", "")
    engine = build_engine(Settings(device="cpu"))
    assert engine.name == "all-MiniLM-L6-v2"
