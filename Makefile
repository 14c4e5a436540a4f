# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the suite waits on child processes and timeouts as much as it computes: two workers halve it on two cores
TEST_WORKERS ?= 2

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/workbench layout sample_meshes/toy_expert_tp.toml
	$(VENV)/bin/workbench plan sample_meshes/toy_expert_tp.toml --rank 5 --budget 200B
	$(VENV)/bin/workbench plan sample_meshes/toy_expert_tp.toml --rank 5 --budget 200B --write-mode gather --param '*fused_w1w3'
	$(VENV)/bin/workbench simulate sample_meshes/toy_expert_tp.toml --budget 200B
	$(VENV)/bin/workbench demo

test: $(STAMP)
	$(VENV)/bin/ruff check workbench tests bench notebooks
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(STAMP)
	$(PY) bench/plan_layouts.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
