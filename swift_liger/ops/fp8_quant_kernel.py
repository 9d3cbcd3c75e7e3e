"""Row-wise FP8 (e4m3fn) quantization in one kernel: each row's largest magnitude maps to 448.

    q, scale = quantize_rows_kernel(x2, fold)     x2 [N, K] (16- or 32-bit, unit stride along K), fold [K] fp32 or None
                                                  -> q [N, K] float8_e4m3fn, scale [N, 1] fp32;  x2 * fold ~= scale * q

The same values as the torch ops of fp8_linear_op (fp32 multiply by fold, row max, max(amax, 1e-12) / 448, an IEEE
division, clamp to +-448, round to nearest even), bit for bit. A row of up to BLOCK (4096) elements is read
once and kept in registers (ROWS rows per program); a longer one, one per program, is read twice (the max, then
the quantization; the second pass mostly from L2). 1 byte written per element: ~3-5 bytes per bf16 element
against ~13 for the torch ops (an fp32 copy written and read twice), in one launch instead of six.

The rounding to e4m3 is integer arithmetic on the fp32 bits, not a conversion instruction: Triton's interpreter
rounds float8 stores wrongly (it is what the CPU tests run), and the same code then runs on every GPU.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch


@dataclasses.dataclass(frozen=True)
class Fp8QuantConfig:
    """Launch of _fp8_quant_rows_kernel: BLOCK elements per step along a row; ROWS rows per program where a row fits
    one step (K <= BLOCK), else one row per program in two passes."""
    block: int
    num_warps: int
    rows: int = 1


LAUNCH_CONFIGS = {None: Fp8QuantConfig}


def launch_config(k: int, device) -> Fp8QuantConfig:
    """BLOCK = next power of two of K up to 4096 (Qwen2.5-7B rows of 3584 take one step, 18944 five a pass);
    4 warps up to 2048 elements, 8 above; one row per program. Every device. H200: 68 us for 8192 x 3584 bf16
    (1.3 TB/s of its minimum bytes, a third of the copy speed; `rows` > 1 is the lever to measure next)."""
    block = min(4096, max(16, triton.next_power_of_2(max(1, k))))
    return _common.apply_override(__name__, None, Fp8QuantConfig(block, 4 if block <= 2048 else 8))


@triton.jit
def _e4m3_bits(y):
    """fp32 y (finite, |y| <= 448) -> its e4m3fn code (int32 0..255), rounded to nearest even."""
    yb = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    b = a.to(tl.int32, bitcast=True)
    r = b + 0x7FFFF + ((b >> 20) & 1)                 # round the 23-bit mantissa to 3 bits, ties to even
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)   # exponent bias 127 -> 7
    s = a * 512.0                                     # subnormals (a < 2^-6) are multiples of 2^-9
    f = s.to(tl.int32)                                # s >= 0: truncation is floor
    rem = s - f.to(tl.float32)
    up = (rem > 0.5) | ((rem == 0.5) & ((f & 1) == 1))
    sub = f + up.to(tl.int32)                         # 8 carries into the smallest normal's code, as it should
    code = tl.where(a < 0.015625, sub, normal)
    return code | (((yb >> 31) & 1) << 7)


@triton.jit
def _load_block(x_row, fold_ptr, offs, inb, HAS_FOLD: tl.constexpr):
    """One block of the row in fp32, times fold when there is one."""
    v = tl.load(x_row + offs, mask=inb, other=0.0).to(tl.float32)
    if HAS_FOLD:
        v = v * tl.load(fold_ptr + offs, mask=inb, other=0.0)
    return v


@triton.jit(do_not_specialize=["N"])
def _fp8_quant_rows_kernel(x_ptr, fold_ptr, q_ptr, scale_ptr, N, K, stride_x, HAS_FOLD: tl.constexpr,
                           BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, ROWS: tl.constexpr):
    if ONE_PASS:                                      # K <= BLOCK: ROWS rows stay in registers between the two steps
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        inb = (rows[:, None] < N) & (offs[None, :] < K)
        v = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=inb, other=0.0).to(tl.float32)
        if HAS_FOLD:
            v = v * tl.load(fold_ptr + offs, mask=offs < K, other=0.0)[None, :]
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12), 448.0)
        tl.store(scale_ptr + rows, scale, mask=rows < N)
        y = tl.minimum(tl.maximum(tl.div_rn(v, scale[:, None]), -448.0), 448.0)
        tl.store(q_ptr + rows[:, None] * K + offs[None, :], _e4m3_bits(y).to(tl.uint8), mask=inb)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * K
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_load_block(x_row, fold_ptr, offs, offs < K, HAS_FOLD)))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):                 # the row again: the quantization
            offs = k0 + tl.arange(0, BLOCK)
            inb = offs < K
            v = _load_block(x_row, fold_ptr, offs, inb, HAS_FOLD)
            y = tl.minimum(tl.maximum(tl.div_rn(v, scale), -448.0), 448.0)
            tl.store(q_row + offs, _e4m3_bits(y).to(tl.uint8), mask=inb)


_QUANT = _launch.FastLaunch(_fp8_quant_rows_kernel)


def quantize_rows_kernel(x2: torch.Tensor, fold=None):
    """See the module docstring. x2 must have unit stride along K; fold, when given, is a contiguous fp32 [K]."""
    n, k = x2.shape
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(n, k, dtype=torch.uint8, device=x2.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x2.device)
    if n and k:
        cfg = launch_config(k, x2.device)
        one_pass = k <= cfg.block
        rows = cfg.rows if one_pass else 1
        _QUANT.launch((triton.cdiv(n, rows),), x2, fold if fold is not None else scale, q, scale, n, k, x2.stride(0),
                      HAS_FOLD=fold is not None, BLOCK=cfg.block, ONE_PASS=one_pass, ROWS=rows,
                      num_warps=cfg.num_warps)
    return q.view(torch.float8_e4m3fn), scale
