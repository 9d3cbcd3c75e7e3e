"""lora_fusion: PEFT LoRA projections inside the patched MLP and attention run through ops.lora_linear.

This module knows PEFT's lora.Linear (one active adapter, unmerged, vanilla LoRA, a frozen nn.Linear base, no
biases or hooks) and PEFT's lora.Linear4bit over a bitsandbytes 4-bit base (QLoRA: the base weight goes to the op
as an ops.lora_linear_op.DequantizedWeight, dequantized the way bitsandbytes' own training matmul does).
Whether ops.lora_linear can take the call (dtypes, dropout, contiguity) is decided in one place,
``ops.lora_linear_op.lora_linear_problem``. Anything else runs PEFT's own forward. Every call is counted in the
patch state of the model (``lora_fused`` / ``lora_peft``), read back through swift_liger.call_counts, except those
of graph_layers' compile-ahead pass (they compile our kernels and launch none).
"""
from __future__ import annotations

import types
import weakref
from typing import Callable, Optional

import torch

from ..ops import _launch
from ..ops.lora_linear_op import DequantizedWeight, lora_linear_problem, lora_linear_unchecked
from .state import CALLS_ATTR, count as _count_call


def count(owner: torch.nn.Module, key: str) -> None:
    """state.count, except inside compile_ahead's pass: its calls compile our kernels and launch none."""
    if not _launch.compiling_ahead():
        _count_call(owner, key)


# PEFT's LoRA linears: layer.Linear, bnb.Linear4bit (both fused when plain_lora_parts accepts the call) and
# bnb.Linear8bitLt (always PEFT's forward: its int8 matmul is not a dequantize-then-matmul; counted as such)
LORA_CLASSES = ("Linear", "Linear4bit", "Linear8bitLt")


def is_peft_lora_linear(module) -> bool:
    cls = type(module)
    return cls.__name__ in LORA_CLASSES and cls.__module__.startswith("peft.tuners.lora")


def _is_bnb_4bit(base) -> bool:
    cls = type(base)
    return cls.__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and cls.__module__.startswith("bitsandbytes")


def _base_weight(base: torch.nn.Module, x: torch.Tensor):
    """The base layer's frozen weight for ops.lora_linear: nn.Linear's own, or a 4-bit bitsandbytes weight wrapped to
    be dequantized per matmul (None where this set-up is not the one bitsandbytes' forward computes as
    F.linear(x, dequantized W) for training-sized inputs: a compute dtype other than x's, or no quant state)."""
    if type(base) is torch.nn.Linear:
        return base.weight
    if not _is_bnb_4bit(base):
        return None
    import bitsandbytes.functional as bnbf
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module
    fix_4bit_weight_quant_state_from_module(base)   # what its forward does first: FSDP may drop the state
    packed = base.weight
    state = getattr(packed, "quant_state", None)
    cdt = base.compute_dtype if base.compute_dtype is not None else x.dtype
    if state is None or cdt != x.dtype or len(state.shape) != 2 or packed.device != x.device:
        return None
    return DequantizedWeight(lambda: bnbf.dequantize_4bit(packed.data, state).to(cdt), state.shape, cdt,
                             packed.device)


def plain_lora_parts(layer: torch.nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """(weight, bias, lora_a, lora_b, scaling, dropout, p, module_dropout) when `layer` is a PEFT LoRA Linear in its
    plain set-up and ops.lora_linear takes this call, else None (the caller then calls the layer as usual).
    p: the dropout drawn inside the op; module_dropout: apply `dropout` first and pass its output as x_lora."""
    if not is_peft_lora_linear(layer):
        return None
    try:
        if layer.merged or layer.disable_adapters or getattr(layer, "fan_in_fan_out", False):
            return None
        active = layer.active_adapters
        if len(active) != 1:
            return None
        name = active[0]
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        dropout, scaling = layer.lora_dropout[name], layer.scaling[name]
        if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
            return None
        base = layer.get_base_layer()
    except (AttributeError, KeyError, TypeError):
        return None
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return None
    weight = _base_weight(base, x)
    if weight is None:
        return None
    if lora_a.bias is not None or lora_b.bias is not None or not isinstance(scaling, (int, float)):
        return None
    if type(dropout) not in (torch.nn.Identity, torch.nn.Dropout):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, base, lora_a, lora_b)):
        return None
    p = float(dropout.p) if type(dropout) is torch.nn.Dropout and dropout.training else 0.0
    module_dropout = False
    if p > 0 and (not x.is_contiguous() or dropout.inplace):   # the op draws dropout only on a contiguous x
        p, module_dropout = 0.0, True
    if lora_linear_problem(x, x if module_dropout else None, weight, base.bias, lora_a.weight, lora_b.weight,
                           p) is not None:
        return None
    return weight, base.bias, lora_a.weight, lora_b.weight, float(scaling), dropout, p, module_dropout


