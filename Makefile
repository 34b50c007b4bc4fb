# Every target bootstraps .venv first, so a fresh clone needs nothing installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-cpu.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: venv prometheus test test-fast serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt scripts/bootstrap.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

# WHY: tests/observability checks ops/grafana/trillium.json against a real Prometheus.
# Install Debian's package when the binary is missing and we can (root, apt-get);
# otherwise do nothing here and those tests skip, saying why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || exit 0; \
	  echo "installing Debian's prometheus package (for tests/observability)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null \
	    || echo "warning: could not install prometheus; tests/observability will skip"; }

# WHY two pytest workers (pytest-xdist): one run alone keeps ~1.1 of 2 cores busy (one-thread tests,
# servers waiting on their actors); two halve the wall time. --dist loadfile keeps a file on one worker,
# so a module's fixtures (a server, the SmolLM2 reference model) are built once. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST_RUN = $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

test: venv prometheus
	$(PYTEST_RUN) $(PYTEST_ARGS)

test-fast: venv prometheus
	$(PYTEST_RUN) -m "not heavy" $(PYTEST_ARGS)

serve: venv
	$(VENV)/bin/trillium serve $(ARGS)

bench: venv
	$(VENV)/bin/trillium bench throughput $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
