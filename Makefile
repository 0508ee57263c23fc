# Two commands work on a fresh clone; both set up .venv/ first (once).
#   make demo       the demo: local Temporal server + UI, 4 nodes + 1 spare, a node killed, recovery, its cost
#   make test       the test suite (CI runs this, after make lint)
#   make test-fast  unit and workflow tests only (under a minute)
#   make lint       ruff: lint and format check
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-fast lint format setup bench clean-state

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exactly: a looser pin lets pip pick a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	.venv/bin/lazarus demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/workflow $(ARGS)

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: $(STAMP)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench: $(STAMP)
	$(PY) bench/recovery.py $(ARGS)

clean-state:
	-.venv/bin/lazarus server --stop
	rm -rf .lazarus
