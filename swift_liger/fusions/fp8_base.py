"""fp8_base: the frozen base weight under each plain LoRA projection stored in FP8 (e4m3 rows, fp32 row scales):
half the weight bytes on the GPU, and the base GEMMs (forward, recompute, input gradient) on FP8 tensor cores
(sm_89+). Adapters train in 16 bits as before; checkpoints and saved adapters are what a 16-bit run saves; the
exact 16-bit weights wait in host memory (2 bytes per parameter) for revert and any read outside the FP8 matmuls.

The bases become FP8 after PEFT has wrapped the model: the ms-swift integration does it right after the tuner;
a plain loop calls ``swift_liger.quantize_lora_bases(model)`` after ``get_peft_model``. ``all`` also stores every
other frozen nn.Linear child of the attention and MLP modules (LoRA on a subset of the projections: the rest), and
the reference / teacher models' (ms-swift freezes them as it loads them; converted right after). Numerics:
activations and input gradients are quantized per token, so base outputs carry FP8 rounding (about 3% relative per
GEMM on random data); see ops/fp8_linear_op.py.
"""
from __future__ import annotations

from .base import Fusion, switch_word

ALL = "all"   # every frozen nn.Linear of the attention and MLP modules, side models' (reference, teacher) too


def normalize(value):
    """False (off), True (the bases under LoRA) or "all"."""
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str):
        word = switch_word(value)
        text = value.strip().lower()
        if word is not None or text == "lora":
            return word is not False
        if text == ALL:
            return ALL
    raise ValueError(f"LigerConfig.fp8_base must be true (the frozen bases under LoRA), false, or all (every frozen "
                     f"linear of the attention and MLP modules, reference and teacher models' too), got {value!r}")


def patch(ctx) -> None:
    from ..patching.fp8 import register   # lazy: the spec loads without torch
    register(ctx.state, [m for kinds in (ctx.family.attention, ctx.family.mlp) for m in ctx.of(kinds)])


def _counters(part, reset) -> dict:
    if part is None:
        return {}
    from ..patching.fp8 import summary   # lazy: the spec loads without torch
    calls = part["calls"]
    out = {"fp8_weights": summary(part)["fp8_weights"], "fp8_base_calls": calls["fp8_base_calls"]}
    if reset:
        calls["fp8_base_calls"] = 0
    return out


FUSION = Fusion(key="fp8_base", default=False, kind="mode", normalize=normalize, parse_flag=normalize,
                help="Store the frozen base weight under each LoRA projection in FP8 e4m3 with row scales (half "
                     "its GPU bytes; FP8 GEMMs); all: every frozen linear of the attention and MLP modules, the "
                     "reference and teacher models' too; needs an sm_89+ GPU (L4, L40S, RTX 4090, H100, H200); weights "
                     "too small for FP8 to pay (in*out/(in+out) < 1280) stay 16-bit; exact 16-bit weights kept in host "
                     "memory; checkpoints and adapters unchanged.",
                applies_to="the nn.Linear base of PEFT lora.Linear projections (vanilla LoRA; not DoRA); with all, "
                           "every frozen nn.Linear child of the attention and MLP modules",
                order=95, patch=patch, say_off=False, counters=_counters)
