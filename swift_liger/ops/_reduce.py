"""Column sums of per-program fp32 partials, written in the gradient's dtype: the last step of the backward kernels
that keep one weight-gradient partial per program (rms_norm, qk_norm_rope). One launch instead of torch's
``part.sum(0).to(dtype)`` (a reduction and a cast: 7.2-7.6 µs of the 28 µs RMSNorm fwd+bwd at 1024x1024 on the
H200, docs/benchmarks/rms_lab_h200.md; with this kernel and rms_norm's smaller grid that fwd+bwd takes 15 µs).

Pure kernel module: no transformers / ms-swift imports.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch


@triton.jit(do_not_specialize=["P"])
def _column_sum_kernel(part_ptr, out0_ptr, out1_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid: (cdiv(N, BLOCK_N), G). part: [G, P, N] fp32, contiguous; group 0 sums into out0 [N], group 1 into
    out1 [N] (G <= 2), each stored in its pointer's dtype."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    base = part_ptr + g.to(tl.int64) * P * N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(base + rows[:, None].to(tl.int64) * N + cols[None, :],
                       mask=(rows[:, None] < P) & cmask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    if g == 0:
        tl.store(out0_ptr + cols, total.to(out0_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out1_ptr + cols, total.to(out1_ptr.dtype.element_ty), mask=cmask)


@dataclasses.dataclass(frozen=True)
class ColumnSumConfig:
    """Launch of _column_sum_kernel: block_p (BLOCK_P) partial rows and block_n (BLOCK_N) columns per step, so a
    program reads [block_p, block_n] fp32 per loop step; num_warps."""
    block_p: int
    block_n: int
    num_warps: int


LAUNCH_CONFIGS = {None: ColumnSumConfig}


def launch_config(P: int, N: int, device) -> ColumnSumConfig:
    """32 columns per program (128-byte rows of fp32), all partial rows in one step up to 256 of them (a
    persistent backward has 1-8 per SM), 4 warps, 8 from 4096 elements per step. The same on every device;
    the interpreter takes at most 64 rows per step."""
    block_n = min(32, _common.next_pow2(max(1, N)))
    block_p = min(64 if device.type != "cuda" else 256, _common.next_pow2(max(1, P)))
    cfg = ColumnSumConfig(block_p, block_n, 8 if block_p * block_n >= 4096 else 4)
    return _common.apply_override(__name__, None, cfg)


_COLUMN_SUM = _launch.FastLaunch(_column_sum_kernel)


def column_sums(part: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor = None) -> None:
    """part [G, P, N] (or [P, N] for G = 1) fp32 contiguous -> out0 = part[0].sum(0), out1 = part[1].sum(0), each
    [N] contiguous, stored in its own dtype (one launch)."""
    part3 = part if part.dim() == 3 else part.unsqueeze(0)
    G, P, N = part3.shape
    if N == 0:
        return
    cfg = launch_config(P, N, part.device)
    _COLUMN_SUM.launch(
        (_common.cdiv(N, cfg.block_n), G), part3, out0, out0 if out1 is None else out1, P, N, BLOCK_P=cfg.block_p,
        BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
