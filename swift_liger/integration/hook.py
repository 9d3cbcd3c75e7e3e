"""Import hook that wires swift_liger into ms-swift with no step from the user.

`swift_liger_hook.pth` (installed next to the package) calls `install()` at interpreter start. `install()` puts one
small finder at the front of `sys.meta_path`; it ignores every import except the few ms-swift modules in `TARGETS`,
whose loader it wraps so that our patch runs right after the module body (before anything else can use or subclass
what the module defines). Cost when swift is never imported: one dict lookup per import.

Kept free of heavy imports on purpose: this file runs in every Python process of the environment.
Off switch: SWIFT_LIGER_DISABLE_HOOK=1.
"""
import os
import sys

# module name -> function name in swift_liger.integration.swift_patches
TARGETS = {
    "swift.arguments.sft_args": "patch_sft_args",
    "swift.model.utils": "patch_model_utils",
    "swift.pipelines.base": "patch_pipeline_base",
    "swift.cli.utils": "patch_cli_utils",
    "swift.pipelines.train.tuner": "patch_tuner",
    "swift.pipelines.train.sft": "patch_sft_pipeline",
    "swift.pipelines.train.rlhf": "patch_rlhf_pipeline",
    "swift.arguments.infer_args": "patch_infer_args",
    "swift.pipelines.infer.infer": "patch_infer_pipeline",
    "swift.cli._megatron.main": "patch_megatron_cli",
}
# argument modules whose dataclasses get subclassed in other modules: they cannot be patched after the fact
ARGUMENT_MODULES = ("swift.arguments.sft_args", "swift.arguments.infer_args")
_MARK = "_swift_liger_patched"


def disabled() -> bool:
    return os.environ.get("SWIFT_LIGER_DISABLE_HOOK", "").strip().lower() in ("1", "true", "yes", "on")


def _run_patch(name, module):
    if getattr(module, _MARK, False):  # install() after the import already patched it: once per module body
        return
    from . import swift_patches   # lazy: only once ms-swift imports a TARGETS module; this file runs at every start
    getattr(swift_patches, TARGETS[name])(module)
    setattr(module, _MARK, True)


class _PatchingLoader:
    """Delegates to the real loader; runs our patch after the module body has executed."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        module.__dict__.pop(_MARK, None)  # importlib.reload re-runs the body: new classes need patching again
        self._loader.exec_module(module)
        _run_patch(self._name, module)

    def __getattr__(self, attr):  # get_source, get_resource_reader, path, ... (inspect, importlib.resources)
        return getattr(self._loader, attr)


class SwiftLigerFinder:
    """Meta-path finder that only answers for TARGETS; finds the real spec with the other finders."""

    _swift_liger_hook = True  # marker used for idempotence (the .pth may run twice per process)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_swift_liger_hook", False):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def installed() -> bool:
    return any(getattr(f, "_swift_liger_hook", False) for f in sys.meta_path)


def install() -> bool:
    """Install the finder once. Returns True when the hook is active after the call.

    When some target module is already imported (the hook was installed late, e.g. by hand on a machine where the
    .pth is not processed), the cheap patches are applied now; `sft_args` and `infer_args` cannot be patched late
    (their subclasses already exist), which is an error naming the fix.
    """
    if disabled():
        return False
    if not installed():
        sys.meta_path.insert(0, SwiftLigerFinder())
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and not getattr(module, _MARK, False):
            if name in ARGUMENT_MODULES:
                raise RuntimeError(
                    "swift_liger: ms-swift's arguments were imported before the swift_liger hook was installed; "
                    "call swift_liger.integration.hook.install() before importing swift (the installed "
                    "swift_liger_hook.pth does this at interpreter start unless Python runs with -S or the package "
                    "was installed with --target/PYTHONPATH)")
            _run_patch(name, module)
    return True


def uninstall() -> None:
    """Remove the finder (patches already applied to loaded modules stay)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_swift_liger_hook", False)]
