"""Installing a RollingKVCache on a model: ``install_rolling_cache`` wraps this instance's ``generate`` so every call
that brings no cache of its own runs on a fresh RollingKVCache; ``uninstall_rolling_cache`` undoes it (and removes
the decoder's hooks); ``is_installed`` says whether it is on. The rolling_cache fusion (``liger_rolling_cache``)
calls these.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from .decode import remove_forward_wrapper
from .planner import remove_hook
from .ring import RollingKVCache
from .support import find_decoder

INSTALL_ATTR = "_swift_liger_rolling_install"


def install_rolling_cache(model: torch.nn.Module, window, sinks: Optional[int] = None, mode: str = "absolute",
                          cuda_graph: bool = False):
    """Make every ``model.generate(...)`` call that brings no cache of its own use a fresh RollingKVCache
    (``window`` an int, sinks default 4, or ``"model"``: see RollingKVCache).

    Validates the configuration now (bad window/sinks/mode, unsupported family or attention are errors here, not at
    the first generate). Wraps ``generate`` on this instance only; ``uninstall_rolling_cache`` undoes it. Calls that
    pass ``past_key_values``, ``cache_implementation`` or ``use_cache=False`` are left alone. Returns the model.
    """
    RollingKVCache(model, window=window, sinks=sinks, mode=mode, cuda_graph=cuda_graph)   # validation, hooks
    settings = {"window": window, "sinks": sinks, "mode": mode, "cuda_graph": cuda_graph}
    state = getattr(model, INSTALL_ATTR, None)
    if state is not None:
        state["settings"] = settings
        return model
    state = {"settings": settings, "original": model.__dict__.get("generate")}   # None: the class method
    object.__setattr__(model, INSTALL_ATTR, state)
    object.__setattr__(model, "generate", types.MethodType(_rolling_generate, model))
    return model


def _rolling_generate(self, *args, **kwargs):
    """``generate`` of a model with install_rolling_cache: a fresh RollingKVCache unless the call brings its own
    cache (or none). Bound with MethodType and reading its settings from the instance, so deep copies build caches
    for themselves."""
    state = self.__dict__[INSTALL_ATTR]
    gen_config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
    wants_cache = (kwargs.get("past_key_values") is None and kwargs.get("use_cache", True) is not False
                   and kwargs.get("cache_implementation") is None
                   and getattr(gen_config, "cache_implementation", None) is None
                   and getattr(gen_config, "use_cache", True) is not False)
    cache = None
    if wants_cache:
        cache = kwargs["past_key_values"] = RollingKVCache(self, **state["settings"])
    original = state["original"]
    try:
        if original is None:
            return type(self).generate(self, *args, **kwargs)
        return original(*args, **kwargs)
    finally:
        counts = state.setdefault("counts", {"generate": 0, "own_cache": 0, "forwards": 0, "graph_steps": 0})
        if cache is None:
            counts["own_cache"] += 1
        else:
            counts["generate"] += 1
            counts["forwards"] += sum(cache.forwards)
            counts["graph_steps"] += cache.forwards[1]


def generate_counts(model: torch.nn.Module) -> Optional[dict]:
    """What the installed generate did so far: calls on a fresh RollingKVCache (``generate``), calls that brought
    their own cache or none (``own_cache``), and the decoder forwards of the former (``forwards``), of which
    ``graph_steps`` were CUDA-graph decode steps. None for a model (or PEFT wrapper of one) without the install."""
    for m in model.modules():
        state = m.__dict__.get(INSTALL_ATTR)
        if state is not None:
            return dict(state.get("counts") or {"generate": 0, "own_cache": 0, "forwards": 0, "graph_steps": 0})
    return None


def uninstall_rolling_cache(model: torch.nn.Module) -> None:
    """Undo ``install_rolling_cache`` (and remove the decoder hook)."""
    state = model.__dict__.get(INSTALL_ATTR)
    if state is not None:
        if state["original"] is not None:
            object.__setattr__(model, "generate", state["original"])
        else:
            object.__delattr__(model, "generate")
        object.__delattr__(model, INSTALL_ATTR)
    try:
        decoder = find_decoder(model)
    except ValueError:
        return
    remove_hook(decoder)
    remove_forward_wrapper(decoder)


def is_installed(model) -> bool:
    """True while ``install_rolling_cache`` is on for this model instance (its ``generate`` builds the caches)."""
    return INSTALL_ATTR in getattr(model, "__dict__", {})
