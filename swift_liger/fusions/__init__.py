"""The fusion registry: one module per fusion (its spec and its patch). LigerConfig's fields, the --liger_* flags
and YAML keys, the patch report's counters, the README flags table and `swift-liger ab --each` come from here; the
patcher (swift_liger/patcher.py) runs the patches in `order`; `call_counts` and the report read each fusion's
`counters` and `label` hooks. A new fusion is one module (or package, like loss_head) and one entry below.
"""
from __future__ import annotations

from . import (compile_layers, cudnn_attention, drop_pad_mask, fp8_base, fused_projections, graph_layers, lora_fusion,
               loss_head, offload_checkpoints, qk_norm_rope, rms_norm, rolling_cache, rope, save_attention, swiglu,
               tiled_mlp)
from .base import Fusion, PatchContext

REGISTRY = tuple(m.FUSION for m in (rms_norm, rope, qk_norm_rope, swiglu, lora_fusion, tiled_mlp, offload_checkpoints,
                                    save_attention, loss_head, rolling_cache, fused_projections,
                                    compile_layers, drop_pad_mask, cudnn_attention, graph_layers, fp8_base))
BY_KEY = {f.key: f for f in REGISTRY}
COUNTED = tuple(f.key for f in REGISTRY if f.counted)          # PatchReport.patched keys, in this order
PATCHES = tuple(sorted((f for f in REGISTRY if f.patch is not None), key=lambda f: f.order))


def enabled(fusion: Fusion, config) -> bool:
    return getattr(config, fusion.key) != fusion.off


__all__ = ["BY_KEY", "COUNTED", "Fusion", "PATCHES", "PatchContext", "REGISTRY", "enabled"]
