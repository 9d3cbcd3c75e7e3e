"""Fixtures for the ms-swift integration tests: the tiny offline models; swift_runner.py runs the real `swift` CLI.

The CLI runs in subprocesses with the environment tests/conftest.py set up (TRITON_INTERPRET=1 and
SWIFT_LIGER_BACKEND=triton on CPU, so patched runs execute the real Triton kernels in the interpreter; HF offline).
They rely on the installed swift_liger_hook.pth (`make venv` / `pip install -e .`), exactly like a user's run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from swift_runner import hook_installed, swift_env

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


# ms-swift's teacher client refuses to post without vllm installed (it only needs HTTP): API cases lift that check
CLIENT_PLUGIN = """import swift.rlhf_trainers.vllm_client as client
client.is_vllm_available = lambda: True
"""


@pytest.fixture(scope="module")
def teacher_server(tiny_llama, tmp_path_factory):
    """The tiny llama teacher behind teacher_server.py on a free port, one per test module, encoding with the tiny
    qwen3 student's template (as a served teacher of the student's family would): (url, client plugin path, count
    file: one line per POST with the requests it scored)."""
    root = tmp_path_factory.mktemp("teacher_server")
    port_file = str(root / "port")
    env = swift_env()
    env.pop("TRITON_INTERPRET", None)
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "teacher_server.py"),
                                 tiny_llama["model"], "llama", "qwen3", port_file], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if os.path.exists(port_file) or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert os.path.exists(port_file), (root / "server.log").read_text()[-2000:]
        (root / "plugin.py").write_text(CLIENT_PLUGIN)
        with open(port_file) as f:
            yield f"http://127.0.0.1:{f.read()}", str(root / "plugin.py"), port_file + ".count"
    finally:
        proc.terminate()
        proc.wait(30)
