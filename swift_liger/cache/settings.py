"""Rolling-cache settings: the one check of ``window`` / ``sinks`` / ``mode`` / ``cuda_graph`` and the names it uses.

Imports neither torch nor transformers: LigerConfig, the ``--liger_rolling_cache`` flag and YAML keys
(fusions/rolling_cache.py) check with it before any model is loaded, and RollingKVCache / install_rolling_cache check
with the same function, so every way in refuses a setting in the same words.
"""
from __future__ import annotations

MODEL_WINDOW = "model"   # window="model": the model's own sliding window on its sliding layers, exact
EXACT_WINDOW = "exact"   # window="exact": install_rolling_cache sizes each generate call's ring to prompt + new tokens
ROLLING_CACHE_MODES = ("absolute", "streaming")
ROLLING_CACHE_KEYS = ("window", "sinks", "mode", "cuda_graph")
DEFAULT_SINKS = 4   # StreamingLLM's; the sinks of an int window when none are given


class RollingCacheRefused(ValueError):
    """A rolling-cache setting that cannot work on this model (an explicit window on a model with full-attention
    layers, a ring larger than the device): an error, where an unsupported model is a reported skip."""


def check_settings(window, sinks=None, mode="absolute", cuda_graph=False, *, where="RollingKVCache") -> dict:
    """RollingKVCache settings, checked and completed: window an int >= 1, "model" or "exact"; sinks an int >= 0 and
    < window, default 4 for an int window, 0 for window="model" (which also needs mode "absolute" and no CUDA graph)
    and for window="exact" (mode "absolute", CUDA graph allowed: a ring per generate call of prompt columns + new
    tokens, which never evicts); mode absolute|streaming; cuda_graph bool. Returns them as a dict; errors start with
    `where`."""
    if isinstance(window, str) and window.strip().lower() == EXACT_WINDOW:
        if sinks not in (None, 0):
            raise ValueError(f"{where}: window 'exact' holds every token of the call (nothing is evicted), so it has "
                             f"no sinks; got sinks={sinks!r} (leave sinks out or give 0)")
        if mode != "absolute":
            raise ValueError(f"{where}: window 'exact' needs mode 'absolute' (true RoPE positions), got {mode!r}")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"{where}: cuda_graph must be true or false, got {cuda_graph!r}")
        return {"window": EXACT_WINDOW, "sinks": 0, "mode": "absolute", "cuda_graph": cuda_graph}
    if isinstance(window, str):
        if window.strip().lower() != MODEL_WINDOW:
            raise ValueError(f"{where}: window must be an int >= 1, 'model' (the model's own sliding window) or "
                             f"'exact' (a ring per generate call of prompt + new tokens), got {window!r}")
        if sinks not in (None, 0):
            raise ValueError(f"{where}: window 'model' keeps the model's own sliding window exactly, without sinks; "
                             f"got sinks={sinks!r} (leave sinks out or give 0)")
        if mode != "absolute":
            raise ValueError(f"{where}: window 'model' needs mode 'absolute' (true RoPE positions), got {mode!r}")
        if cuda_graph is not False:
            raise ValueError(f"{where}: window 'model' runs without a CUDA graph (the full-attention layers' cache "
                             f"grows); got cuda_graph={cuda_graph!r}")
        return {"window": MODEL_WINDOW, "sinks": 0, "mode": "absolute", "cuda_graph": False}
    if sinks is None:
        sinks = DEFAULT_SINKS
    for name, value, minimum in (("window", window, 1), ("sinks", sinks, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    if sinks >= window:
        raise ValueError(f"{where}: sinks must be < window, got sinks={sinks}, window={window}")
    if mode not in ROLLING_CACHE_MODES:
        raise ValueError(f"{where}: mode must be one of {', '.join(ROLLING_CACHE_MODES)}, got {mode!r}")
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"{where}: cuda_graph must be true or false, got {cuda_graph!r}")
    return {"window": window, "sinks": sinks, "mode": mode, "cuda_graph": cuda_graph}
