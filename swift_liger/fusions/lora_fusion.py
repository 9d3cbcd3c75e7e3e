"""PEFT LoRA projections without PEFT's input copies. The swiglu and rope patches route the LoRA Linears of the MLP and
attention forwards they replace through ops.lora_linear (patching/lora.py decides per call); this fusion's own patch
does the same for the attention and MLP modules those two left as they were (rope or swiglu off, or skipped), so
lora_fusion covers every attention and MLP projection whatever the other switches say."""
from __future__ import annotations

from .base import Fusion, read_counters

CALLS = ("lora_fused", "lora_peft")   # LoRA projection calls through ops.lora_linear / through PEFT's own forward


def lora_calls(st) -> dict:
    """The LoRA call counters of this patch state, shared by every module whose forward routes LoRA (this fusion's,
    rope's and swiglu's patches)."""
    return st.parts.setdefault("lora_fusion", dict.fromkeys(CALLS, 0))


def patch(ctx) -> None:
    from ..patching.lora import share_counters, with_lora_projections   # lazy: the spec loads without torch
    from ..patching.state import forward_attr, foreign_forward, set_forward
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
            share_counters(ctx.state, module, lora_calls(ctx.state))


FUSION = Fusion(key="lora_fusion", default=True,
                help="PEFT LoRA projections (MLP, attention) without PEFT's fp32 or duplicate input copies; off in "
                     "the minimal and off presets.",
                applies_to="PEFT lora.Linear q/k/v/o and gate/up/down projections in the attention and MLP modules",
                applied_by=("swiglu", "rope"), counted=False, say_off=False, order=32, patch=patch,
                counters=lambda part, reset: read_counters(part, CALLS, reset))
