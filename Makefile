# Two commands work on a fresh clone; both set up .venv/ first (once).
#   make demo    the demo: local Temporal server + UI, 4 nodes + 1 spare, a node killed, recovery, its cost
#   make test    the test suite (CI runs this)
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test setup bench clean-state

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

bench: $(STAMP)
	$(PY) bench/recovery.py $(ARGS)

clean-state:
	-.venv/bin/lazarus server --stop
	rm -rf .lazarus
