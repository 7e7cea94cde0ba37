# Two commands do everything: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# test files are spread over this many processes (a file's tests stay together, so its session fixtures are built once)
TEST_WORKERS ?= 2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: demo test lint format install

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

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
