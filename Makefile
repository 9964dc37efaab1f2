# Two commands do all the set-up on a fresh machine:
#   make run    installs into .venv (first time) and runs the main job: type-check and print every model
#   make test   installs into .venv (first time) and runs lint + the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# onnxruntime-web for `kestrel serve`'s page, from the npm registry (package-lock.json pins it)
WEB    := web/node_modules/.package-lock.json

.PHONY: setup web run test slow bench lint clean

$(WEB): web/package.json web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error

web: $(WEB)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/kestrel check
	$(BIN)/kestrel inspect --all

test: $(STAMP) $(WEB)
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -q

slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python bench/run.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) build src/*.egg-info web/node_modules