# layer -> (key, parts): the decision plain_lora_parts made for a plain nn.Linear base, reused while nothing it read
# has changed. The key holds everything it reads that can change between calls (PEFT's adapter state, the modules
# and parameters by identity, hooks, dropout's mode, grad flags, x's dtype/width/layout and autocast), so a hit
# returns what the full check would (tests/patching/test_lora_parts.py checks each change). Weak keys: nothing outlives
# the layer, and a deep copy starts empty.
_PARTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _call_key(layer, x: torch.Tensor):
    """What plain_lora_parts reads from `layer` and `x` for a plain nn.Linear base, as one tuple (None: not that
    set-up, or PEFT keeps its state where this does not look; the full check then runs every call)."""
    d = layer.__dict__
    mods = d.get("_modules")
    active = d.get("_active_adapter")
    if mods is None or not isinstance(active, (str, list, tuple)):
        return None
    name = active if isinstance(active, str) else (active[0] if len(active) == 1 else None)
    base = mods.get("base_layer")
    if name is None or type(base) is not torch.nn.Linear:
        return None
    try:
        a, b, drop = mods["lora_A"]._modules[name], mods["lora_B"]._modules[name], mods["lora_dropout"]._modules[name]
    except (KeyError, AttributeError, TypeError):
        return None
    w, bias = base._parameters.get("weight"), base._parameters.get("bias")
    wa, wb = a._parameters.get("weight"), b._parameters.get("weight")
    scaling = d.get("scaling", {}).get(name)
    if w is None or wa is None or wb is None or type(scaling) not in (int, float):
        return None
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (layer, base, a, b))
    auto = torch.is_autocast_enabled(x.device.type)
    return (name, d.get("_disable_adapters"), tuple(d.get("merged_adapters", ())), d.get("fan_in_fan_out"), base, a,
            b, drop, drop.training, w, bias, wa, wb, w.dtype, wa.dtype, wb.dtype, w.requires_grad,
            bias is not None and bias.requires_grad, hooked, scaling, x.dtype, x.device, x.shape[-1],
            x.is_contiguous(), auto,
            torch.get_autocast_dtype(x.device.type) if auto else None)


def lora_parts(layer: torch.nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """plain_lora_parts(layer, x), with the decision reused while its inputs (``_call_key``) are unchanged."""
    key = _call_key(layer, x)
    if key is None:
        return plain_lora_parts(layer, x)
    hit = _PARTS.get(layer)
    if hit is not None and hit[0] == key:
        return hit[1]
    parts = plain_lora_parts(layer, x)
    _PARTS[layer] = (key, parts)
    return parts


def fused_lora(x: torch.Tensor, parts: tuple) -> torch.Tensor:
    weight, bias, lora_a, lora_b, scaling, dropout, p, module_dropout = parts
    return lora_linear_unchecked(x, dropout(x) if module_dropout else None, weight, bias, lora_a, lora_b, scaling, p)


def project(owner: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x), through ops.lora_linear when layer is a plain PEFT LoRA Linear; counted on `owner`'s patch. Under
    torch.compile PEFT's forward is traced as it is: the compiler decides what to save."""
    if torch.compiler.is_compiling():
        return layer(x)
    parts = lora_parts(layer, x)
    if parts is None:
        if is_peft_lora_linear(layer):
            count(owner, "lora_peft")
        return layer(x)
    count(owner, "lora_fused")
    return fused_lora(x, parts)


def _projection_forward(layer, owner, x, *args, **kwargs):
    """Instance forward of a PEFT LoRA Linear for the length of one patched attention call."""
    parts = None if (args or kwargs) else lora_parts(layer, x)
    if parts is None:
        count(owner, "lora_peft")
        return type(layer).forward(layer, x, *args, **kwargs)
    count(owner, "lora_fused")
    return fused_lora(x, parts)


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def with_lora_projections(fn: Callable, names=ATTENTION_PROJECTIONS) -> Callable:
    """Wrap a module's forward (an attention's, by default its q/k/v/o; or an MLP's, given its projection names) so
    that, during the call, its PEFT LoRA projections run through ops.lora_linear. HF's bodies call them as modules,
    so each gets a temporary instance forward, removed right after (nothing persists: deepcopy, revert and PEFT see
    the plain modules). Eager only: under torch.compile the body runs unchanged."""
    names = tuple(names)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(self, *args, **kwargs)
        installed = []
        for name in names:
            child = self._modules.get(name)
            if is_peft_lora_linear(child) and "forward" not in child.__dict__:
                child.__dict__["forward"] = types.MethodType(
                    lambda layer, x, *a, _owner=self, **k: _projection_forward(layer, _owner, x, *a, **k), child)
                installed.append(child)
        try:
            return fn(self, *args, **kwargs)
        finally:
            for child in installed:
                child.__dict__.pop("forward", None)
    return forward


def share_counters(st, module: torch.nn.Module, calls: dict) -> None:
    """Let `module`'s patched forward count its LoRA calls ("lora_fused" / "lora_peft") into `calls`, a dict the
    patch state holds (a deep copy keeps the pairing)."""
    st.set(module, CALLS_ATTR, calls)
