# The README's two commands: `make demo` and `make test`. Each creates .venv if it is missing.
# `make docs` builds the documentation site strictly (every warning an error) into site/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch/torchvision pinned to the wheels on this kind of machine's disk (no multi-GB download).
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/domain_shift.py --quick

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --durations=15

docs: $(STAMP)
	$(PY) -c "import mkdocs, material, mkdocstrings" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/accounting.py
	$(PY) benchmarks/dpsgd_step.py
	$(PY) benchmarks/p3sgd_round.py

clean:
	rm -rf $(VENV) lightning_logs data/synthetic_pathology site
