"""The transpose of an FP8 weight's codes, for the input-gradient GEMM (fp8_linear_op.fp8_input_grad).

    t = transpose_kernel(q)     q [R, C] 1-byte codes (e4m3 viewed as uint8), contiguous -> t [C, R] contiguous

cuBLASLt's FP8 GEMM on Hopper and Ada takes both operands K-major, so g @ W (K = the weight's out dimension) needs
W's codes transposed once per backward call. torch's ``q.t().contiguous()`` moves 1-byte elements at ~330 GB/s on
an H200 (78 us for 3584 x 3584, 427 us for 18944 x 3584: half the FP8 GEMM it feeds); this kernel moves square
BLOCK x BLOCK byte tiles, each read along rows and written along the transposed rows, 2 bytes of traffic per code
(11 us and 40 us there).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch


@dataclasses.dataclass(frozen=True)
class Fp8TransposeConfig:
    """Launch of _fp8_transpose_kernel: one BLOCK x BLOCK tile of bytes per program."""
    block: int
    num_warps: int


LAUNCH_CONFIGS = {None: Fp8TransposeConfig}


def launch_config(device) -> Fp8TransposeConfig:
    """128 x 128 byte tiles (16 KiB), 8 warps: 64 bytes per thread each way. Every device. H200: 2.3 TB/s at
    3584 x 3584 (11 us) and 3.4 TB/s at 18944 x 3584 (40 us); 64 x 64 tiles with 4 warps ran 1.9 / 2.9 TB/s."""
    return _common.apply_override(__name__, None, Fp8TransposeConfig(128, 8))


@triton.jit
def _fp8_transpose_kernel(src_ptr, dst_ptr, R, C, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    tile = tl.load(src_ptr + r[:, None] * C + c[None, :], mask=(r[:, None] < R) & (c[None, :] < C), other=0)
    tl.store(dst_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=(c[:, None] < C) & (r[None, :] < R))


_TRANSPOSE = _launch.FastLaunch(_fp8_transpose_kernel)


def transpose_kernel(q: torch.Tensor) -> torch.Tensor:
    """See the module docstring: q [R, C] contiguous, 1-byte elements -> its transpose [C, R], same dtype."""
    r, c = q.shape
    src = q.view(torch.uint8)
    out = torch.empty(c, r, dtype=torch.uint8, device=q.device)
    if r and c:
        cfg = launch_config(q.device)
        _TRANSPOSE.launch((triton.cdiv(r, cfg.block), triton.cdiv(c, cfg.block)), src, out, r, c,
                          BLOCK=cfg.block, num_warps=cfg.num_warps)
    return out.view(q.dtype)
