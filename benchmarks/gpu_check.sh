#!/bin/sh
# The GPU path in one command, on one CUDA device in 8 minutes, nothing downloaded there (docs/gpu.md):
#   benchmarks/gpu_check.sh --prepare [DIR] [--no-download]
#       here, with network to PyPI: the wheels the device image lacks and the tokenizers, into DIR (an
#       ignored folder of this repository, default .gpu-carry, under 56 MiB); prints the device command
#   benchmarks/gpu_check.sh --carried DIR [--out summary.json]
#       on the device: installs DIR's wheels into a scratch folder, then every step (summary after each)
#   benchmarks/gpu_check.sh [--out summary.json]      on a GPU machine with scripts/install.sh's environment
#   benchmarks/gpu_check.sh --cpu-dry-run              the same steps on the CPU at toy sizes
# Prints one JSON summary on stdout (progress on stderr); exits 0 when every check passed.
# PYTHON: the interpreter (default .venv/bin/python, else python3).
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
EXTRA=
prev=
for arg in "$@"; do
  if [ "$prev" = --carried ]; then
    SITE=${TMPDIR:-/tmp}/gpu-check-site
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --target "$SITE" "$arg"/wheels/*.whl
    EXTRA=$SITE
  fi
  prev=$arg
done
if [ "${1:-}" = --prepare ]; then
  shift
  DIR=.gpu-carry
  case ${1:-} in -*|'') ;; *) DIR=$1; shift ;; esac
  set -- --prepare "$DIR" "$@"
fi
PYTHONPATH="${EXTRA:+$EXTRA:}$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
exec "$PY" -m benchmarks.gpu_check "$@"
