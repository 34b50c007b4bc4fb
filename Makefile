# Every target bootstraps .venv first, so a fresh clone needs nothing installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-cpu.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: venv test test-fast serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt scripts/bootstrap.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

test: venv
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -ra -m "not heavy" $(PYTEST_ARGS)

serve: venv
	$(VENV)/bin/trillium serve $(ARGS)

bench: venv
	$(VENV)/bin/trillium bench throughput $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
