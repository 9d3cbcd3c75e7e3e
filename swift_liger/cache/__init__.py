"""Generation caches. ``RollingKVCache``: attention sinks + a ring of the last ``window`` tokens, constant memory;
with ``window="model"`` on hybrid configs (gemma2, gemma3, ``layer_types``) a ring of the model's own sliding
window on the sliding layers and a full cache on the others, outputs equal to transformers' default cache.

``install_rolling_cache(model, window, sinks, mode)`` makes every ``model.generate`` call of that instance use a
fresh one (what the rolling_cache fusion calls for ``liger_rolling_cache``).

Modules, by concern (each imports only swift_liger.ops, swift_liger.patching.families and the ones above it):
settings (the settings check; no torch), support (which models, checked before a cache is built), planner (each
forward's plan and the decoder's pre-forward hook), decode (decode kernel and CUDA-graph steps), ring (RollingKVCache
and its layers), install (install / uninstall / is_installed on a model).

The names below that need torch load on first use (module ``__getattr__``), so ``import swift_liger.cache.settings``
(the fusion spec, LigerConfig, the flags) stays free of torch and transformers.
"""
from importlib import import_module

from .settings import MODEL_WINDOW, RollingCacheRefused, check_settings

_LAZY = {   # public name -> the module that holds it (imported on first access)
    "RollingKVCache": "ring",
    "install_rolling_cache": "install",
    "uninstall_rolling_cache": "install",
    "is_installed": "install",
    "SUPPORTED_MODEL_TYPES": "support",
    "SUPPORTED_ATTENTION": "support",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["RollingKVCache", "install_rolling_cache", "uninstall_rolling_cache", "is_installed",
           "SUPPORTED_MODEL_TYPES", "SUPPORTED_ATTENTION", "MODEL_WINDOW", "RollingCacheRefused", "check_settings"]
