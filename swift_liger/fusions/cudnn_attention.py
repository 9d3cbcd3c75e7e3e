"""Run decoder layers' SDPA attention through cuDNN's fused kernel where it is measured faster than torch's first
choice, FlashAttention-2 (patching/sdpa_choice.py): per batch shape, timed once on random tensors of the layer's head
shape. Only plain causal calls (no mask tensor, no KV cache, bf16/fp16, at least 512 tokens per row); everything else
keeps torch's order, and so does every call where torch's order already starts with cuDNN (torch 2.11 on the H200
and H100: there nothing is timed). Off by default: on the H200 it measured no gain (Qwen2.5-7B 8k LoRA 10115 vs 10079
tok/s), torch already running cuDNN."""
from __future__ import annotations

from .base import Fusion, read_counters

CALLS = ("cudnn_calls", "torch_calls", "cudnn_already")   # already: torch's own order starts with cuDNN


def _heads(layer):
    """(attention config, heads, kv heads, head dim) of a decoder layer's self-attention, or None."""
    attn = getattr(layer, "self_attn", None)
    config = getattr(attn, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads)
    return (config, heads, kv, dim) if isinstance(kv, int) and isinstance(dim, int) and dim > 0 else None


def patch(ctx) -> None:
    from ..patching import layer_forward, sdpa_choice   # lazy: the spec loads without torch
    layers = layer_forward.decoder_layers(ctx, "cudnn_attention", False,
                                          "not combined with compile_layers: torch's order")
    import torch   # lazy: the spec loads without torch
    if layers and sdpa_choice.SdpaChoice.device_type == "cuda" and not torch.cuda.is_available():
        ctx.report.skip("cudnn_attention", "no CUDA device (cuDNN attention runs on one only)")
        return
    heads = _heads(layers[0]) if layers else None
    if layers and heads is None:
        ctx.report.skip("cudnn_attention", f"{type(layers[0]).__name__}.self_attn has no head counts in its config",
                        problem=False)
    if heads is None:
        return
    choice = sdpa_choice.SdpaChoice(*heads)
    n = 0
    for layer in layers:
        if _heads(layer) != heads:
            ctx.report.skip("cudnn_attention", f"{type(layer).__name__} layers differ in head shape", problem=False)
        else:
            n += layer_forward.attach(ctx, "cudnn_attention", layer, "_liger_sdpa", lambda: choice)
    ctx.state.parts["cudnn_attention"] = choice
    ctx.report.patched["cudnn_attention"] += n


def _counters(choice, reset) -> dict:
    if choice is None:
        return {}
    out = {"sdpa": dict(read_counters(choice.stats, CALLS, False), measured=list(choice.stats["measured"]))}
    if reset:
        choice.stats.update(cudnn_calls=0, torch_calls=0, cudnn_already=0, measured=[])
    return out


FUSION = Fusion(key="cudnn_attention", default=False,
                label=lambda count, report: f"cuDNN-first SDPA in {count} decoder layers",
                help="Where torch's SDPA order puts FlashAttention-2 before cuDNN, time both once per batch shape "
                     "and run SDPA cuDNN-first where cuDNN is faster (causal calls without a mask tensor or KV cache, "
                     "512+ tokens per row). A no-op where torch already starts with cuDNN (torch 2.11 on the H200: "
                     "Qwen2.5-7B 8k LoRA 10115 vs 10079 tok/s).",
                applies_to="decoder layers with SDPA self-attention", order=94, patch=patch, say_off=False,
                counters=_counters)
