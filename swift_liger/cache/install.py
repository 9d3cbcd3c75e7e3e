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
from .settings import EXACT_WINDOW, RollingCacheRefused, check_settings
from .support import find_decoder, layer_types

INSTALL_ATTR = "_swift_liger_rolling_install"


def install_rolling_cache(model: torch.nn.Module, window, sinks: Optional[int] = None, mode: str = "absolute",
                          cuda_graph: bool = False):
    """Make every ``model.generate(...)`` call that brings no cache of its own use a fresh RollingKVCache
    (``window`` an int, sinks default 4, or ``"model"``: see RollingKVCache). ``window="exact"``: each call's ring
    holds its prompt columns + max new tokens (read from the call's generation settings), so nothing is evicted and
    attention equals the default cache's; with ``cuda_graph=True`` every decode step is a graph replay (GRPO
    rollouts through ms-swift's pt engine). A call whose new-token budget cannot be read, or whose ring would not
    fit the device, keeps transformers' default cache (counted as ``unsized`` by generate_counts).

    Validates the configuration now (bad window/sinks/mode, unsupported family or attention are errors here, not at
    the first generate). Wraps ``generate`` on this instance only; ``uninstall_rolling_cache`` undoes it. Calls that
    pass ``past_key_values``, ``cache_implementation`` or ``use_cache=False`` are left alone. Returns the model.
    """
    if check_settings(window, sinks, mode, cuda_graph, where="install_rolling_cache")["window"] == EXACT_WINDOW:
        window, sinks = EXACT_WINDOW, 0
        config = find_decoder(model).config
        if any(t != "full_attention" for t in layer_types(config)[0]):
            raise ValueError(f"rolling cache window 'exact' keeps every token in every layer, but this "
                             f"{getattr(config, 'model_type', 'model')} has sliding-window layers (their attention "
                             "would differ from the model's): use window 'model' (--liger_rolling_cache model)")
        RollingKVCache(model, window=1, sinks=0, mode=mode, cuda_graph=cuda_graph)   # family/attention checks, hooks
    else:
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
    unsized = False
    if wants_cache:
        settings = state["settings"]
        if settings["window"] == EXACT_WINDOW:
            window = _exact_window(self, args, kwargs, gen_config)
            if window is None:
                unsized = True
            else:
                try:
                    cache = RollingKVCache(self, **{**settings, "window": window})
                except RollingCacheRefused:   # larger than the device: the default cache grows only as needed
                    unsized = True
        else:
            cache = RollingKVCache(self, **settings)
        if cache is not None:
            kwargs["past_key_values"] = cache
    original = state["original"]
    try:
        if original is None:
            return type(self).generate(self, *args, **kwargs)
        return original(*args, **kwargs)
    finally:
        counts = state.setdefault("counts", dict(_ZERO_COUNTS))
        if unsized:
            counts["unsized"] += 1
        elif cache is None:
            counts["own_cache"] += 1
        else:
            counts["generate"] += 1
            counts["forwards"] += sum(cache.forwards)
            counts["graph_steps"] += cache.forwards[1]
            if cache.graph_error is not None:   # later calls decode eagerly instead of failing the capture again
                state["settings"] = {**state["settings"], "cuda_graph": False}
                counts["graph_error"] = cache.graph_error


_ZERO_COUNTS = {"generate": 0, "own_cache": 0, "unsized": 0, "forwards": 0, "graph_steps": 0}


def _exact_window(model, args, kwargs, gen_config) -> Optional[int]:
    """window="exact": the call's prompt columns (padding included: at least its longest row) + max new tokens
    (max_new_tokens, else max_length, which bounds them either way), or None when neither can be read."""
    x = kwargs.get("input_ids")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    if x is None:
        x = kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    columns = x.shape[1]
    new = kwargs.get("max_new_tokens", getattr(gen_config, "max_new_tokens", None))
    if new is None:   # a total max_length bounds the new tokens too (left at its default, generate adds it to the
        new = kwargs.get("max_length", getattr(gen_config, "max_length", None))   # prompt: 20 new tokens)
    if not isinstance(new, int) or new < 1:
        return None
    return columns + new


def generate_counts(model: torch.nn.Module) -> Optional[dict]:
    """What the installed generate did so far: calls on a fresh RollingKVCache (``generate``), calls that brought
    their own cache or none (``own_cache``), window="exact" calls left on transformers' default cache (``unsized``:
    no readable new-token budget, or a ring larger than the device), and the decoder forwards of the RollingKVCache
    calls (``forwards``), of which ``graph_steps`` were CUDA-graph decode steps; ``graph_error`` when a capture
    failed (that call went on eagerly, later ones decode without graphs). None for a model (or PEFT wrapper of one)
    without the install."""
    for m in model.modules():
        state = m.__dict__.get(INSTALL_ATTR)
        if state is not None:
            return dict(state.get("counts") or _ZERO_COUNTS)
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
