"""LoRA linear over a frozen base weight that keeps no extra copy of its input.

    y = x @ W^T (+ bias) + scaling * (x_lora @ A^T) @ B^T        x_lora = x, or dropout(x)

What it saves, compared with PEFT's ``lora.Linear`` (fp32 adapters on a bf16 model, the default PEFT set-up):
- PEFT casts the input to the adapter dtype (an fp32 copy, 2x the input's bytes). Under autocast, ``lora_A``
  re-casts it to bf16 and keeps that copy for its backward. In the backward the input gradient of the LoRA
  branch comes back as fp32, and is cast down again before it joins the base gradient.
- This op runs the same matmuls in the same compute dtype (autocast's, or the parameters'), so numerics do not
  change. It keeps only references to ``x`` / ``x_lora`` and the rank-r activation ``x_lora @ A^T``, and its
  backward goes straight to the compute dtype: it skips the fp32 input copy, the second bf16 copy and the fp32
  gradient.
- For the Llama-3-8B MLP at 8k tokens, the down projection's fp32 input copy and its fp32 gradient are
  448 MiB each.
- With LoRA dropout (ms-swift's default is 0.05) it draws the dropout itself and keeps the mask as bits
  (ops/dropout_mask.py): autograd's dropout would keep a bool mask and the LoRA branch the dropped-out input,
  3 bytes per bf16 element; here 1/8 byte, and the backward re-applies the mask to x.

Shapes: x, x_lora [..., in]; weight [out, in] (frozen: gets no gradient); bias [out] or None (frozen);
lora_a [r, in]; lora_b [out, r]; scaling a Python float. Pure op: no PEFT or transformers import.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dropout_mask import masked_scale, pack_mask


def _compute_dtype(x: torch.Tensor, param: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, param) computes in here: autocast's when it is on for x's device, else the
    promotion of the two."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(x.dtype, param.dtype)


class LoRALinearFunction(torch.autograd.Function):
    """x_lora given (dropout_p == 0): saved as it is. dropout_p > 0 (x_lora None): the dropout is drawn here with
    ``torch.native_dropout`` (what ``nn.Dropout`` runs on CUDA, so the same random stream), only its mask is kept,
    as bits, and the backward re-applies it to x: for dropout 0.05 on a bf16 input, 1/8 byte per element saved
    instead of 3 (a bool mask and the dropped-out copy)."""

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling, dropout_p):
        y = F.linear(x, weight, bias)
        ctx.base_dtype = y.dtype                      # the base matmul's compute dtype
        bits = None
        if dropout_p > 0:
            x_lora, mask = torch.native_dropout(x, dropout_p, True)
            bits = pack_mask(mask)
            del mask
        a = F.linear(x_lora, lora_a)                  # [..., r]
        y = y + F.linear(a, lora_b) * scaling
        ctx.save_for_backward(x if bits is not None else x_lora, bits, a, weight, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.keep_scale = 1.0 / (1.0 - dropout_p)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, bits, a, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        cdt = a.dtype                                 # the LoRA branch's compute dtype in the forward
        g = dy.reshape(-1, dy.shape[-1])
        a2 = a.reshape(-1, a.shape[-1])
        d_lora_out = (g * s).to(cdt)                  # gradient at B's output
        dx = dx_lora = da_w = db_w = None
        da = d_lora_out @ lora_b.to(cdt)              # [N, r]
        if ctx.needs_input_grad[4]:
            x_lora = x_saved if bits is None else masked_scale(x_saved, bits, ctx.keep_scale)
            da_w = (da.t() @ x_lora.reshape(-1, x_lora.shape[-1]).to(cdt)).to(lora_a.dtype)
            del x_lora
        lora_in_grad = ctx.needs_input_grad[1] or (bits is not None and ctx.needs_input_grad[0])
        if lora_in_grad:
            dx_lora = (da @ lora_a.to(cdt)).to(ctx.x_dtype if bits is not None else x_saved.dtype)
            if bits is not None:                      # through the dropout: same mask, same scale
                masked_scale(dx_lora, bits, ctx.keep_scale, out=dx_lora)
        if ctx.needs_input_grad[0]:
            bdt = ctx.base_dtype
            if bits is not None and dx_lora.dtype == bdt:
                dx = dx_lora.addmm_(g.to(bdt), weight.to(bdt))   # in place: one [N, in] buffer, not two
                dx_lora = None
            else:
                dx = (g.to(bdt) @ weight.to(bdt)).to(ctx.x_dtype)
                if bits is not None:
                    dx = dx + dx_lora
                    dx_lora = None
            dx = dx.reshape(*dy.shape[:-1], weight.shape[1])
        if dx_lora is not None:
            dx_lora = dx_lora.reshape(x_saved.shape)
        if ctx.needs_input_grad[5]:
            db_w = (d_lora_out.t() @ a2).to(lora_b.dtype)
        return dx, dx_lora, None, None, da_w, db_w, None, None


def lora_linear_reference(x, x_lora, weight, bias, lora_a, lora_b, scaling):
    """The same maths with autograd doing the backward (what PEFT computes, minus its dtype round trips)."""
    return F.linear(x, weight, bias) + F.linear(F.linear(x_lora, lora_a), lora_b) * scaling


def lora_linear(x: torch.Tensor, x_lora: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dropout_p: float = 0.0) -> torch.Tensor:
    """y = x W^T + bias + scaling * (x_lora A^T) B^T with W and bias frozen; see the module docstring.

    ``dropout_p`` in (0, 1): x_lora = dropout(x) drawn inside (x_lora must be None; x contiguous), keeping the mask
    as bits instead of the dropped-out copy.

    Raises ValueError when the shapes do not chain, when W or bias require grad, when dropout_p is out of [0, 1),
    or when the LoRA branch would compute in a dtype other than x's (PEFT would then add an fp32 branch to a bf16
    result; call it instead).
    """
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0:
        if x_lora is not None:
            raise ValueError("x_lora must be None when dropout_p > 0 (the dropout is drawn inside)")
        if not x.is_contiguous():
            raise ValueError(f"x must be contiguous when dropout_p > 0, got strides {x.stride()}")
    x_lora_checked = x if x_lora is None else x_lora
    if x_lora_checked.shape != x.shape:
        raise ValueError(f"x_lora must have x's shape {tuple(x.shape)}, got {tuple(x_lora_checked.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [out, {x.shape[-1]}], got {tuple(weight.shape)}")
    if lora_a.dim() != 2 or lora_a.shape[1] != x.shape[-1]:
        raise ValueError(f"lora_a must be [r, {x.shape[-1]}], got {tuple(lora_a.shape)}")
    if lora_b.dim() != 2 or lora_b.shape != (weight.shape[0], lora_a.shape[0]):
        raise ValueError(f"lora_b must be [{weight.shape[0]}, {lora_a.shape[0]}], got {tuple(lora_b.shape)}")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear needs a frozen base weight and bias (requires_grad=False)")
    if _compute_dtype(x_lora_checked, lora_a) != x.dtype:
        raise ValueError(f"the LoRA branch would compute in {_compute_dtype(x_lora_checked, lora_a)}, not in x's "
                         f"dtype {x.dtype}")
    if dropout_p == 0:
        x_lora = x_lora_checked
    return LoRALinearFunction.apply(x, x_lora, weight, bias, lora_a, lora_b, float(scaling), float(dropout_p))
