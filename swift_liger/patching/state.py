"""The bookkeeping a patch leaves on one model instance, and the helpers every fusion patches through.

Only instance attributes change: a patched module gets its own bound ``forward`` (or accelerate's
``_old_forward``), the causal LM its ``_loss_function``, and the root module one PatchState under STATE_ATTR.
Classes, modeling-module globals, parameters and buffers are untouched, so ``state_dict`` is identical and
``revert`` restores the exact eager model. Two opt-in exceptions: fused_projections (inference) moves the q/k/v and
gate/up weights into one buffer per group, each parameter a row block of it (same values and state_dict; revert
gives each its own storage again); fp8_base (LoRA training) replaces each plain LoRA base weight by an FP8
Fp8Weight parameter whose reads outside its matmuls give the exact 16-bit values (revert puts the original
Parameter objects back, on the device).
"""
from __future__ import annotations

import copy
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

STATE_ATTR = "_swift_liger_state"   # the PatchState on a patched root module
CALLS_ATTR = "_swift_liger_calls"   # on a patched MLP / attention: the LoRA call counters it shares (patching/lora.py)


class PatchState:
    """Everything `revert` needs. A plain object (not a Module, Parameter or buffer): invisible to state_dict."""

    def __init__(self, config, report):
        self.config = config
        self.report = report
        self.saved: List[Tuple[Any, str, bool, Any]] = []   # (object, attribute, existed before, previous value)
        self.rebuilds: List[Tuple[Callable, tuple]] = []     # re-run for the copies on deepcopy
        self.undo: List[Tuple[Callable, tuple]] = []         # run first on restore (e.g. uninstall the cache)
        self.parts: Dict[str, Any] = {}   # fusion key -> its run-time state (its spec's counters hook reads it)
        self.checkpoint_funcs = None   # patching.checkpoint_funcs: [(decoder layer, its checkpoint function)]

    def set(self, obj: Any, name: str, value: Any) -> None:
        d = obj.__dict__
        self.saved.append((obj, name, name in d, d.get(name)))
        d[name] = value  # straight into __dict__: no nn.Module registration, no hooks

    def on_deepcopy(self, fn: Callable, *args) -> None:
        """After copy.deepcopy(model), call fn(*copied args): for per-instance closures and compiled entries that
        would otherwise still point at the original's modules."""
        self.rebuilds.append((fn, args))

    def on_restore(self, fn: Callable, *args) -> None:
        """On revert, call fn(*args) first (args are mapped to the copies in a deep copy)."""
        self.undo.append((fn, args))

    def restore(self) -> None:
        for fn, args in reversed(self.undo):
            fn(*args)
        self.undo.clear()
        for obj, name, existed, previous in reversed(self.saved):
            if existed:
                obj.__dict__[name] = previous
            else:
                obj.__dict__.pop(name, None)
        self.saved.clear()
        self.rebuilds.clear()

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) rebinds bound methods to the copies, but function objects are shared. Modules are
        # copied before this object (it sits after `_modules` in the root's __dict__), so memo maps them.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)   # functions are copied by reference
        for fn, args in new.rebuilds:
            fn(*args)
        return new


def find_states(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, PatchState]]:
    return [(m, m.__dict__[STATE_ATTR]) for m in model.modules() if STATE_ATTR in m.__dict__]


def get_report(model: torch.nn.Module):
    """The report of the patch currently applied to `model` (or a module inside it), else None."""
    states = find_states(model)
    return states[0][1].report if states else None


def is_patched(model: torch.nn.Module) -> bool:
    return bool(find_states(model))


# ---------------------------------------------------------------------------------------------------------------
# Helpers for the fusions' patches
# ---------------------------------------------------------------------------------------------------------------

def class_in(module: torch.nn.Module, names: Tuple[str, ...]) -> bool:
    return type(module).__name__ in names


def load_op(name: str) -> Tuple[Optional[Callable], Optional[str]]:
    """The public op swift_liger.ops.<name>; (None, reason) when it cannot be imported, so a missing or broken
    kernel skips its fusion, not the whole apply."""
    try:
        from .. import ops   # lazy: a kernel that fails to import skips its fusion, not the whole apply
        return getattr(ops, name), None
    except Exception as exc:   # noqa: BLE001
        return None, f"kernel swift_liger.ops.{name} unavailable ({type(exc).__name__}: {exc})"


def forward_attr(module: torch.nn.Module) -> str:
    # accelerate hooks (device_map loading) keep the real forward in `_old_forward` and call it from `forward`
    return "_old_forward" if "_old_forward" in module.__dict__ else "forward"


def foreign_forward(module: torch.nn.Module) -> Optional[str]:
    """Reason not to patch when the instance already carries a forward that is not just its class's."""
    attr = forward_attr(module)
    current = module.__dict__.get(attr)
    if current is None:
        return None
    if (isinstance(current, types.MethodType) and current.__self__ is module
            and current.__func__ is type(module).forward):
        return None
    return f"{type(module).__name__} already has an instance-level {attr} (patched by another tool)"


def set_forward(st: PatchState, module: torch.nn.Module, fn: Callable) -> None:
    st.set(module, forward_attr(module), types.MethodType(fn, module))


def count(module: torch.nn.Module, key: str) -> None:
    """Add one to the `key` counter of the patch state whose patch installed `module`'s forward."""
    calls = module.__dict__.get(CALLS_ATTR)
    if calls is not None:
        calls[key] += 1
