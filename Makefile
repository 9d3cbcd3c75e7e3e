# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Both create or reuse .venv and install the pinned CPU set (torch 2.13.0 CPU build + triton 3.7.1).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swift_liger_installed
PIP := $(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints-cpu.txt
# The 30 slowest tests listed at the end of each leg: CI (both legs, 2 cores) must stay within 90 minutes.
PYTEST_ARGS ?= --durations=30

.PHONY: venv test test-fast test-newest test-gpu demo bench clean

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

# Second CI leg: the pinned set with a newer Triton installed over it (a venv whose only packages are that Triton and
# swift_liger, reading the rest from .venv), then the kernel tests (every kernel and launcher has its tests/ops file,
# the portability compiles included; the model, patching and CLI tests above them differ only in Triton's version
# here and run in the first leg, which keeps both legs within CI's 90 minutes on 2 cores). transformers, peft, trl and
# datasets are pinned at the newest versions ms-swift 4.6.0 accepts already; the package index here has no newer
# CPU torch than 2.13. Triton 3.9.0 is the newest Triton there (its interpreter refuses a block mask combined with
# a scalar i1 one, so no kernel here builds its masks that way).
TRITON_NEWEST ?= 3.9.0
VENV_NEWEST ?= .venv-newest
NEWEST_TESTS ?= tests/ops tests/test_import_layers.py
test-newest: $(STAMP)
	rm -rf $(VENV_NEWEST)
	$(PY) -m venv --without-pip $(VENV_NEWEST)
	$(PY) -c "import site; print(*site.getsitepackages(), sep='\n')" \
	  > "$$($(VENV_NEWEST)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_pinned.pth"
	$(PY) -m pip --python $(VENV_NEWEST)/bin/python install -q --disable-pip-version-check --no-deps \
	  triton==$(TRITON_NEWEST)
	$(PY) -m pip --python $(VENV_NEWEST)/bin/python install -q --disable-pip-version-check --no-deps -e .
	$(VENV_NEWEST)/bin/python -c "import triton, torch; print('test-newest: triton', triton.__version__, 'torch', torch.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest $(NEWEST_TESTS) $(PYTEST_ARGS)

# GPU: the same suite on CUDA with compiled kernels (run inside an environment that has CUDA torch + triton).
test-gpu:
	SWIFT_LIGER_TEST_GPU=1 python3 -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m swift_liger.demo

bench:
	python3 -m swift_liger.bench kernels

clean:
	rm -rf $(VENV) $(VENV_NEWEST) .pytest_cache build dist *.egg-info
