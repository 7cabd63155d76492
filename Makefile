# `make train` and `make test` work on a fresh machine with Python >= 3.10 and pip.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Installed only when no torch is importable; pick the build for your machine by
# installing torch yourself first.
TORCH_SPEC ?= torch==2.13.0
# Extra flags for train.py, e.g. `make train ARGS="--preset tiny --steps 50"`.
ARGS ?=

.PHONY: install install-test train test

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e .

install-test:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[test]"

# matplotlib draws the run's loss curve (train.py trains without it, announcing that it
# skips the plot).
train: install
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PIP) install matplotlib
	$(PYTHON) train.py $(ARGS)

test: install-test
	$(PYTHON) -m pytest -n 2 -q -p no:cacheprovider
