# Two commands do everything: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# test files are spread over this many processes (a file's tests stay together, so its session fixtures are built once)
TEST_WORKERS ?= 2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: demo test docs lint format install

install: $(VENV)/.installed

# torch is pinned (2.13.0, CPU build); an unpinned torch would pull several GB of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The first run compiles the example once into ~/.cache/llmlower/artifacts; every run prints its decode speed.
demo: install
	$(VENV)/bin/llmlower generate example --prompt "$(PROMPT)" --max-tokens 64

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) docs

# The documentation site, into build/site; the CLI and pass reference pages are generated from the code
# (docs/hooks.py), and every warning (a broken link, a page missing from nav) fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
