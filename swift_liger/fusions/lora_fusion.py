"""PEFT LoRA projections without PEFT's input copies. The swiglu and rope patches route the LoRA Linears of the MLP and
attention forwards they replace through ops.lora_linear (models/lora.py decides per call); this fusion's own patch
does the same for the attention and MLP modules those two left as they were (rope or swiglu off, or skipped), so
lora_fusion covers every attention and MLP projection whatever the other switches say."""
from __future__ import annotations

from .base import Fusion


def patch(ctx) -> None:
    from ..models.lora import share_counters, with_lora_projections
    from ..models.state import forward_attr, foreign_forward, set_forward
    layout = ctx.family.mlp_layout
    mlp_names = tuple(n for n in (layout.gate, layout.up, layout.down) if n is not None)
    for kinds, names in ((ctx.family.attention, None), (ctx.family.mlp, mlp_names)):
        for module in ctx.of(kinds):
            if forward_attr(module) in module.__dict__:   # rope's / swiglu's (they route LoRA) or another tool's
                continue
            if foreign_forward(module):
                continue
            base = type(module).forward
            set_forward(ctx.state, module, with_lora_projections(base) if names is None
                        else with_lora_projections(base, names))
            share_counters(ctx.state, module)


FUSION = Fusion(key="lora_fusion", default=True,
                help="PEFT LoRA projections (MLP, attention) without PEFT's fp32 or duplicate input copies; off in "
                     "the minimal and off presets.",
                applies_to="PEFT lora.Linear q/k/v/o and gate/up/down projections in the attention and MLP modules",
                applied_by=("swiglu", "rope"), counted=False, say_off=False, order=32, patch=patch)
