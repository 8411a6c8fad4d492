#!/bin/sh
# The GPU path in one command, on one CUDA device in under 5 minutes, nothing downloaded (docs/gpu.md):
#   benchmarks/gpu_check.sh [--out summary.json]      on a GPU machine, in an environment installed with
#                                                     scripts/install.sh VENV runtime, dev and gpu
#   benchmarks/gpu_check.sh --cpu-dry-run              the same steps on the CPU at toy sizes
# Prints one JSON summary on stdout (progress on stderr); exits 0 when every check passed.
# PYTHON: the interpreter (default .venv/bin/python, else python3).
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
exec "$PY" -m benchmarks.gpu_check "$@"
