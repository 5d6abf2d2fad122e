# Two commands on a fresh machine: `make study` and `make test`.
# Both create .venv and install the project (and everything it needs) into it first.
PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed
PROFILE  ?= quick
SCHEDULER ?=

.PHONY: install study smoke test lint lab report bench strip clean

# Exact versions from requirements.lock (the supported machine); pyproject.toml keeps the
# loose ranges for people who install stabstudy as a library.
$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.lock
	$(BIN)/python -m pip install --no-deps -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## make study: the whole study, default quick profile, embedded local Dask cluster
study: $(STAMP)
	$(BIN)/stabstudy study --profile $(PROFILE) $(if $(SCHEDULER),--scheduler $(SCHEDULER))

## make smoke: the whole study with tiny sizes (what CI runs, a few minutes)
smoke: $(STAMP)
	$(BIN)/stabstudy study --profile smoke

## make test: lint + unit tests + every notebook under the smoke profile
test: $(STAMP)
	$(BIN)/ruff check stabstudy tests benchmarks
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check stabstudy tests benchmarks

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
