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
- Without autocast, fp32 adapters on a bf16 model (a plain PyTorch loop) compute the LoRA branch in fp32;
  ``LoRALinearUpcastFunction`` does that from fp32 row chunks it re-creates in the backward, instead of PEFT's
  fp32 copy of every input kept for the backward.
- With LoRA dropout (ms-swift's default is 0.05) it draws the dropout itself. On a 16-bit x (in % 8 == 0, r <= 64,
  Triton) the keep decisions come from a seed inside the rank-r products (ops/lora_dropout_kernel.py): dropout(x)
  is never written and nothing but the seed is kept; ~10 instead of ~29 bytes moved per element of x per step.
  Elsewhere it keeps the mask as bits (ops/dropout_mask_kernel.py): autograd's dropout would keep a bool mask and
  the LoRA branch the dropped-out input, 3 bytes per bf16 element; here 1/8 byte, and the backward re-applies the
  mask to x.

- Launches: the rank-r product writes the LoRA output and the base GEMM adds into it in its epilogue (``addmm_``,
  beta=1; BASE_EPILOGUE below), the backward scales the rank-r products rather than a [N, out] copy of the gradient,
  and the adapter casts the forward made are kept for the backward. With autograd off (the first pass of a reentrant
  checkpoint, ms-swift's set-up on one GPU) the op is a plain function: same values and same dropout draws, no mask
  bits, no autograd record.

- QLoRA: the base weight may be a :class:`DequantizedWeight` (4-bit NF4 from bitsandbytes, wrapped by the patcher).
  It is dequantized for the forward matmul and again for the input gradient, as bitsandbytes' own matmul does for
  training-sized inputs, and dropped after each: the 16-bit weight never stays alive between them.

- FP8 bases: the base weight may be an :class:`~.fp8_linear_op.Fp8Weight` (e4m3 rows + row scales); the base
  product and its input gradient are then FP8 GEMMs (fp8_linear_op), the LoRA branch stays in the compute dtype.

Shapes: x, x_lora [..., in]; weight [out, in] (frozen: gets no gradient; a tensor, DequantizedWeight or Fp8Weight); bias
[out] or None (frozen); lora_a [r, in]; lora_b [out, r]; scaling a Python float. Pure op: no PEFT, transformers or
bitsandbytes import.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import _common, lora_dropout_kernel
from .dropout_mask_kernel import masked_scale, pack_mask
from .fp8_linear_op import Fp8Weight, fp8_input_grad, fp8_matmul


class DequantizedWeight:
    """A frozen [out, in] base weight stored compressed: ``get()`` returns it as a ``dtype`` tensor on ``device``,
    made anew at each call. For Llama-3-8B's MLP projections in bf16 that is 112 MiB while one matmul runs, instead
    of 16-bit copies of every layer's weights kept for the backward."""
    __slots__ = ("get", "shape", "dtype", "device")
    requires_grad = False

    def __init__(self, get, shape, dtype: torch.dtype, device: torch.device):
        self.get, self.shape, self.dtype, self.device = get, torch.Size(shape), dtype, device

    def dim(self) -> int:
        return len(self.shape)


def _dense(weight) -> torch.Tensor:
    return weight.get() if isinstance(weight, DequantizedWeight) else weight


def _base_linear(x: torch.Tensor, weight, bias) -> torch.Tensor:
    """x W^T + bias in x's dtype: an FP8 GEMM for an Fp8Weight, else F.linear on the (dequantized) weight."""
    if isinstance(weight, Fp8Weight):
        return fp8_matmul(x, weight, x.dtype, bias)
    return F.linear(x, _dense(weight), bias)


def _base_input_grad(g: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """g W in `dtype` ([N, out] -> [N, in]), weight as _saved_weight returns it."""
    if isinstance(weight, Fp8Weight):
        return fp8_input_grad(g, weight, dtype)
    return g.to(dtype) @ weight.to(dtype)


def _save_weight(ctx, weight):
    """The tensor to save for the backward (None for a DequantizedWeight, which stays on ctx and is re-made, and for
    an Fp8Weight, kept on ctx as it is: a saved-tensor hook, such as offloaded checkpoints', would copy it out)."""
    if isinstance(weight, (DequantizedWeight, Fp8Weight)):
        ctx.qweight = weight
        return None
    ctx.qweight = None
    return weight


def _saved_weight(ctx, saved):
    """The base weight for the input gradient: a tensor, or the Fp8Weight itself (_base_input_grad takes both)."""
    if ctx.qweight is None:
        return saved
    return ctx.qweight if isinstance(ctx.qweight, Fp8Weight) else _dense(ctx.qweight)


def _compute_dtype(x: torch.Tensor, param: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, param) computes in here: autocast's when it is on for x's device, else the
    promotion of the two."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(x.dtype, param.dtype)


# True writes the LoRA output (and the bias) first and lets the base GEMM add into it in its epilogue (cuBLAS
# beta=1), instead of a K=r GEMM after the base one that reads and writes the [N, out] output again: ~0.8 GB less
# traffic per layer pass at Qwen2.5-7B, 8k tokens, the epilogue's read hidden behind the GEMM's maths. Measured
# through the `swift sft` CLI on an H100 (docs/benchmarks/train_cli_grid_h100.md, LoRA r16, 1 x 8192 tokens, same
# call): Qwen2.5-7B 10549 vs 10379 tok/s (+1.6%; a layer's forward 6.82 vs 7.24 ms GPU), Llama-3-8B 9552 vs 9395
# (+1.7%). The launch count is the same (host-bound shapes not timed with it). SWIFT_LIGER_LORA_BASE_EPILOGUE=0 adds
# the LoRA output after the base GEMM instead (the A/B switch; the two orders round differently, both once per GEMM).
BASE_EPILOGUE = os.environ.get("SWIFT_LIGER_LORA_BASE_EPILOGUE", "1").strip() != "0"


def _lora_then_base(x: torch.Tensor, weight, bias, a: torch.Tensor, lora_b: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """x W^T + bias + scaling * a lora_b^T in x's dtype ([..., in] -> [..., out]; a: [..., r] in x's dtype): the
    rank-r product with the bias first, then the base product accumulated onto it in one GEMM (beta=1)."""
    dt = x.dtype
    a2 = a.reshape(-1, a.shape[-1])
    b_t = lora_b.to(dt).t()
    if bias is not None:
        y = torch.addmm(bias.to(dt), a2, b_t, alpha=scaling)
    else:   # beta=0: y's uninitialised values are never read
        y = a2.new_empty((a2.shape[0], b_t.shape[1])).addmm_(a2, b_t, beta=0, alpha=scaling)
    y.addmm_(x.reshape(-1, x.shape[-1]), _dense(weight).to(dt).t())
    return y.view(*x.shape[:-1], y.shape[-1])


def _add_lora_out(y: torch.Tensor, a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
    """y += scaling * a @ lora_b^T in place, as one GEMM whose epilogue adds (y: a fresh contiguous [..., out]; a:
    [..., r] in y's dtype): PEFT's separate matmul, scale and add round after each; this rounds once."""
    y.view(-1, y.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), lora_b.to(a.dtype).t(), alpha=scaling)


def _forward_no_grad(x, x_lora, weight, bias, lora_a, lora_b, scaling: float, dropout_p: float) -> torch.Tensor:
    """The forward with autograd off (a reentrant checkpoint's first pass, evaluation, generation): nothing is saved,
    so no mask bits; the dropout draws what LoRALinearFunction draws (a seed for lora_dropout_kernel, or
    torch.native_dropout), so a recompute that restores the RNG state reproduces it."""
    if dropout_p > 0 and lora_dropout_kernel.applies(x, lora_a):   # the draws the autograd path makes, from x
        a = lora_dropout_kernel.lora_down(x.view(-1, x.shape[-1]), lora_a.to(x.dtype),
                                          lora_dropout_kernel.dropout_seed(x.device), dropout_p)
    else:
        if dropout_p > 0:
            x_lora = torch.native_dropout(x, dropout_p, True)[0]
        a = F.linear(x_lora, lora_a)
    if BASE_EPILOGUE and not isinstance(weight, Fp8Weight):
        return _lora_then_base(x, weight, bias, a, lora_b, scaling)
    y = _base_linear(x, weight, bias)
    _add_lora_out(y, a, lora_b, scaling)
    return y


class LoRALinearFunction(torch.autograd.Function):
    """x_lora given (dropout_p == 0): saved as it is. dropout_p > 0 (x_lora None): where lora_dropout_kernel applies
    (16-bit x) a seed is drawn and kept, and every product with dropout(x) re-draws the decisions inside the kernel.
    Otherwise the dropout is drawn with ``torch.native_dropout`` (what ``nn.Dropout`` runs on CUDA; PEFT drops out
    an fp32 copy of x, which on CPU gives the same draws, and on CUDA may not), only its mask is kept, as bits, and
    the backward re-applies it to x: for dropout 0.05 on a bf16 input, 1/8 byte per element saved instead of 3 (a
    bool mask and the dropped-out copy)."""

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling, dropout_p):
        cdt = x.dtype                                 # both products' compute dtype (lora_linear_problem)
        a_c, b_c = lora_a.to(cdt), lora_b.to(cdt)     # the casts autocast would make, kept for the backward
        bits = None
        ctx.seeded = dropout_p > 0 and lora_dropout_kernel.applies(x, lora_a)
        if ctx.seeded:   # the dropout drawn inside the products, re-drawn in the backward from the seed: no mask
            bits = lora_dropout_kernel.dropout_seed(x.device)
            a = lora_dropout_kernel.lora_down(x.view(-1, x.shape[-1]), a_c, bits, dropout_p)
        else:
            if dropout_p > 0:
                x_lora, mask = torch.native_dropout(x, dropout_p, True)
                bits = pack_mask(mask)
                del mask
            a = F.linear(x_lora, a_c)                 # [..., r]
        if BASE_EPILOGUE and not isinstance(weight, Fp8Weight):
            y = _lora_then_base(x, weight, bias, a, b_c, scaling)
        else:
            y = _base_linear(x, weight, bias)
            _add_lora_out(y, a, b_c, scaling)
        ctx.base_dtype = y.dtype                      # the base matmul's compute dtype
        ctx.save_for_backward(x if bits is not None else x_lora, bits, a, _save_weight(ctx, weight), a_c, b_c)
        ctx.adapter_dtypes = lora_a.dtype, lora_b.dtype
        ctx.scaling = scaling
        ctx.keep_scale = 1.0 / (1.0 - dropout_p)
        ctx.dropout_p = dropout_p
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        _common.bind_cuda_context(dy)
        x_saved, bits, a, weight, a_c, b_c = ctx.saved_tensors   # a_c, b_c: the adapters in the compute dtype
        s = ctx.scaling
        a_dtype, b_dtype = ctx.adapter_dtypes
        cdt = a.dtype                                 # the LoRA branch's compute dtype in the forward
        g = dy.reshape(-1, dy.shape[-1])
        a2 = a.reshape(-1, a.shape[-1])
        g_c = g.to(cdt)                               # gradient at B's output is s * g: s is applied to the
        dx = dx_lora = da_w = db_w = None             # rank-r products, not to a [N, out] copy of g
        da = torch.mm(g_c, b_c).mul_(s)               # [N, r]
        if ctx.needs_input_grad[4]:
            if ctx.seeded:                            # bits: the seed; dropout(x) re-drawn inside the product
                da_w = lora_dropout_kernel.lora_down_weight_grad(x_saved.view(-1, x_saved.shape[-1]), da, bits,
                                                                 ctx.dropout_p).to(a_dtype)
            else:
                x_lora = x_saved if bits is None else masked_scale(x_saved, bits, ctx.keep_scale)
                da_w = (da.t() @ x_lora.reshape(-1, x_lora.shape[-1]).to(cdt)).to(a_dtype)
                del x_lora
        lora_in_grad = ctx.needs_input_grad[1] or (bits is not None and ctx.needs_input_grad[0])
        if lora_in_grad and ctx.seeded:
            dx_lora = lora_dropout_kernel.lora_down_input_grad(da, a_c, bits, ctx.dropout_p, ctx.x_dtype)
        elif lora_in_grad:
            dx_lora = (da @ a_c).to(ctx.x_dtype if bits is not None else x_saved.dtype)
            if bits is not None:                      # through the dropout: same mask, same scale
                masked_scale(dx_lora, bits, ctx.keep_scale, out=dx_lora)
        if ctx.needs_input_grad[0]:
            bdt = ctx.base_dtype
            weight = _saved_weight(ctx, weight)
            if bits is not None and dx_lora.dtype == bdt and not isinstance(weight, Fp8Weight):
                dx = dx_lora.addmm_(g.to(bdt), weight.to(bdt))   # in place: one [N, in] buffer, not two
                dx_lora = None
            else:
                dx = _base_input_grad(g, weight, bdt).to(ctx.x_dtype)
                if bits is not None:
                    dx = dx.add_(dx_lora)                 # dx is a fresh buffer
                    dx_lora = None
            dx = dx.reshape(*dy.shape[:-1], weight.shape[1])
        if dx_lora is not None:
            dx_lora = dx_lora.reshape(x_saved.shape)
        if ctx.needs_input_grad[5]:
            db_w = torch.mm(g_c.t(), a2).to(b_dtype).mul_(s)
        return dx, dx_lora, None, None, da_w, db_w, None, None


# Rows per chunk of the upcast path: its fp32 copies of x (or of the input gradient) stay under ~256 MiB
# (4680 rows at 14336 features: 2 chunks at 8k tokens). A multiple of 8, so a chunk's dropout bits start on a
# byte. 64 MiB chunks cost the 8B loop 5% in launches (6219 tok/s, against 6559 with 256 MiB; two calls).
CHUNK_BYTES = 256 << 20


def _chunk_rows(features: int) -> int:
    return max(8, (CHUNK_BYTES // (4 * max(1, features))) // 8 * 8)


class LoRALinearUpcastFunction(torch.autograd.Function):
    """The LoRA branch in its adapters' wider dtype (fp32 adapters on a bf16 model, no autocast: a plain PyTorch
    loop, or a Trainer without bf16 mixed precision). PEFT then keeps an fp32 copy of every input (and of its
    dropout output) for the backward. This keeps x as it is plus the dropout bits, and re-creates the fp32 rows
    chunk by chunk, so an fp32 copy of at most ``CHUNK_BYTES`` exists at a time. Same maths as PEFT:
    y = (fp32(x W^T + b) + s * (fp32(dropout(x)) A^T) B^T) rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, dropout_p):
        ldt = lora_a.dtype
        n_in, n_out = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, n_in)
        bits = None
        if dropout_p > 0:
            _, mask = torch.native_dropout(x2, dropout_p, True)
            bits = pack_mask(mask)
            del mask, _
        keep_scale = 1.0 / (1.0 - dropout_p)
        rows = _chunk_rows(max(n_in, n_out))
        y = _base_linear(x2, weight, bias)
        a = torch.empty(x2.shape[0], lora_a.shape[0], dtype=ldt, device=x.device)
        for c0 in range(0, x2.shape[0], rows):
            c1 = min(c0 + rows, x2.shape[0])
            xc = _lora_rows(x2, bits, c0, c1, keep_scale, ldt)
            torch.mm(xc, lora_a.t(), out=a[c0:c1])
            y[c0:c1] = (F.linear(a[c0:c1], lora_b) * scaling).add_(y[c0:c1]).to(y.dtype)
        ctx.save_for_backward(x, bits, a, _save_weight(ctx, weight), lora_a, lora_b)
        ctx.scaling, ctx.keep_scale, ctx.rows = scaling, keep_scale, rows
        return y.reshape(*x.shape[:-1], n_out)

    @staticmethod
    def backward(ctx, dy):
        _common.bind_cuda_context(dy)
        x, bits, a, weight, lora_a, lora_b = ctx.saved_tensors
        s, ldt, rows = ctx.scaling, lora_a.dtype, ctx.rows
        n_in = x.shape[-1]
        x2 = x.reshape(-1, n_in)
        g = dy.reshape(-1, dy.shape[-1])
        dx = _base_input_grad(g, _saved_weight(ctx, weight), g.dtype) if ctx.needs_input_grad[0] else None
        da_w = torch.zeros_like(lora_a) if ctx.needs_input_grad[3] else None
        db_w = torch.zeros_like(lora_b) if ctx.needs_input_grad[4] else None
        for c0 in range(0, g.shape[0], rows):
            c1 = min(c0 + rows, g.shape[0])
            gc = g[c0:c1].to(ldt) * s                          # gradient at B's output, fp32 as in PEFT
            if db_w is not None:
                db_w.addmm_(gc.t(), a[c0:c1])
            da = gc @ lora_b                                   # [rows, r]
            del gc
            if da_w is not None:
                da_w.addmm_(da.t(), _lora_rows(x2, bits, c0, c1, ctx.keep_scale, ldt))
            if dx is not None:
                dxl = da @ lora_a                              # [rows, in], fp32
                if bits is not None:
                    masked_scale(dxl, _bits_rows(bits, c0, c1, n_in), ctx.keep_scale, out=dxl)
                dx[c0:c1] += dxl.to(dx.dtype)
        if dx is not None:
            dx = dx.reshape(x.shape)
        return dx, None, None, da_w, db_w, None, None


def _bits_rows(bits, c0, c1, n_in):
    return bits[c0 * n_in // 8:(c1 * n_in + 7) // 8]


def _lora_rows(x2, bits, c0, c1, keep_scale, dtype):
    """Rows c0:c1 of dropout(x) in `dtype` (fp32), re-created from x and the bits."""
    if bits is None:
        return x2[c0:c1].to(dtype)
    out = torch.empty(c1 - c0, x2.shape[1], dtype=dtype, device=x2.device)
    return masked_scale(x2[c0:c1], _bits_rows(bits, c0, c1, x2.shape[1]), keep_scale, out=out)


def lora_linear_reference(x, x_lora, weight, bias, lora_a, lora_b, scaling):
    """The same maths with autograd doing the backward (what PEFT computes, minus its dtype round trips)."""
    base = weight.dequantize() if isinstance(weight, Fp8Weight) else _dense(weight)
    return F.linear(x, base, bias) + F.linear(F.linear(x_lora, lora_a), lora_b) * scaling


def lora_linear_problem(x: torch.Tensor, x_lora: Optional[torch.Tensor], weight: torch.Tensor,
                        bias: Optional[torch.Tensor], lora_a: torch.Tensor, lora_b: torch.Tensor,
                        dropout_p: float = 0.0) -> Optional[str]:
    """Why :func:`lora_linear` would refuse these arguments (None: it runs them). The one place that decides, used
    by lora_linear itself and by the patcher, which falls back to PEFT's forward where this says no."""
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        return f"dropout_p must be a number in [0, 1), got {dropout_p!r}"
    if dropout_p > 0:
        if x_lora is not None:
            return "x_lora must be None when dropout_p > 0 (the dropout is drawn inside)"
        if not x.is_contiguous():
            return f"x must be contiguous when dropout_p > 0, got strides {x.stride()}"
    x_lora_checked = x if x_lora is None else x_lora
    if x_lora_checked.shape != x.shape:
        return f"x_lora must have x's shape {tuple(x.shape)}, got {tuple(x_lora_checked.shape)}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return f"weight must be [out, {x.shape[-1]}], got {tuple(weight.shape)}"
    if lora_a.dim() != 2 or lora_a.shape[1] != x.shape[-1]:
        return f"lora_a must be [r, {x.shape[-1]}], got {tuple(lora_a.shape)}"
    if lora_b.dim() != 2 or lora_b.shape != (weight.shape[0], lora_a.shape[0]):
        return f"lora_b must be [{weight.shape[0]}, {lora_a.shape[0]}], got {tuple(lora_b.shape)}"
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "lora_linear needs a frozen base weight and bias (requires_grad=False)"
    if not torch.is_autocast_enabled(x.device.type) and weight.dtype != x.dtype:
        return f"weight has dtype {weight.dtype} but x has {x.dtype}; without autocast they must match"
    if _compute_dtype(x, weight) != x.dtype:
        return f"the base matmul would compute in {_compute_dtype(x, weight)}, not in x's dtype {x.dtype}"
    cdt = _compute_dtype(x_lora_checked, lora_a)
    if cdt != x.dtype:
        if not upcast_applies(x, weight, lora_a, x_lora):
            return (f"the LoRA branch would compute in {cdt}, not in x's dtype {x.dtype} (only fp32 adapters on a "
                    f"bf16/fp16 x without autocast, with x_lora None, are supported)")
        if not x.is_contiguous():
            return f"x must be contiguous for fp32 adapters on a {x.dtype} input, got strides {x.stride()}"
    return None


def lora_linear(x: torch.Tensor, x_lora: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dropout_p: float = 0.0) -> torch.Tensor:
    """y = x W^T + bias + scaling * (x_lora A^T) B^T with W and bias frozen; see the module docstring.

    ``dropout_p`` in (0, 1): x_lora = dropout(x) drawn inside (x_lora must be None; x contiguous), keeping the mask
    as bits instead of the dropped-out copy.

    fp32 adapters on a bf16/fp16 x without autocast (x_lora None, x contiguous) run the LoRA branch in fp32
    through LoRALinearUpcastFunction, as PEFT does.

    Raises ValueError (the reason :func:`lora_linear_problem` gives) when the shapes do not chain, when W or bias
    require grad, when dropout_p is out of [0, 1), when W's dtype differs from x's without autocast, when the base
    matmul would compute in another dtype than x's, or when the LoRA branch would in any set-up but the one above.
    """
    problem = lora_linear_problem(x, x_lora, weight, bias, lora_a, lora_b, dropout_p)
    if problem:
        raise ValueError(problem)
    return lora_linear_unchecked(x, x_lora, weight, bias, lora_a, lora_b, scaling, dropout_p)


def lora_linear_unchecked(x, x_lora, weight, bias, lora_a, lora_b, scaling: float, dropout_p: float = 0.0):
    """:func:`lora_linear` for arguments :func:`lora_linear_problem` has accepted (no checks: the per-call host work
    of a patched projection stays one check)."""
    if _compute_dtype(x if x_lora is None else x_lora, lora_a) != x.dtype:
        return LoRALinearUpcastFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling), float(dropout_p))
    if dropout_p == 0 and x_lora is None:
        x_lora = x
    if not torch.is_grad_enabled():
        return _forward_no_grad(x, x_lora, weight, bias, lora_a, lora_b, float(scaling), float(dropout_p))
    return LoRALinearFunction.apply(x, x_lora, weight, bias, lora_a, lora_b, float(scaling), float(dropout_p))


def upcast_applies(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, x_lora=None) -> bool:
    """True for the set-up LoRALinearUpcastFunction covers: a 16-bit x and base weight, fp32 adapters, no autocast."""
    return (x_lora is None and not torch.is_autocast_enabled(x.device.type)
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and lora_a.dtype == torch.float32)
