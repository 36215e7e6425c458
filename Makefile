# The two commands of the README:
#   make demo   set everything up in .venv and run the main job on bundled data
#   make test   set everything up in .venv and run the test suite (what .ci/run calls)
#
# torch is pinned to 2.13.0 in this install path only (a CPU build that installs from local disk on the
# development machines); the package itself accepts any torch >= 2.1, so bring your own CUDA build elsewhere.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_PIN)" -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/shrinkgrad reproduce ef21w-libsvm --quick --out runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/compressors.py
	$(BIN)/python benchmarks/problems.py
	$(BIN)/python benchmarks/simulator.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
