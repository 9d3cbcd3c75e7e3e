"""PEFT LoRA projections without PEFT's input copies: applied by the swiglu and rope patches (their MLP and
attention forwards route plain LoRA Linears through ops.lora_linear; models/lora.py decides per call)."""
from __future__ import annotations

from .base import Fusion

FUSION = Fusion(key="lora_fusion", default=True,
                help="PEFT LoRA projections (MLP, attention) without PEFT's fp32 or duplicate input copies; off in "
                     "the minimal and off presets.",
                applies_to="PEFT lora.Linear q/k/v/o and gate/up/down projections in the patched attention and MLP",
                applied_by=("swiglu", "rope"), counted=False, say_off=False)
