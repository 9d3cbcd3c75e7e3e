"""Generation caches. ``RollingKVCache``: attention sinks + a ring of the last ``window`` tokens, constant memory;
with ``window="model"`` on hybrid configs (gemma2, gemma3, ``layer_types``) a ring of the model's own sliding
window on the sliding layers and a full cache on the others, outputs equal to transformers' default cache.

``install_rolling_cache(model, window, sinks, mode)`` makes every ``model.generate`` call of that instance use a
fresh one (what the rolling_cache fusion calls for ``liger_rolling_cache``).
"""
from .rolling import (
    SUPPORTED_ATTENTION,
    SUPPORTED_MODEL_TYPES,
    RollingKVCache,
    install_rolling_cache,
    uninstall_rolling_cache,
)

__all__ = ["RollingKVCache", "install_rolling_cache", "uninstall_rolling_cache", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ATTENTION"]
