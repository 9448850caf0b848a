# The two newcomer commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast soak check protos bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

demo: install
	$(PY) scripts/demo.py

# every test in two worker processes: the slow end-to-end ones (real coordinators and nodes) beside the
# fast ones, so that one's waits are the other's CPU; loadfile keeps each module on one worker, where
# its module-scoped cluster is started once.
# What each slow test proves: tests/README.md. Long chaos and soak runs: `make soak`.
test: install check
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# the slow tests 5 times in a row beside a busy loop (tests/README.md): before resolving an issue that
# touches faults, averaging or placement
soak: install
	PY=$(PY) bash scripts/soak.sh

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
