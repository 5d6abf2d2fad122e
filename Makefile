# Two commands on a fresh machine: `make study` and `make test`.
# Both create .venv and install the project (and everything it needs) into it first.
PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed
PROFILE  ?= quick
SCHEDULER ?=

.PHONY: install lock study smoke test lint lab report bench strip clean

# torch first, by its exact version from pyproject.toml and without its dependencies: the hashed
# locks leave it out (where pip finds a CPU wheel, as on the supported machine, that is what
# a CPU machine gets; PyPI's wheel of that version pulls the CUDA libraries), and they carry
# its dependencies. Then everything else at the exact versions and hashes of the locks
# (requirements.lock: the study's runtime; requirements-dev.lock: what the tests and tools
# add), then the project itself with its [study,dev] extras. pyproject.toml keeps the ranges
# for people who `pip install stabstudy` as a library; `make lock` recompiles the locks.
TORCH := $(shell sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml requirements.lock requirements-dev.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --no-deps 'torch==$(TORCH)'
	$(BIN)/python -m pip install --require-hashes -r requirements.lock -r requirements-dev.lock
	$(BIN)/python -m pip install --no-deps -e '.[study,dev]'
	touch $(STAMP)

install: $(STAMP)

## make lock: recompile the hashed locks and environment.yml from pyproject.toml (tools/deps.py)
lock: $(STAMP)
	$(BIN)/python tools/deps.py lock
	$(BIN)/python tools/deps.py environment

## make study: the whole study, default quick profile, embedded local Dask cluster
study: $(STAMP)
	$(BIN)/stabstudy study --profile $(PROFILE) $(if $(SCHEDULER),--scheduler $(SCHEDULER))

## make smoke: the whole study with tiny sizes (what CI runs, a few minutes)
smoke: $(STAMP)
	$(BIN)/stabstudy study --profile smoke

## make test: lint + unit tests + every notebook under the smoke profile
test: $(STAMP)
	$(BIN)/ruff check stabstudy tests benchmarks tools
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check stabstudy tests benchmarks tools

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks

## make report: publish results/<profile>/ (CLAIMS.md, rendered notebooks, figures) from the executed study
report: $(STAMP)
	$(BIN)/stabstudy report --profile $(PROFILE)

## make bench: every benchmark, side-by-side ratios
bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; OMP_NUM_THREADS=1 $(BIN)/python $$b || exit 1; done

## make strip: remove outputs from stored notebooks
strip: $(STAMP)
	$(BIN)/nbstripout notebooks/*.ipynb

## make clean: every generated file (stored runs, the built corpus, caches, executed notebooks, figures)
clean:
	find data figures -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
	rm -rf build
