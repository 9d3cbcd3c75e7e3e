"""out = src * scale with fp32 math, stored in out's dtype (in place when out is src): how the loss ops fold the
incoming gradient into gradients they computed ahead of the backward (fused linear cross-entropy's dW and dh).

torch's ``bf16.mul_(fp32 0-d tensor)`` takes the unvectorised mixed-dtype elementwise path: on the H200 it scaled
the 1 GB bf16 dW of the Llama-3-8B head at 0.9 TB/s (2.4 ms of a 42.7 ms linear+CE with ``accumulate_lowp``,
docs/benchmarks/flce_lab_h200.md); this kernel moves the same 2 GB at the copy rate (~0.5 ms).

Pure kernel module: no transformers / ms-swift imports.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch


@triton.jit
def _scale_kernel(src_ptr, scale_ptr, out_ptr, n, n_cols, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (cdiv(n, BLOCK),). src, out: n contiguous elements ([rows, n_cols] when PER_ROW); scale: fp32, one
    value, or one per row when PER_ROW."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        s = tl.load(scale_ptr + offs // n_cols, mask=mask, other=0.0)
    else:
        s = tl.load(scale_ptr)
    tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """Launch of _scale_kernel: block (BLOCK) elements per program, num_warps."""
    block: int
    num_warps: int


LAUNCH_CONFIGS = {None: ScaleConfig}


def launch_config(n: int, device) -> ScaleConfig:
    """4096 elements and 8 warps per program (16 per thread: two 16-byte bf16 vectors); the interpreter takes 16384
    (a handful of programs)."""
    cfg = ScaleConfig(4096, 8) if device.type == "cuda" else ScaleConfig(16384, 4)
    return _common.apply_override(__name__, None, cfg)


_SCALE = _launch.FastLaunch(_scale_kernel)


def scale_into(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = src * scale (fp32 math, rounded once to out's dtype); returns out.

    src, out: the same shape, contiguous (out may be src). scale: fp32, 0-d (or one element), or [rows] for a
    [rows, ...] src: one factor per row.
    """
    if src.shape != out.shape or not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"scale_into: src and out must be contiguous and of one shape, got {tuple(src.shape)} "
                         f"and {tuple(out.shape)}")
    per_row = scale.numel() != 1
    if per_row and (src.dim() == 0 or scale.numel() != src.shape[0]):
        raise ValueError(f"scale_into: scale must have 1 or {src.shape[0] if src.dim() else 1} elements, got "
                         f"{scale.numel()}")
    n = src.numel()
    if n == 0:
        return out
    scale = scale.reshape(-1)
    if scale.dtype != torch.float32:
        scale = scale.float()
    n_cols = n // src.shape[0] if per_row else 1   # per_row: src has rows, one factor each
    cfg = launch_config(n, src.device)
    _SCALE.launch((_common.cdiv(n, cfg.block),), src, scale, out, n, n_cols, PER_ROW=per_row, BLOCK=cfg.block,
                  num_warps=cfg.num_warps)
    return out
