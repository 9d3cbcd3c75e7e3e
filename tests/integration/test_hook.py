"""The import hook itself: installed by the .pth, idempotent, inert without swift, off switch, loud failures.

Fast: subprocesses without ms-swift, plus a fake `swift` package that mimics the dataclass layout the hook patches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from swift_liger.integration import hook

COUNT_FINDERS = "sum(bool(getattr(f, '_swift_liger_hook', False)) for f in sys.meta_path)"


def py(code: str, env_extra=None, pythonpath=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SWIFT_LIGER_DISABLE_HOOK", None)
    env.pop("PYTHONPATH", None)
    env.update(env_extra or {})
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def out_json(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pth_installs_one_inert_finder_without_heavy_imports():
    proc = py(f"""
        import sys, json, site, sysconfig
        n0 = {COUNT_FINDERS}
        sitedir = sysconfig.get_paths()["purelib"]
        for _ in range(2):  # site processes .pth files more than once in some venvs: must stay one finder
            site.addpackage(sitedir, "swift_liger_hook.pth", set())
        finder = next(f for f in sys.meta_path if getattr(f, "_swift_liger_hook", False))
        heavy = sorted(m for m in ("torch", "swift", "transformers", "triton", "yaml") if m in sys.modules)
        print(json.dumps({{"n0": n0, "n2": {COUNT_FINDERS}, "first": sys.meta_path[0] is finder, "heavy": heavy,
                          "json_spec": finder.find_spec("json") is None,
                          "pth": open(sitedir + "/swift_liger_hook.pth").read()}}))
    """)
    res = out_json(proc)
    assert res["n0"] == 1 and res["n2"] == 1, res
    assert res["first"], "the finder must sit before the path finders to see swift's modules first"
    assert res["heavy"] == [], f"interpreter start-up imported {res['heavy']} via the .pth"
    assert res["json_spec"], "finder must ignore modules it does not patch"
    assert "install()" in res["pth"]


def test_disable_env_var_and_install_idempotent():
    proc = py(f"""
        import sys, json
        n_start = {COUNT_FINDERS}
        import swift_liger.integration.hook as h
        ok = h.install()
        print(json.dumps({{"n_start": n_start, "install": ok, "n": {COUNT_FINDERS}}}))
    """, env_extra={"SWIFT_LIGER_DISABLE_HOOK": "1"})
    assert out_json(proc) == {"n_start": 0, "install": False, "n": 0}

    proc = py(f"""
        import sys, json
        import swift_liger.integration.hook as h
        a, b = h.install(), h.install()
        n = {COUNT_FINDERS}
        h.uninstall()
        print(json.dumps({{"ok": [a, b], "n": n, "after": {COUNT_FINDERS}}}))
    """)
    assert out_json(proc) == {"ok": [True, True], "n": 1, "after": 0}


# A fake `swift` with the layout the hook relies on: SftArguments is a dataclass with __post_init__ in
# swift.arguments.sft_args, a subclass is defined in another module that imports it.
FAKE_SWIFT = {
    "swift/__init__.py": "",
    "swift/version.py": "__version__ = '4.6.0'\n",
    "swift/arguments/__init__.py": "",
    "swift/arguments/sft_args.py": textwrap.dedent("""
        from dataclasses import dataclass, field
        from typing import Optional
        EVENTS = []

        @dataclass
        class SftArguments:
            model: Optional[str] = None
            use_liger_kernel: bool = False
            def _check_padding_free(self):
                pass
            def __post_init__(self):
                EVENTS.append(("post_init", self.use_liger))
    """),
    "swift/arguments/rlhf_args.py": textwrap.dedent("""
        from dataclasses import dataclass
        from .sft_args import SftArguments

        @dataclass
        class RLHFArguments(SftArguments):
            rlhf_type: str = "dpo"
            def __post_init__(self):
                SftArguments.__post_init__(self)
    """),
    "broken/swift/__init__.py": "",
    "broken/swift/version.py": "__version__ = '4.7.0'\n",
    "broken/swift/arguments/__init__.py": "",
    "broken/swift/arguments/sft_args.py": "class Renamed:\n    pass\n",
}


@pytest.fixture(scope="module")
def fake_swift(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_swift")
    for rel, text in FAKE_SWIFT.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_fields_injected_into_dataclass_and_subclass(fake_swift):
    proc = py("""
        import dataclasses, json
        from swift.arguments.rlhf_args import RLHFArguments
        from swift.arguments.sft_args import SftArguments, EVENTS
        sft_names = [f.name for f in dataclasses.fields(SftArguments)]
        rlhf_names = [f.name for f in dataclasses.fields(RLHFArguments)]
        a = SftArguments(model="m", use_liger=True, liger_rope=False, liger_cross_entropy="False")
        b = RLHFArguments(use_liger=True, liger_swiglu=False)
        from swift_liger.integration.arguments import resolved
        errors = []
        for kwargs in ({"use_liger": True, "use_liger_kernel": True}, {"liger_rope": False},
                       {"use_liger": True, "liger_rolling_cache": "12"}):
            try:
                SftArguments(**kwargs)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps({"sft": sft_names, "rlhf": rlhf_names, "events": EVENTS, "a": resolved(a)[0].to_dict(),
                          "b": resolved(b)[0].to_dict(), "b_notes": resolved(b)[1], "default": SftArguments().use_liger,
                          "errors": errors}))
    """, pythonpath=str(fake_swift))
    res = out_json(proc)
    from swift_liger.fusions import REGISTRY
    # the plugin's flags around one per fusion of the registry, in its order
    ours = ["use_liger", "liger_config", *(f.flag for f in REGISTRY), "liger_strict", "liger_metrics"]
    assert ours[2:5] == ["liger_rms_norm", "liger_rope", "liger_qk_norm_rope"]
    assert res["sft"] == ["model", "use_liger_kernel"] + ours
    assert res["rlhf"] == ["model", "use_liger_kernel"] + ours + ["rlhf_type"]
    assert res["events"][:2] == [["post_init", True], ["post_init", True]]  # fields set before __post_init__
    assert res["a"]["rope"] is False and res["a"]["cross_entropy"] == "off" and res["a"]["rms_norm"] is True
    # dpo: the trainer takes its log-probs from hidden states, so fused_linear stays
    assert res["b"]["swiglu"] is False and res["b"]["cross_entropy"] == "fused_linear"
    assert any("dpo trainer takes its log-probs from hidden states" in n for n in res["b_notes"]), res["b_notes"]
    assert res["default"] is False
    assert "pass only one" in res["errors"][0]
    assert "without --use_liger" in res["errors"][1]
    assert "window,sinks" in res["errors"][2]


def test_disabled_hook_leaves_swift_untouched(fake_swift):
    proc = py("""
        import dataclasses, json
        from swift.arguments.sft_args import SftArguments
        print(json.dumps([f.name for f in dataclasses.fields(SftArguments)]))
    """, env_extra={"SWIFT_LIGER_DISABLE_HOOK": "1"}, pythonpath=str(fake_swift))
    assert out_json(proc) == ["model", "use_liger_kernel"]


def test_unsupported_swift_fails_loudly(fake_swift):
    proc = py("import swift.arguments.sft_args", pythonpath=str(fake_swift / "broken"))
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "SftArguments" in proc.stderr
    assert "SWIFT_LIGER_DISABLE_HOOK=1" in proc.stderr
    assert "tested with ms-swift 4.6.x, found 4.7.0" in proc.stderr  # version warning comes first


def test_late_install_is_an_error_for_arguments(fake_swift):
    proc = py("""
        import swift_liger.integration.hook as h
        h.uninstall()
        import swift.arguments.sft_args
        h.install()
    """, pythonpath=str(fake_swift))
    assert proc.returncode != 0 and "before importing swift" in proc.stderr


def test_targets_are_the_documented_modules():
    assert set(hook.TARGETS) == {"swift.arguments.sft_args", "swift.model.utils", "swift.pipelines.train.tuner",
                                 "swift.pipelines.train.sft", "swift.pipelines.train.rlhf", "swift.pipelines.base",
                                 "swift.cli.utils", "swift.arguments.infer_args", "swift.pipelines.infer.infer",
                                 "swift.cli._megatron.main"}
    import importlib.util
    for name in hook.TARGETS:   # each is a module of the installed ms-swift
        assert importlib.util.find_spec(name) is not None, name


def test_reload_patches_the_new_class_again(fake_swift):
    proc = py("""
        import dataclasses, importlib, json
        import swift.arguments.sft_args as m
        old = m.SftArguments
        importlib.reload(m)
        names = [f.name for f in dataclasses.fields(m.SftArguments)]
        print(json.dumps([m.SftArguments is not old, "use_liger" in names]))
    """, pythonpath=str(fake_swift))
    assert out_json(proc) == [True, True]


def test_gloo_group_is_destroyed_at_exit_after_training(monkeypatch):
    """swift_patches' SwiftSft.train wrapper: after a --use_liger train returns on gloo, one atexit handler destroys
    the default group (before finalization, where a gloo rank can otherwise abort); without a group, nothing."""
    import atexit
    import socket

    import torch.distributed as dist

    from swift_liger.integration import swift_patches
    from swift_runner import teardown_abort_only

    handlers = []
    monkeypatch.setattr(atexit, "register", handlers.append)
    monkeypatch.setattr(swift_patches, "_gloo_exit_registered", False)
    swift_patches.destroy_gloo_group_at_exit()
    assert handlers == [] and not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        swift_patches.destroy_gloo_group_at_exit()
        swift_patches.destroy_gloo_group_at_exit()
        assert len(handlers) == 1
        handlers[0]()
        assert not dist.is_initialized()
        handlers[0]()  # already gone: a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # the runner's stock-run allowance: only an abort after main ended, with no traceback before it
    end = "[INFO:swift] End time of running main: 2026-12-01\n"
    abort = "terminate called without an active exception\n"
    assert teardown_abort_only("steps\n" + end + abort)
    assert not teardown_abort_only(abort + end)
    assert not teardown_abort_only("Traceback (most recent call last):\n" + end + abort)
    assert not teardown_abort_only("steps\n" + end)


def test_pth_is_quiet_where_the_package_is_gone(tmp_path):
    """An environment whose swift_liger was removed but whose .pth stayed (an editable install's source moved, a
    --target directory deleted): interpreter start-up prints nothing and installs nothing. With the package present
    the same line installs the finder (test_pth_installs_one_inert_finder_without_heavy_imports)."""
    from pathlib import Path
    pth = Path(hook.__file__).resolve().parents[2] / "swift_liger_hook.pth"
    (tmp_path / "swift_liger_hook.pth").write_text(pth.read_text())
    code = f"""
        import json, site, sys
        site.addpackage({str(tmp_path)!r}, "swift_liger_hook.pth", set())
        print(json.dumps({{"n": {COUNT_FINDERS}, "imported": "swift_liger" in sys.modules}}))
    """
    proc = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"n": 0, "imported": False}
