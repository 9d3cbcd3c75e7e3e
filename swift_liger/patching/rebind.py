"""RoPE without copying transformers code: a copy of a module's forward that resolves some globals elsewhere.

The attention forward calls the module-global ``apply_rotary_pos_emb``. The patched attention instance runs a *new
function object* made from the original forward's code object, with its own globals dict (a copy of the modeling
module's namespace in which that one name points at our kernel). The modeling module itself is never modified;
decorators around forward are rebuilt around the new function.
"""
from __future__ import annotations

import copy
import types
from typing import Any, Callable, Dict, Optional, Tuple


def _cell_contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _copy_function(fn: types.FunctionType, new_globals: dict, closure) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    new.__dict__.update(fn.__dict__)
    return new


def rebuild_with_globals(fn: Callable, overrides: Dict[str, Any],
                         required: Tuple[str, ...]) -> Tuple[Optional[Callable], Optional[str]]:
    """A copy of `fn` whose innermost function resolves `overrides` from its own globals dict.

    Decorator layers (functools.wraps wrappers holding the next function in a closure cell) are rebuilt around
    the new inner function, so they keep working. Returns (None, reason) when the structure is not as expected.
    """
    if not isinstance(fn, types.FunctionType):
        return None, f"forward is a {type(fn).__name__}, not a Python function"
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        missing = [name for name in required if name not in fn.__code__.co_names]
        if missing:
            return None, f"{fn.__qualname__} does not reference {', '.join(missing)}"
        new_globals = dict(fn.__globals__)  # snapshot of the modeling module's namespace; the module is untouched
        new_globals.update(overrides)
        # without __name__, torch.compile guards on this dict itself rather than on the module of that name
        # (whose globals still hold the HF functions)
        new_globals.pop("__name__", None)
        return _copy_function(fn, new_globals, fn.__closure__), None
    new_inner, reason = rebuild_with_globals(inner, overrides, required)
    if new_inner is None:
        return None, reason
    cells = fn.__closure__ or ()
    hits = [i for i, cell in enumerate(cells) if _cell_contents(cell) is inner]
    if len(hits) != 1:
        return None, f"cannot see through the decorator around {fn.__qualname__}"
    closure = tuple(types.CellType(new_inner) if i == hits[0] else cell for i, cell in enumerate(cells))
    new = _copy_function(fn, fn.__globals__, closure)
    new.__wrapped__ = new_inner
    return new, None


def innermost(fn: Callable) -> Callable:
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn
