"""A dropout mask kept as bits, and the masked scale that re-applies it.

Autograd's dropout keeps a bool mask (1 byte per element) and the LoRA branch keeps the dropped-out input
(2 bytes per bf16 element) for the backward. Kept as bits, the mask is 1/8 byte per element: for Llama-3-8B at 8k
tokens the down projection's input (8128 x 14336) costs 14 MiB instead of 111 MiB (mask) + 222 MiB (input).

    bits = pack_mask(mask)                  mask: bool [...], contiguous -> uint8 [ceil(numel / 8)]
    out  = masked_scale(t, bits, scale)     t: [...] (mask's numel) -> t * mask * scale, t's dtype and shape

Element i of the flattened mask is bit (i % 8) of byte i // 8. ``masked_scale`` computes ``t * scale`` in fp32 and
rounds once, as torch's CUDA dropout kernel does, so ``masked_scale(x, pack_mask(m), 1 / (1 - p))`` reproduces
``torch.native_dropout``'s output bit for bit on the GPU. Both read and write each byte once: pack moves 1.125
bytes per element, masked_scale 2 x t's element size + 1/8.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch


@dataclasses.dataclass(frozen=True)
class DropoutMaskConfig:
    """Launch of _pack_kernel (block: BLOCK, output bytes per program, 8 mask elements each) or _masked_scale_kernel
    (block: BLOCK, elements per program); num_warps."""
    block: int
    num_warps: int


LAUNCH_CONFIGS = {"pack": DropoutMaskConfig, "scale": DropoutMaskConfig}


def launch_config(kind: str, n: int, device) -> DropoutMaskConfig:
    """``kind`` "pack" (1024 bytes = 8192 mask elements a program) or "scale" (4096 elements a program) for n
    elements, 4 warps; every shape and device."""
    if kind == "pack":
        cfg = DropoutMaskConfig(1024, 4)
    elif kind == "scale":
        cfg = DropoutMaskConfig(4096, 4)
    else:
        raise ValueError(f"kind must be 'pack' or 'scale', got {kind!r}")
    return _common.apply_override(__name__, kind, cfg)


@triton.jit
def _pack_kernel(mask_ptr, bits_ptr, n, n_bytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                            # > 2^31 elements at long contexts
    byte = pid * BLOCK + tl.arange(0, BLOCK)                       # [BLOCK]
    bit = tl.arange(0, 8)                                          # [8]
    idx = byte[:, None] * 8 + bit[None, :]                         # [BLOCK, 8]
    m = tl.load(mask_ptr + idx, mask=idx < n, other=0).to(tl.int32)
    packed = tl.sum(m << bit[None, :], axis=1)                     # distinct bits: the sum is an OR
    tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _masked_scale_kernel(t_ptr, bits_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    t = tl.load(t_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    b = tl.load(bits_ptr + (offs >> 3), mask=inb, other=0).to(tl.int32)
    keep = ((b >> (offs & 7)) & 1) != 0
    out = tl.where(keep, t * scale, 0.0)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inb)


_PACK = _launch.FastLaunch(_pack_kernel)
_SCALE = _launch.FastLaunch(_masked_scale_kernel)


def _check_mask(mask: torch.Tensor) -> None:
    _common.check_tensor("mask", mask, dtypes=(torch.bool,))
    if not mask.is_contiguous():
        raise ValueError(f"mask must be contiguous, got strides {mask.stride()} for shape {tuple(mask.shape)}")


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool mask -> uint8 bits, ceil(numel / 8) bytes (see the module docstring for the bit order)."""
    _check_mask(mask)
    n = mask.numel()
    n_bytes = (n + 7) // 8
    if not _common.use_triton(mask):
        flat = torch.zeros(n_bytes * 8, dtype=torch.uint8, device=mask.device)
        flat[:n] = mask.reshape(-1)
        shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
        return (flat.view(n_bytes, 8) << shifts).sum(1, dtype=torch.uint8)
    bits = torch.empty(n_bytes, dtype=torch.uint8, device=mask.device)
    if n:
        cfg = launch_config("pack", n, mask.device)
        _PACK.launch((triton.cdiv(n_bytes, cfg.block),), mask.view(torch.uint8), bits, n, n_bytes, BLOCK=cfg.block,
                     num_warps=cfg.num_warps)
    return bits


def masked_scale(t: torch.Tensor, bits: torch.Tensor, scale: float, *, out: torch.Tensor = None) -> torch.Tensor:
    """t * mask * scale with the mask read from ``bits``; into ``out`` when given (``out=t`` works in place; a
    wider ``out``, e.g. fp32 for a bf16 t, gets the product unrounded)."""
    _common.check_tensor("t", t)
    _common.check_tensor("bits", bits, ndim=1, dtypes=(torch.uint8,))
    if not t.is_contiguous():
        raise ValueError(f"t must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    n = t.numel()
    if bits.numel() != (n + 7) // 8:
        raise ValueError(f"bits must hold {(n + 7) // 8} bytes for t's {n} elements, got {bits.numel()}")
    _common.check_same_device(t=t, bits=bits)
    if out is None:
        out = torch.empty_like(t)
    elif out.shape != t.shape or out.dtype not in _common.FLOAT_DTYPES or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float tensor of shape {tuple(t.shape)}")
    if not _common.use_triton(t):
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        keep = ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].view(t.shape).bool()
        return out.copy_(torch.where(keep, t.float() * scale, 0.0))
    if n:
        cfg = launch_config("scale", n, t.device)
        _SCALE.launch((triton.cdiv(n, cfg.block),), t, bits, out, n, float(scale), BLOCK=cfg.block,
                      num_warps=cfg.num_warps)
    return out
