"""fp8_base: the frozen base weight under each plain LoRA projection stored in FP8 (e4m3 rows, fp32 row scales):
half the weight bytes on the GPU, and the base GEMMs (forward, recompute, input gradient) on FP8 tensor cores
(sm_89+). Adapters train in 16 bits as before; checkpoints and saved adapters are what a 16-bit run saves; the
exact 16-bit weights wait in host memory (2 bytes per parameter) for revert and any read outside the FP8 matmuls.

The bases become FP8 after PEFT has wrapped the model: the ms-swift integration does it right after the tuner;
a plain loop calls ``swift_liger.quantize_lora_bases(model)`` after ``get_peft_model``. Numerics: activations and
input gradients are quantized per token, so base outputs carry FP8 rounding (about 3% relative per GEMM on random
data); see ops/fp8_linear_op.py.
"""
from __future__ import annotations

from .base import Fusion


def patch(ctx) -> None:
    from ..patching.fp8 import register   # lazy: the spec loads without torch
    register(ctx.state)


def _counters(part, reset) -> dict:
    if part is None:
        return {}
    from ..patching.fp8 import summary   # lazy: the spec loads without torch
    calls = part["calls"]
    out = {"fp8_weights": summary(part)["fp8_weights"], "fp8_base_calls": calls["fp8_base_calls"]}
    if reset:
        calls["fp8_base_calls"] = 0
    return out


FUSION = Fusion(key="fp8_base", default=False,
                help="Store the frozen base weight under each LoRA projection in FP8 e4m3 with row scales (half "
                     "its GPU bytes; FP8 GEMMs); needs an sm_89+ GPU (L4, L40S, RTX 4090, H100, H200); exact 16-bit "
                     "weights kept in host memory; checkpoints and adapters unchanged.",
                applies_to="the nn.Linear base of PEFT lora.Linear projections (vanilla LoRA; not DoRA)",
                order=95, patch=patch, say_off=False, counters=_counters)
