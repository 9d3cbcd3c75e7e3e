"""Per-decoder-layer gradient-checkpoint functions that survive (re)enabling gradient checkpointing.

HF runs a checkpointed layer as ``layer._gradient_checkpointing_func(partial(layer.__call__, **kwargs), *args)`` and
sets that attribute on every layer whenever ``gradient_checkpointing_enable`` runs (ms-swift enables it after our
patch). `install` records (layer, function) pairs on the patch state and wraps the model's
``_set_gradient_checkpointing`` once, so each enable puts the recorded functions back. Fusions that choose how a
layer is checkpointed (offload_checkpoints, save_attention) register their layers here; a layer has one function.

`keep_attention_checkpoint(calls)` is torch's non-reentrant checkpoint with a selective policy that keeps the
outputs of the fused SDPA kernels (flash / memory-efficient / cuDNN / CPU flash: out + logsumexp), so the recompute
skips attention; every other op is recomputed as before.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable

import torch


def _install(state) -> int:
    n = 0
    for layer, func in state.checkpoint_funcs:
        if getattr(layer, "gradient_checkpointing", False):
            state.set(layer, "_gradient_checkpointing_func", func)
            n += 1
    return n


class _Reinstall:
    """Stands in for the owner's ``_set_gradient_checkpointing``: runs the class's, then puts our functions back.
    An object, not a closure, so that copy.deepcopy maps its state and owner to the copies."""

    def __init__(self, state, owner):
        self.state, self.owner = state, owner

    def __call__(self, *args, **kwargs):
        out = type(self.owner)._set_gradient_checkpointing(self.owner, *args, **kwargs)
        _install(self.state)
        return out


def _forget(state) -> None:
    state.checkpoint_funcs = None


def install(ctx, layers: Iterable[torch.nn.Module], func: Callable) -> int:
    """Checkpoint `layers` with `func` from now on; returns how many have gradient checkpointing on now."""
    state = ctx.state
    if getattr(state, "checkpoint_funcs", None) is None:
        state.checkpoint_funcs = []
        owners = [m for m in ctx.modules if hasattr(type(m), "_set_gradient_checkpointing")
                  and hasattr(type(m), "gradient_checkpointing_enable")]
        for owner in owners:
            state.set(owner, "_set_gradient_checkpointing", _Reinstall(state, owner))
        state.on_restore(_forget, state)
    taken = {id(layer) for layer, _ in state.checkpoint_funcs}
    state.checkpoint_funcs += [(layer, func) for layer in layers if id(layer) not in taken]
    return _install(state)


def checkpointed_layers(ctx, fusion: str) -> list:
    """The family's decoder layers, or [] after saying in the report why `fusion` cannot set their checkpoint."""
    layers = ctx.of(ctx.family.decoder_layer)
    if not layers:
        ctx.report.skip(fusion, f"no {'/'.join(ctx.family.decoder_layer)} module found", problem=True)
        return []
    if not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        ctx.report.skip(fusion, f"{type(layers[0]).__name__} is not a GradientCheckpointingLayer", problem=True)
        return []
    return layers


def attention_ops() -> tuple:
    """The fused SDPA kernels this torch build has (their outputs are what save_attention keeps)."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return tuple(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def _policy(ops, calls: Dict[str, int], ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    if op in ops:
        if not ctx.is_recompute:   # torch >= 2.13 calls the policy in the forward only
            calls["kept"] += 1
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context(ops, calls):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(functools.partial(_policy, ops, calls))


def keep_attention_checkpoint(calls: Dict[str, int]) -> Callable:
    """A `_gradient_checkpointing_func` that keeps SDPA's outputs; counts the kept kernel outputs in calls["kept"]
    (the recompute takes every kept output back: torch's selective checkpoint raises on a mismatch)."""
    from torch.utils.checkpoint import checkpoint
    return functools.partial(checkpoint, use_reentrant=False,
                             context_fn=functools.partial(_context, attention_ops(), calls))
