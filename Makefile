# Two commands do everything: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# the runtime's own environment: its extras and the test tools, no compiler (no torch, no transformers)
RUNTIME_VENV ?= .venv-runtime
# where the main environment compiles the artifacts tests/runtime runs in RUNTIME_VENV
PREBUILT ?= build/test-artifacts
# test files are spread over this many processes (a file's tests stay together, so its session fixtures are built once),
# in tests/conftest.py's order (longest first) rather than xdist's own (most tests first)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: demo test test-main quick test-runtime docs lint format install

# `pip install $(2)` run by the Python $(1), tried three times: a registry connection that drops mid-download would
# otherwise fail the whole setup (pip's own retries only cover connecting and resuming one file)
define pip_install
echo "$(1) -m pip install $(2)"; for attempt in 1 2 3; do \
	$(1) -m pip install --quiet --retries 10 $(2) && exit 0; \
	echo "pip install $(2): attempt $$attempt of 3 failed" >&2; sleep 20; \
done; exit 1
endef

install: $(VENV)/.installed

# torch is pinned (2.13.0, CPU build); an unpinned torch would pull several GB of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	@$(call pip_install,$(PY),--upgrade pip)
	@$(call pip_install,$(PY),--resume-retries 20 -e '.[dev]')
	touch $@

# The first run compiles the example once into ~/.cache/llmlower/artifacts; every run prints its decode speed.
demo: install
	$(VENV)/bin/llmlower generate example --prompt "$(PROMPT)" --max-tokens 64

# The whole suite: lint; then every test but tests/runtime in the main environment, and beside it, as jobs of their
# own, the runtime's environment with tests/runtime in it (no torch) and the docs: the suite's workers leave a core
# idle while they wait on servers and subprocesses, and these fill it. The suite's output streams (+: make passes
# it through); the other jobs' is printed whole as each ends (-Otarget).
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) -j3 -Otarget test-main test-runtime docs

test-main: install
	+$(PY) -m pytest $(XDIST) --ignore=tests/runtime

# The quick loop while editing: everything but the slow tests (the real SmolLM2, Ray Serve replicas) and the
# TVM and MLIR backends' builds and kernels (-k matches test, parameter and file names), so the frontend, the
# passes, the ONNX backend, the runtime, the CLI and the server. make test before a commit runs the rest.
quick: install
	$(PY) -m pytest $(XDIST) -m "not slow" -k "not tvm and not mlir"

# The runtime proven torch-free: the main environment compiles tests/runtime's artifacts (tests/runtime/prepare.py),
# then RUNTIME_VENV, where torch and transformers are not installed, runs tests/runtime on them.
test-runtime: install $(RUNTIME_VENV)/.installed
	rm -rf $(PREBUILT)
	$(PY) tests/runtime/prepare.py $(PREBUILT)
	LLMLOWER_TEST_ARTIFACTS=$(PREBUILT) $(RUNTIME_VENV)/bin/python -m pytest tests/runtime

$(RUNTIME_VENV)/.installed: pyproject.toml
	python3 -m venv $(RUNTIME_VENV)
	@$(call pip_install,$(RUNTIME_VENV)/bin/python,--upgrade pip)
	@$(call pip_install,$(RUNTIME_VENV)/bin/python,--resume-retries 20 -e '.[test-runtime]')
	touch $@

# The documentation site, into build/site; the CLI and pass reference pages are generated from the code
# (docs/hooks.py), and every warning (a broken link, a page missing from nav) fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
