"""Keep attention outputs through gradient checkpointing: the recompute of a checkpointed decoder layer reuses the
forward's SDPA result (out + logsumexp) instead of running attention again (patching/checkpoint_funcs.py).

Attention is the one part of a layer whose recompute costs O(T^2). Through `swift sft`, full fine-tuning at
Qwen2.5-1.5B shapes and 16k tokens on an H200: 33,501 tok/s against 30,093 without it (1.11x). The price is one
[T, heads x head_dim] output (bf16) plus a [heads, T] fp32 logsumexp per layer, 48 MiB per layer there (1.3 GiB over
28 layers), held from the forward until that layer's backward; the step's peak there is at the end of the backward,
when most are freed again, so it rose by 0.14 GiB (13.01 -> 13.15 GiB). Layers whose checkpoints are
offloaded (offload_checkpoints) keep their own recompute; the rest get this one. Applies to SDPA attention whose
call reaches a fused kernel (flash, memory-efficient, cuDNN or the CPU flash kernel); other attention (eager,
flex, a padded batch that takes SDPA's math path) is recomputed as before. Needs --gradient_checkpointing true.
"""
from __future__ import annotations

from .base import Fusion, read_counters

CALLS = ("kept",)   # SDPA outputs kept in the forward for the recompute


def patch(ctx) -> None:
    from ..patching import checkpoint_funcs   # lazy: the spec loads without torch
    layers = checkpoint_funcs.checkpointed_layers(ctx, "save_attention")
    if not layers:
        return
    if ctx.config.compile_layers:
        ctx.report.skip("save_attention", "not combined with compile_layers (a compiled layer inside a selective "
                        "checkpoint is not built): attention is recomputed", problem=True)
        return
    taken = {id(layer) for layer, _ in (getattr(ctx.state, "checkpoint_funcs", None) or [])}
    rest = [layer for layer in layers if id(layer) not in taken]
    if not rest:
        ctx.report.skip("save_attention", "every decoder layer's checkpoint is offloaded (offload_checkpoints), "
                        "whose recompute runs attention again", problem=False)
        return
    calls = dict.fromkeys(CALLS, 0)
    checkpoint_funcs.install(ctx, rest, checkpoint_funcs.keep_attention_checkpoint(calls))
    ctx.state.parts["save_attention"] = calls
    ctx.report.patched["save_attention"] = len(rest)


def _counters(part, reset) -> dict:
    # attention outputs kept in the forward and reused in the recompute; absent when the patch did not run
    return {} if part is None else {"saved_attention": read_counters(part, CALLS, reset)}


FUSION = Fusion(key="save_attention", default=False,
                help="Under gradient checkpointing, keep each decoder layer's SDPA output (out + logsumexp) so the "
                     "recompute skips attention: one [tokens, heads x head_dim] tensor per layer more; layers "
                     "with offloaded checkpoints keep their own recompute.",
                applies_to="decoder layers (GradientCheckpointingLayer) with SDPA attention", order=86, patch=patch,
                say_off=False, counters=_counters)
