# The two newcomer commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast check protos bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

demo: install
	$(PY) scripts/demo.py

# the fast tests in two processes (one process each, no shared state), then the slow end-to-end ones
# one at a time: they start real coordinators and nodes, and time what they do
test: install check
	$(PY) -m pytest -q -n 2 -m "not slow"
	$(PY) -m pytest -q -m slow --durations=25

# lint and types (configured in pyproject.toml); `make test` runs this first
check: install
	$(VENV)/bin/ruff check ravnest coordinator node
	$(VENV)/bin/mypy ravnest coordinator node

test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow"

protos: install
	$(PY) -m grpc_tools.protoc --version >/dev/null && bash scripts/gen_protos.sh

bench: install
	$(PY) -m bench.wire
	$(PY) -m bench.pipeline
	$(PY) -m bench.allreduce
	$(PY) -m bench.planner
	$(PY) -m bench.memory

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
