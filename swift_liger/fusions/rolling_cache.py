"""RollingKVCache for generation: every ``generate`` call without a cache of its own gets a fresh ring cache
(swift_liger.cache.install_rolling_cache, also usable on its own)."""
from __future__ import annotations

import json

from .base import Fusion


def normalize(value):
    if value is None:
        return None
    from collections.abc import Mapping

    from ..config import ROLLING_CACHE_KEYS, check_rolling_cache
    if not isinstance(value, Mapping) or set(value) - set(ROLLING_CACHE_KEYS) or "window" not in value:
        raise ValueError("LigerConfig.rolling_cache must be a mapping with keys window, sinks (and optional mode, "
                         f"cuda_graph), got {value!r}")
    check_rolling_cache(**value, where="LigerConfig.rolling_cache")
    return dict(value)


def parse_flag(value):
    """`"4096,4"`, `'{"window": 4096, "sinks": 4}'`, a mapping, or none/off -> dict or None."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value).strip()
    if text.lower() in ("", "none", "null", "off", "false", "no"):
        return None
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"liger_rolling_cache: invalid JSON {text!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"liger_rolling_cache must be a mapping, got {text!r}")
        return data
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f'liger_rolling_cache must be "window,sinks" (two integers) or a mapping, got {text!r}')
    return {"window": int(parts[0]), "sinks": int(parts[1])}


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
    except (ValueError, TypeError) as exc:  # unsupported attention: reported, not fatal unless strict
        ctx.report.skip("rolling_cache", str(exc), problem=True)
        return
    ctx.state.on_restore(uninstall_rolling_cache, root)
    ctx.report.patched["rolling_cache"] = 1


FUSION = Fusion(key="rolling_cache", default=None, kind="mapping", off=None,
                help='RollingKVCache for generation: "window,sinks" or {"window": W, "sinks": S, "mode": '
                     '"absolute" or "streaming", "cuda_graph": true}.',
                applies_to="the model's generate()", order=80, patch=patch, say_off=False,
                normalize=normalize, parse_flag=parse_flag)
