# bcd: the two commands a newcomer needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint typecheck demo demo-vm proto clean bench compliance compliance-check mutation fuzz dist deb

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

# Wheels and sdists of the three distributions (bcd-shared, bcd-helper, bcd-agent) in dist/, built
# with the venv's setuptools (no build isolation, nothing downloaded). Install from the repository with
# `pip install --find-links dist bcd-helper` (or bcd-agent): bcd-shared comes from dist/ too.
dist: $(STAMP)
	rm -rf dist build/dist && mkdir -p dist
	for d in shared helper agent; do \
	  (cd $$d && rm -rf build *.egg-info && ../$(BIN)/python -c "from setuptools import build_meta as b; \
	    b.build_sdist('../dist'); b.build_wheel('../dist')" >/dev/null) || exit 1; \
	done
	ls dist

# The Debian packages bcd-helper and bcd-node in dist/ (packaging/build-deb.sh; dpkg-deb, each with its
# own venv under /opt/bcd/). Needs /usr/bin/python3.11 and python3-venv; fetches the dependencies'
# wheels at build time (the pins in constraints.txt), never at install time.
deb: dist
	packaging/build-deb.sh dist

clean:
	rm -rf $(VENV) .demo .mypy_cache .ruff_cache .pytest_cache .hypothesis .mutation mutants dist build

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
