# Two commands do everything on a fresh machine: `make train` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup train test lint format bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/bench_packing.py

clean:
	rm -rf $(VENV) .pytest_cache outputs multirun
