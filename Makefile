# The two commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, pinned: the CPU build on local disk. An unpinned torch pulls several GB of CUDA wheels.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast lint typecheck check system-deps clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[all]"
	touch $@

system-deps:
	./tools/install-system-deps.sh

demo: $(BIN)/.installed
	$(BIN)/trainvitals demo --ranks 4 --port $(or $(PORT),0)

test: $(BIN)/.installed system-deps
	$(BIN)/python -m pytest -q

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(BIN)/.installed
	$(BIN)/ruff check agent service wire dashboards examples migrations testing tests benchmarks

typecheck: $(BIN)/.installed
	MYPY=$(BIN)/mypy ./tools/typecheck.sh

# The quality gates CI runs before the tests.
check: lint typecheck

clean:
	rm -rf $(VENV) build demo-out trainvitals.db trainvitals-spool
