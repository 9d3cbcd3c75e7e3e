"""Every example parses (bash -n, Python compile): most need a GPU or minutes to run; `make demo` runs the tiny CPU
one. The GPU examples build their model offline unless MODEL names a hub model."""
import pathlib
import py_compile
import subprocess

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*.sh")), ids=lambda p: p.name)
def test_shell_examples_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    if "MODEL" in text and "--use_hf true" in text:   # a hub model only when the user names one
        assert "offline_model.sh" in text or "configs/" in text, script.name


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_python_examples_compile(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)
