"""The package as users get it: the wheel and the sdist built from this tree, the wheel installed into a fresh venv,
and the real `swift sft --use_liger` / `swift rlhf --rlhf_type dpo --use_liger` run from there.

The fresh venv gets only the wheel (`pip install --no-deps`); its dependencies (torch, ms-swift, ...) come from this
test's own environment through one path entry, not an install, so the check stays offline and takes a minute, not
the five a second dependency install would. Nothing of the checkout is on the path there: the run uses the wheel's
swift_liger, its `.pth` hook and its shared-data presets.
"""
from __future__ import annotations

import glob
import json
import os
import site
import subprocess
import sys
import tarfile
import zipfile

import pytest
from swift_runner import CPU_FLAGS, swift_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def _run(cmd, cwd, env=None, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """Wheel and sdist of this tree (python -m build), and a wheel rebuilt from the sdist."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), REPO], cwd=str(out))
    wheel, = glob.glob(str(out / "*.whl"))
    sdist, = glob.glob(str(out / "*.tar.gz"))
    again = tmp_path_factory.mktemp("from_sdist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(again), sdist]
         if _have_hatchling() else
         [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(again), sdist], cwd=str(again))
    rebuilt, = glob.glob(str(again / "*.whl"))
    return {"wheel": wheel, "sdist": sdist, "rebuilt": rebuilt}


def _have_hatchling() -> bool:
    import importlib.util
    return importlib.util.find_spec("hatchling") is not None


def _tracked_package_files() -> set:
    out = subprocess.run(["git", "ls-files", "swift_liger"], cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
    return {p for p in out.stdout.split() if p.endswith(".py")}


def test_wheel_holds_the_package_hook_and_presets(dist):
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    tracked = _tracked_package_files()
    if tracked:   # a git checkout: every module of the package, nothing missing after a move
        missing = sorted(tracked - names)
        assert not missing, f"modules missing from the wheel: {missing}"
    assert "swift_liger_hook.pth" in names
    data = [n for n in names if "/data/share/swift-liger/configs/liger/" in n]
    assert any(n.endswith("/default.yaml") for n in data), sorted(data)
    assert "swift-liger = swift_liger.cli:main" in entry_points
    assert "Provides-Extra: swift" in metadata and "msgspec" in metadata
    assert not any(n.startswith(("tests/", "tools/")) for n in names)


def test_sdist_builds_the_same_wheel(dist):
    with tarfile.open(dist["sdist"]) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    for needed in ("pyproject.toml", "README.md", "swift_liger_hook.pth", "swift_liger/__init__.py",
                   "configs/liger/default.yaml"):
        assert needed in members, needed
    with zipfile.ZipFile(dist["wheel"]) as a, zipfile.ZipFile(dist["rebuilt"]) as b:
        files = lambda z: {n for n in z.namelist() if ".dist-info/" not in n}   # noqa: E731
        assert files(a) == files(b)


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh venv with the wheel installed (no dependencies) and this environment's site-packages as a path entry
    (their .pth files, the editable checkout's included, are not read from there)."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=str(root))
    python = str(root / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", dist["wheel"]],
         cwd=str(root))
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=str(root)).strip()
    with open(os.path.join(purelib, "zz_test_dependencies.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return {"root": str(root), "python": python, "purelib": purelib}


def _env(venv) -> dict:
    env = swift_env()
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.path.join(venv["root"], "bin") + os.pathsep + env.get("PATH", "")
    return env


def test_installed_wheel_is_what_runs(venv, tmp_path):
    out = _run([venv["python"], "-c", "import json, swift_liger, swift_liger.integration.hook as h, "
                "swift_liger.integration.arguments as a; print(json.dumps({'file': swift_liger.__file__, "
                "'hook': h.installed(), 'preset': a.find_preset('default')}))"], cwd=str(tmp_path), env=_env(venv))
    info = json.loads(out.strip().splitlines()[-1])
    assert info["file"].startswith(venv["purelib"]), info
    assert info["hook"] is True, info
    assert info["preset"].startswith(venv["root"]), info   # the wheel's shared-data presets, not the checkout's


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_swift_runs_from_the_wheel(venv, tiny_qwen3, tmp_path, kind):
    if kind == "sft":
        argv = ["sft", *tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"]]
    else:
        argv = ["rlhf", "--rlhf_type", "dpo", *tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["pref"]]
    output_dir = str(tmp_path / kind)
    cmd = [venv["python"], "-m", "swift.cli.main", *argv, "--tuner_type", "lora", "--max_steps", "2",
           "--max_length", "64", "--per_device_train_batch_size", "1", "--save_strategy", "no", "--report_to", "none",
           *CPU_FLAGS,
           "--use_liger", "--output_dir", output_dir]
    log = _run(cmd, cwd=str(tmp_path), env=_env(venv), timeout=900)
    assert "swift_liger: patched" in log, log[-3000:]
    record_path, = glob.glob(os.path.join(output_dir, "v*-*", "liger_patch.json"))
    with open(record_path) as f:
        record = json.load(f)
    assert record["models"]["policy"]["report"]["patched"]["cross_entropy"] == 1
    counted = "fused_linear_cross_entropy" if kind == "sft" else "fused_linear_logprobs"
    assert record["runtime"]["total"]["policy"][counted] > 0, record["runtime"]   # our head ran, from the wheel
