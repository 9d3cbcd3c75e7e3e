# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Both create or reuse .venv and install the pinned CPU set (torch 2.13.0 CPU build + triton 3.7.1).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swift_liger_installed
PIP := $(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints-cpu.txt
PYTEST_ARGS ?=

.PHONY: venv test test-fast test-gpu demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/constraints-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing pinned dependencies into $(VENV) (first run: a few minutes)"
	$(PIP) -r requirements/cpu.txt
	$(PIP) --no-deps -e .
	@touch $(STAMP)

# CPU: real Triton kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# GPU: the same suite on CUDA with compiled kernels (run inside an environment that has CUDA torch + triton).
test-gpu:
	SWIFT_LIGER_TEST_GPU=1 python3 -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m swift_liger.demo

bench:
	python3 -m swift_liger.bench kernels

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
