"""The per-instance forward of a patched decoder layer, shared by the fusions that act around a whole layer call:
drop_pad_mask (`_liger_pad_masks`: a right-padded batch's causal mask replaced by SDPA's causal path), graph_layers
(`_liger_graphs`: replay the layer from CUDA graphs) and cudnn_attention (`_liger_sdpa`: the SDPA priority order the
layer's attention runs under). Each fusion sets its attribute; whichever patches first installs this forward, the
others find it installed (`attach`)."""
from __future__ import annotations

import types

import torch

from . import sdpa_choice
from .state import PatchState, forward_attr, foreign_forward, set_forward


def forward(self, hidden_states, *args, **kwargs):
    """Replayed from graph_layers' graphs where possible (their captures run in torch's SDPA order), else the class's
    own forward, under cudnn_attention's order where it chose one; without the mask where drop_pad_mask found it
    causal + right padding."""
    masks = self.__dict__.get("_liger_pad_masks")
    mask = kwargs.get("attention_mask")
    if masks is not None and mask is not None and masks.causal_only(mask, hidden_states.shape[-2], kwargs):
        kwargs["attention_mask"] = None
    graphs = None if torch.compiler.is_compiling() else self.__dict__.get("_liger_graphs")   # torch.compile: eager
    if graphs is not None and not args:
        out = graphs.forward(self, type(self).forward, hidden_states, **kwargs)
        if out is not None:
            return out
    sdpa = self.__dict__.get("_liger_sdpa")
    order = None if sdpa is None else sdpa.order_for(hidden_states, kwargs, self.training)
    if order is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    prev = sdpa_choice.prefer(order)
    try:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    finally:
        sdpa_choice.restore(prev)


def decoder_layers(ctx, key: str, problem: bool, compiled: str) -> list:
    """The decoder layers a whole-layer fusion `key` acts on, or [] after reporting why none (no decoder layer
    found; compile_layers on, for the reason `compiled`)."""
    layers = ctx.of(ctx.family.decoder_layer)
    if not layers:
        ctx.report.skip(key, f"no {'/'.join(ctx.family.decoder_layer)} module found", problem=problem)
        return []
    if ctx.config.compile_layers:
        ctx.report.skip(key, compiled)
        return []
    return layers


def attach(ctx, key: str, layer: torch.nn.Module, attr: str, make) -> bool:
    """Install the shared forward on `layer` and set its `attr` to make() (both undone by revert); False after
    reporting why the layer cannot take it (make is not called then)."""
    reason = install(ctx.state, layer)
    if reason is not None:
        ctx.report.skip(key, reason, problem=True)
        return False
    ctx.state.set(layer, attr, make())
    return True


def install(st: PatchState, layer: torch.nn.Module):
    """Install the shared forward on `layer` (a no-op when it is already there). Returns None, or the reason the
    layer cannot take it (another tool's instance-level forward)."""
    current = layer.__dict__.get(forward_attr(layer))
    if isinstance(current, types.MethodType) and current.__func__ is forward:
        return None
    reason = foreign_forward(layer)
    if reason is None:
        set_forward(st, layer, forward)
    return reason
