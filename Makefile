# Two commands do everything on a fresh machine: `make train` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup train test lint format bench clean slurm slurm-stop

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

train: setup
	$(PY) train.py $(ARGS)

# The slurm-marked tests need a local SLURM of two nodes: `make test` starts one (scripts/slurm/local_cluster.sh,
# root; Debian packages installed if missing) unless one is already up, and stops it afterwards.
# If it cannot start, the slurm tests skip and say why. The tests run on every core, a file per
# worker (its module fixtures are built once), in collection order (tests/conftest.py puts the
# long files first; xdist's own reorder, by test count, would leave them for last);
# PYTEST_ARGS= runs them in one process.
PYTEST_ARGS ?= -n auto --dist loadfile --no-loadscope-reorder
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	@up=0; bash scripts/slurm/local_cluster.sh status >/dev/null 2>&1 && up=1; \
	if [ $$up = 0 ]; then bash scripts/slurm/local_cluster.sh start \
	  || echo "make test: local SLURM did not start; the slurm tests will skip"; fi; \
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$up = 0 ]; then bash scripts/slurm/local_cluster.sh stop; fi; exit $$rc

# a two-node SLURM on this one host (SLURM_LOCAL_NODES=N for another count; idempotent), and its stop
slurm:
	bash scripts/slurm/local_cluster.sh start

slurm-stop:
	bash scripts/slurm/local_cluster.sh stop

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/bench_packing.py

clean:
	rm -rf $(VENV) .pytest_cache outputs multirun
