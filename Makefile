# Two commands do all the set-up on a fresh machine:
#   make run    installs into .venv (first time) and runs the main job: type-check every model, one line each
#               (checked, parameters, entries); `kestrel inspect --all` prints every architecture in full
#   make test   installs into .venv (first time) and runs lint + the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# what the diagrams, the site and its browser tests use from the system (Debian packages):
# graphviz lays the graphs out, chromium runs the browser tests, fonts-dejavu-core sets their labels

# onnxruntime-web for `kestrel serve`'s page, from the npm registry (package-lock.json pins it)
WEB    := web/node_modules/.package-lock.json

.PHONY: setup system web run site test slow bench lint clean

# installs only what is missing; as root with apt (CI, these machines), else through sudo, else says what to install
system:
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	[ -f /usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf ] || missing="$$missing fonts-dejavu-core"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then apt=apt-get; \
	  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then apt="sudo apt-get"; fi; \
	  if [ -n "$$apt" ]; then \
	    echo "installing$$missing (apt)"; \
	    { $$apt update -qq && DEBIAN_FRONTEND=noninteractive $$apt install -y -qq --no-install-recommends $$missing; } \
	      || echo "warning: could not install$$missing: diagrams and the browser tests need them"; \
	  else echo "warning: install$$missing for diagrams and the browser tests (Debian: apt-get install$$missing)"; fi; \
	fi

$(WEB): web/package.json web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error

web: $(WEB)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: system $(STAMP) $(WEB)

run: system $(STAMP)
	$(BIN)/kestrel inspect

# the suite's files run in parallel workers (pytest-xdist, one file per worker: module fixtures built once), one
# per core up to four; much of it is single-threaded Python (exports, lowering, the site). TEST_WORKERS=0: in-process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: system $(STAMP) $(WEB)
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

site: system $(STAMP)
	$(BIN)/kestrel site --out site --serve

slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python bench/run.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) build site src/*.egg-info web/node_modules
