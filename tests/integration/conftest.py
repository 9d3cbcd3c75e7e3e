"""Fixtures for the ms-swift integration tests: the tiny offline models; swift_runner.py runs the real `swift` CLI.

The CLI runs in subprocesses with the environment tests/conftest.py set up (TRITON_INTERPRET=1 and
SWIFT_LIGER_BACKEND=triton on CPU, so patched runs execute the real Triton kernels in the interpreter; HF offline).
They rely on the installed swift_liger_hook.pth (`make venv` / `pip install -e .`), exactly like a user's run.
"""
from __future__ import annotations

import pytest
from swift_runner import hook_installed

from swift_liger.testing import tiny


@pytest.fixture(scope="session", autouse=True)
def _require_installed_hook():
    if not hook_installed():
        pytest.fail("swift_liger is not pip-installed in this environment, so swift_liger_hook.pth is missing: "
                    "run `make venv` (or pip install -e .) first", pytrace=False)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return tiny.build(str(tmp_path_factory.mktemp("tiny") / "qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return tiny.build(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama")
