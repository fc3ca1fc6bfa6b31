# bcd: the two commands a newcomer needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint typecheck demo demo-vm proto clean bench compliance compliance-check mutation fuzz

$(STAMP): shared/pyproject.toml helper/pyproject.toml agent/pyproject.toml devhost/pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ./shared -e ./helper -e './agent[dev]' -e ./devhost
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check shared helper agent devhost tests
	$(BIN)/ruff format --check shared helper agent devhost tests

typecheck: $(STAMP)
	$(BIN)/mypy shared/bcd_shared helper/bcd_helper agent/bcd_agent devhost/bcd_simhost

test: $(STAMP) lint typecheck compliance-check
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider

proto: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m bcd_agent.tools.genproto

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/bcd sim --spec examples/gpu-node.json --root .demo/root --fresh --once

# A GPU VM (a VFIO GPU) beside container holds, on the simulated host's file-backed libvirt-kvm.
demo-vm: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/bcd sim --spec examples/vm-node.json --root .demo/vm-root --fresh --once

bench: $(STAMP)
	$(BIN)/bcd bench all

clean:
	rm -rf $(VENV) .demo .mypy_cache .ruff_cache .pytest_cache .hypothesis .mutation mutants

compliance: $(STAMP)
	$(BIN)/python -m bcd_agent.tools.compliance

# Fails when docs/compliance.md names a test function that does not exist, or is out of date.
compliance-check: $(STAMP)
	$(BIN)/python -m bcd_agent.tools.compliance --check

# Mutation testing of the scopes in docs/mutation.md (hours; not in CI). SCOPES="helper pki" to narrow.
mutation: $(STAMP)
	$(BIN)/python -m bcd_agent.tools.mutation $(SCOPES)

# One fuzz target under atheris: make fuzz TARGET=helper_frame SECONDS=600 (docs/testing.md).
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz/run.py $(TARGET) --seconds $(or $(SECONDS),600)
