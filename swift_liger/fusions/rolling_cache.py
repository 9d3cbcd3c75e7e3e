"""RollingKVCache for generation: every ``generate`` call without a cache of its own gets a fresh ring cache
(swift_liger.cache.install_rolling_cache, also usable on its own).

Settings: ``window`` an int (every layer a ring of ``sinks`` + the last ``window`` tokens) or ``"model"``: the
model's own sliding window, exact, for configs with sliding-window layers (gemma2, gemma3, qwen2/qwen3 with
``layer_types``, mistral): a ring of ``config.sliding_window`` slots (no sinks) on each sliding layer and a growing
full cache on each full-attention layer, outputs equal to transformers' default cache.
"""
from __future__ import annotations

import json

from .base import Fusion, is_count

MODEL_WINDOW = "model"


def check_settings(window, sinks=None, mode="absolute", cuda_graph=False, *, where="RollingKVCache") -> dict:
    """RollingKVCache settings, checked and completed: sinks defaults to 4 for an int window and is 0 for
    window="model" (which also needs mode "absolute" and no CUDA graph). Errors start with `where`."""
    from ..config import check_rolling_cache
    if isinstance(window, str):
        if window.strip().lower() != MODEL_WINDOW:
            raise ValueError(f"{where}: window must be an int >= 1 or 'model' (the model's own sliding window), "
                             f"got {window!r}")
        if sinks not in (None, 0):
            raise ValueError(f"{where}: window 'model' keeps the model's own sliding window exactly, without sinks; "
                             f"got sinks={sinks!r} (leave sinks out or give 0)")
        if mode != "absolute":
            raise ValueError(f"{where}: window 'model' needs mode 'absolute' (true RoPE positions), got {mode!r}")
        if cuda_graph is not False:
            raise ValueError(f"{where}: window 'model' runs without a CUDA graph (the full-attention layers' cache "
                             f"grows); got cuda_graph={cuda_graph!r}")
        return {"window": MODEL_WINDOW, "sinks": 0, "mode": "absolute", "cuda_graph": False}
    return check_rolling_cache(window, 4 if sinks is None else sinks, mode, cuda_graph, where=where)


def normalize(value):
    if value is None:
        return None
    from collections.abc import Mapping

    from ..config import ROLLING_CACHE_KEYS
    if not isinstance(value, Mapping) or set(value) - set(ROLLING_CACHE_KEYS) or "window" not in value:
        raise ValueError("LigerConfig.rolling_cache must be a mapping with keys window, sinks (and optional mode, "
                         f"cuda_graph), got {value!r}")
    check_settings(**value, where="LigerConfig.rolling_cache")
    value = dict(value)
    if isinstance(value["window"], str):
        value["window"] = MODEL_WINDOW
    return value


def parse_flag(value):
    """`"4096,4"`, `"model"`, `'{"window": 4096, "sinks": 4}'`, a mapping, or none/off -> dict or None."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value).strip()
    if text.lower() in ("", "none", "null", "off", "false", "no"):
        return None
    if text.lower() == MODEL_WINDOW:
        return {"window": MODEL_WINDOW}
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"liger_rolling_cache: invalid JSON {text!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"liger_rolling_cache must be a mapping, got {text!r}")
        return data
    parts = [p.strip() for p in text.split(",")]
    graph = len(parts) == 3 and parts[2].lower() == "graph"   # "4096,4,graph": decode steps as CUDA graph replays
    if len(parts) not in (2, 3) or (len(parts) == 3 and not graph) or not all(is_count(p) for p in parts[:2]):
        raise ValueError(f'liger_rolling_cache must be "window,sinks" (two integers, optionally ",graph"), "model" '
                         f'(the model\'s own sliding window on its sliding layers, full cache on the others) or a '
                         f'mapping, got {text!r}')
    out = {"window": int(parts[0]), "sinks": int(parts[1])}
    if graph:
        out["cuda_graph"] = True
    return out


class RollingCacheRefused(ValueError):
    """A rolling-cache setting that cannot work on this model (an explicit window on a model with full-attention
    layers, a ring larger than the device): an error, where an unsupported model is a reported skip."""


def patch(ctx) -> None:
    try:
        from ..cache import install_rolling_cache, uninstall_rolling_cache
    except ImportError as exc:
        ctx.report.skip("rolling_cache", f"swift_liger.cache unavailable ({exc})", problem=True)
        return
    root = ctx.root
    if "generate" in root.__dict__:
        ctx.report.skip("rolling_cache", f"{type(root).__name__} already has an instance-level generate",
                        problem=True)
        return
    try:
        install_rolling_cache(root, **ctx.config.rolling_cache)
    except RollingCacheRefused:
        raise
    except (ValueError, TypeError) as exc:  # unsupported attention: reported, not fatal unless strict
        ctx.report.skip("rolling_cache", str(exc), problem=True)
        return
    ctx.state.on_restore(uninstall_rolling_cache, root)
    ctx.report.patched["rolling_cache"] = 1


FUSION = Fusion(key="rolling_cache", label=lambda count, report: "rolling_cache", default=None, kind="mapping", off=None,
                help='RollingKVCache for generation: "window,sinks", "window,sinks,graph" (CUDA: decode steps '
                     'after the window fills replay one CUDA graph; 5.6 against ~37 ms/token eager on an H200, '
                     'Llama-3-8B), "model" (the model\'s own sliding window, exact: gemma2/gemma3 and other configs '
                     'with sliding layers) or {"window": W, "sinks": S, "mode": "absolute" or "streaming", '
                     '"cuda_graph": true}.',
                applies_to="the model's generate()", order=80, patch=patch, say_off=False,
                normalize=normalize, parse_flag=parse_flag)
