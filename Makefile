# Two commands: `make serve` and `make test`. Each creates .venv if needed and installs what it uses.
# `make test` also checks the deployment files: the Dockerfile (hadolint), every Kubernetes overlay
# (kubectl kustomize + kubernetes-validate), the alert rules (promtool) and the dashboard (tests/deploy/).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Empty: scripts/install.sh's torch==2.13.0, and its choice of source: without a GPU the CPU build (a
# configured wheelhouse, else PyTorch's CPU index; PyPI's Linux wheel is the CUDA build, ~4 GB with its
# nvidia-* wheels). TORCH_INDEX_URL=none: pip's own configuration. GPU installs: see docs/install.md.
TORCH_SPEC ?=
TORCH_INDEX_URL ?=
ARGS ?=

.PHONY: serve test lint typecheck unit bench clean image-test

# One install script for make and the Dockerfile: the image is built with the steps tested here.
INSTALL := PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX_URL="$(TORCH_INDEX_URL)" EDITABLE=1 \
	scripts/install.sh $(VENV)

$(VENV)/.installed: pyproject.toml scripts/install.sh
	@echo "First run: installing torch, embed-service and the default model into $(VENV) (a minute or two)."
	@$(INSTALL) runtime
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	@$(INSTALL) dev
	@touch $@

serve: $(VENV)/.installed
	$(BIN)/embed-service serve $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks scripts kernels
	$(BIN)/ruff format --check src tests benchmarks scripts kernels
	$(BIN)/shellcheck scripts/install.sh scripts/image_test.sh .ci/run benchmarks/gpu_check.sh

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy src/embed_service

unit: $(VENV)/.installed-dev
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck unit

# The side-by-side comparison (~30 min on 2 busy cores; not part of `make test`): docs/performance.md and its
# plot. The peers (sentence-transformers' CPU backends, Infinity, the decoder's folder) are set up on first use
# in $(EMBED_PEERS) (default ../peers beside the shared folder), outside the repository.
bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/compare.py --update-docs $(BENCH_ARGS)
	$(BIN)/python benchmarks/plot.py

# The CPU image, built and run as docs/deployment.md documents (needs a Docker engine; not part of `make test`):
# size, read-only run, /health, the kernel, an embedding against this venv, `docker stop`, the layer cache.
image-test: $(VENV)/.installed
	PYTHON=$(abspath $(BIN))/python scripts/image_test.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
