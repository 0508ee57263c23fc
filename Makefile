# Two commands work on a fresh clone; both set up .venv/ first (once).
#   make demo       the demo: local Temporal server + UI, 4 nodes + 1 spare, a node killed, recovery, its cost
#   make test       the test suite (CI runs this, after make lint)
#   make test-fast  unit and workflow tests only (about a minute and a half)
#   make lint       ruff: lint and format check
#   make typecheck  pyright (standard mode) on the controller and the trainer: 0 errors (CI runs it after make lint)
#   make postgres   a PostgreSQL server for a store shared by several workers (prints its LAZARUS_STORE)
#   make docs       the docs site into .site/ with mkdocs --strict (a broken link or an orphan page fails)
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-fast lint typecheck format docs docs-serve setup tls-proxy browser slurm-packages slurm slurm-down postgres-packages postgres postgres-down bench clean-state

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exactly: a looser pin lets pip pick a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP) tls-proxy browser slurm-packages postgres-packages

# haproxy terminates TLS in front of the test dev server (tests/e2e/test_tls.py). Checked on each
# `make setup` and `make test`, not only when .venv is made, so an existing .venv gets it too; it
# installs only as root with apt-get (apt-get update only when the package lists lack it), and never
# fails the set-up: without it the TLS tests skip, as this line says.
tls-proxy:
	@command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 \
	           && apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1; }; \
	  fi; \
	  test -x /usr/sbin/haproxy || command -v haproxy >/dev/null 2>&1 \
	    || echo "haproxy not installed (needs root and apt-get): the TLS tests will skip; install it with: apt-get install haproxy"; \
	}

# Debian's Chromium opens the web UI headless in tests/e2e/test_web_ui.py. Like haproxy: installed
# only as root with apt-get, never failing the set-up; without it that test skips, as this line says.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 \
	           && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; \
	  fi; \
	  command -v chromium >/dev/null 2>&1 \
	    || echo "chromium not installed (needs root and apt-get): the web UI check will skip; install it with: apt-get install chromium"; \
	}

# Debian's Slurm and munge run a real Slurm cluster on this machine (lazarus.infra.harness.slurm_daemons; the
# tests in tests/slurm start their own). Like haproxy: installed only as root with apt-get, never
# failing the set-up; without them the Slurm tests skip, as this line says.
slurm-packages:
	@command -v slurmctld >/dev/null 2>&1 || test -x /usr/sbin/slurmctld || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 \
	           && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1; }; \
	  fi; \
	  test -x /usr/sbin/slurmctld \
	    || echo "Slurm not installed (needs root and apt-get): the Slurm tests will skip; install it with: apt-get install slurmctld slurmd slurm-client munge"; \
	}

# A Slurm cluster of 5 nodes (node-0..node-4) in .lazarus/slurm, on free ports; `make slurm-down` stops it.
slurm: $(STAMP) slurm-packages
	$(PY) -m lazarus.infra.harness.slurm_daemons up --folder .lazarus/slurm --nodes 5

slurm-down: $(STAMP)
	$(PY) -m lazarus.infra.harness.slurm_daemons down --folder .lazarus/slurm

# Debian's PostgreSQL serves the store that workers on several machines share (lazarus.infra.harness.postgres;
# the tests start their own). Like haproxy: installed only as root with apt-get, never failing the set-up;
# without it the PostgreSQL tests skip, as this line says.
postgres-packages:
	@test -x "$$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | tail -1)" || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 \
	           && apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1; }; \
	  fi; \
	  test -x "$$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | tail -1)" \
	    || echo "PostgreSQL not installed (needs root and apt-get): the PostgreSQL tests will skip; install it with: apt-get install postgresql"; \
	}

# A PostgreSQL server in .lazarus/postgres on a free port of 127.0.0.1; it prints the LAZARUS_STORE to export.
# `make postgres-down` stops it and deletes its data.
postgres: $(STAMP) postgres-packages
	$(PY) -m lazarus.infra.harness.postgres up --folder .lazarus/postgres

postgres-down: $(STAMP)
	$(PY) -m lazarus.infra.harness.postgres down --folder .lazarus/postgres

demo: $(STAMP)
	.venv/bin/lazarus demo $(ARGS)

# Two pytest processes (pytest-xdist), each with a file at a time: the suite waits on timers,
# servers and processes for about a third of its run, which the other process fills. A file stays
# in one process, so a module's shared fixture (the chaos bed, the TLS frontend) starts once.
# `make test ARGS="-n 0"` runs it in one process. A process that a test's timeout ends (pyproject.toml:
# timeout_method) is not replaced: the run ends with that test named, where a replaced process once
# left the run waiting for good.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0

test: $(STAMP) tls-proxy browser slurm-packages postgres-packages
	$(PYTEST) $(ARGS)

test-fast: $(STAMP)
	$(PYTEST) tests/unit tests/workflow $(ARGS)

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: $(STAMP)
	.venv/bin/pyright --project .

format: $(STAMP)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# NO_MKDOCS_2_WARNING: the Material theme's banner about MkDocs 2.0 is news, not a warning of the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8000

bench: $(STAMP)
	$(PY) bench/recovery.py $(ARGS)

clean-state:
	-.venv/bin/lazarus server --stop
	rm -rf .lazarus
