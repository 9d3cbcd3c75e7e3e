"""The tested dependency ranges: declared once in swift_liger/versions.py, the same in pyproject.toml, and refused
with a clear error outside them (or warned once under SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS=1)."""
import os
import re
import subprocess
import sys
import warnings

import pytest

from swift_liger import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fmt(v):
    return ".".join(map(str, v))


def test_pyproject_declares_the_same_ranges():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    for name, (low, high) in versions.SUPPORTED.items():
        assert re.search(rf'"{re.escape(name)}>={_fmt(low)},<{_fmt(high)}[";]', text), name


def test_the_installed_set_is_inside_the_ranges():
    for name in versions.SUPPORTED:
        assert versions.problem(name, versions.installed(name)) is None, name


@pytest.mark.parametrize("version, ok", [
    ("2.11.0+cu130", True), ("2.13.0+cpu", True), ("2.13.9", True), ("2.10.0", False), ("2.14.0", False),
    ("2.14.0.dev20261201", False), ("2.15.0", False), ("3.1", False), ("2", False),
])
def test_torch_range(version, ok):
    assert (versions.problem("torch", version) is None) == ok


@pytest.mark.parametrize("version, ok", [("3.6.0", True), ("3.9.0", True), ("3.9.0rc1", True), ("3.5.1", False),
                                         ("3.10.0", False), ("4.0.0", False)])
def test_triton_range(version, ok):
    assert (versions.problem("triton", version) is None) == ok


def test_outside_the_range_names_package_version_and_range(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda name: {"triton": "3.10.1"}.get(name, "5.18.0"))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ImportError, match=r"triton >=3\.6,<3\.10; 3\.10\.1 is installed.*"
                                          "SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS=1"):
        versions.require("transformers", "triton")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    monkeypatch.setattr(versions, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        versions.require("triton")
        versions.require("triton")
    assert len(seen) == 1 and "3.10.1" in str(seen[0].message)
    monkeypatch.setenv(versions.ALLOW_ENV, "yes")
    with pytest.raises(ValueError, match="SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS must be 0 or 1"):
        versions.require("triton")


def test_missing_packages_are_left_to_their_importers(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda name: None)
    versions.require(*versions.SUPPORTED)


def test_importing_the_kernels_checks_torch_and_triton():
    """A fresh interpreter where the installed triton reads 3.5.0: importing swift_liger.ops refuses it before any
    kernel module loads, and the override lets it through."""
    code = ("import importlib.metadata as m, sys; real = m.version\n"
            "m.version = lambda n: '3.5.0' if n == 'triton' else real(n)\n"
            "try:\n    import swift_liger.ops\nexcept ImportError as e:\n"
            "    print('refused', 'swift_liger.ops.rms_norm_kernel' in sys.modules, e)\nelse:\n    print('loaded')\n")
    env = dict(os.environ, SWIFT_LIGER_DISABLE_HOOK="1")
    env.pop(versions.ALLOW_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused False swift_liger is tested with triton >=3.6,<3.10; 3.5.0 is installed"), out
    env[versions.ALLOW_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "loaded", out
