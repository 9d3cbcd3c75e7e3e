"""Row-wise FP8 (e4m3fn) quantization in one kernel: each row's largest magnitude maps to 448.

    q, scale = quantize_rows_kernel(x2, fold)     x2 [N, K] (16- or 32-bit, unit stride along K), fold [K] fp32 or None
                                                  -> q [N, K] float8_e4m3fn, scale [N, 1] fp32;  x2 * fold ~= scale * q

The same values as the torch ops of fp8_linear_op (fp32 multiply by fold, row max, max(amax, 1e-12) / 448, an IEEE
division, clamp to +-448, round to nearest even), bit for bit. A row of up to BLOCK (4096) elements is read
once and kept in registers (ROWS rows per program); a longer one, one per program, is read twice (the max, then
the quantization; the second pass mostly from L2). 1 byte written per element: ~3-5 bytes per bf16 element
against ~13 for the torch ops (an fp32 copy written and read twice), in one launch instead of six.

The rounding to e4m3 is integer arithmetic on the fp32 bits, not a conversion instruction: Triton's interpreter
rounds float8 stores wrongly (it is what the CPU tests run), and the same code then runs on every GPU. Counted for
a bf16 element: ~40 integer and float instructions (the IEEE division, the rounding), which at 29M elements
(8192 x 3584) is ~50 us of an H200's issue rate: the 68 us measured is instruction-bound more than memory-bound.
``hw_cvt`` (CUDA sm_89+, compiled; on by default there, ``SWIFT_LIGER_FP8_HW_CVT=0`` turns it off) multiplies by one
IEEE reciprocal per row and converts with the hardware's round-to-nearest-even conversion (~8 instructions): codes
equal to ``fp8_linear_op.quantize_rows_fast_torch``'s, which may differ from the division's by one code where v / scale
and v * (1 / scale) round apart.
"""
from __future__ import annotations

import dataclasses
import os

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
    hw_cvt: bool = False


LAUNCH_CONFIGS = {None: Fp8QuantConfig}

# hw_cvt on every device where hw_cvt_supported (elsewhere the division runs); SWIFT_LIGER_FP8_HW_CVT=0 turns it off.
# Measured on an H200 (docs/benchmarks/fp8_lora.md): 8192 x 3584 bf16 quantized in 27-52 us against 59-69; `swift sft`
# LoRA over FP8 bases, 8k tokens, Qwen2.5-7B 13022 vs 12790 tok/s, Llama-3-8B 12088 vs 11575. Read at import; the
# answer per device is kept (launch_config runs at every quantization).
HW_CVT = os.environ.get("SWIFT_LIGER_FP8_HW_CVT", "1").strip() != "0"
_HW_CVT_AT: dict = {}


def _hw_cvt_default(device) -> bool:
    if not HW_CVT or not isinstance(device, torch.device):   # a Target (compile-only checks): the division
        return False
    key = (device.type, device.index)
    if key not in _HW_CVT_AT:
        _HW_CVT_AT[key] = hw_cvt_supported(device)
    return _HW_CVT_AT[key]


def launch_config(k: int, device) -> Fp8QuantConfig:
    """BLOCK = next power of two of K up to 4096 (Qwen2.5-7B rows of 3584 take one step, 18944 five a pass);
    4 warps up to 2048 elements, 8 above; one row per program (2-8 rows measured no faster on an H200); hw_cvt where
    it runs (HW_CVT). H200, 8192 x 3584 bf16: 27-52 us with hw_cvt (3.3-1.7 TB/s of its minimum bytes), 59-69 us
    dividing (two rounds in one process).
    Under the interpreter (CPU) 32 rows per program: the interpreter's cost is per program (128 x 64 bf16: 560 ms
    with one row per program, 18 ms with 32), and the CPU end-to-end FP8 tests quantize hundreds of times."""
    block = min(4096, max(16, triton.next_power_of_2(max(1, k))))
    rows = 1 if _common.target(device).type == "cuda" else 32
    return _common.apply_override(__name__, None, Fp8QuantConfig(block, 4 if block <= 2048 else 8, rows,
                                                                  _hw_cvt_default(device)))


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


@triton.jit
def _codes(v, scale, inv, HW_CVT: tl.constexpr):
    """e4m3fn codes (uint8) of fp32 v / scale, clamped to +-448 (scale and inv = 1 / scale broadcast against v).
    HW_CVT: v * inv and the hardware's round-to-nearest-even conversion (sm_89+); else an IEEE division and
    _e4m3_bits."""
    if HW_CVT:
        y = tl.minimum(tl.maximum(v * inv, -448.0), 448.0)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    y = tl.minimum(tl.maximum(tl.div_rn(v, scale), -448.0), 448.0)
    return _e4m3_bits(y).to(tl.uint8)


@triton.jit(do_not_specialize=["N"])
def _fp8_quant_rows_kernel(x_ptr, fold_ptr, q_ptr, scale_ptr, N, K, stride_x, HAS_FOLD: tl.constexpr,
                           BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, ROWS: tl.constexpr,
                           HW_CVT: tl.constexpr):
    if ONE_PASS:                                      # K <= BLOCK: ROWS rows stay in registers between the two steps
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        inb = (rows[:, None] < N) & (offs[None, :] < K)
        v = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=inb, other=0.0).to(tl.float32)
        if HAS_FOLD:
            v = v * tl.load(fold_ptr + offs, mask=offs < K, other=0.0)[None, :]
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12), 448.0)
        tl.store(scale_ptr + rows, scale, mask=rows < N)
        if HW_CVT:   # one IEEE reciprocal per row
            inv = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        else:
            inv = scale
        tl.store(q_ptr + rows[:, None] * K + offs[None, :], _codes(v, scale[:, None], inv[:, None], HW_CVT),
                 mask=inb)
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
        if HW_CVT:   # the row's IEEE reciprocal, once
            inv = tl.div_rn(tl.full([], 1.0, tl.float32), scale)
        else:
            inv = scale
        for k0 in range(0, K, BLOCK):                 # the row again: the quantization
            offs = k0 + tl.arange(0, BLOCK)
            inb = offs < K
            v = _load_block(x_row, fold_ptr, offs, inb, HAS_FOLD)
            tl.store(q_row + offs, _codes(v, scale, inv, HW_CVT), mask=inb)


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
        if cfg.hw_cvt and not hw_cvt_supported(x2.device):
            raise ValueError(f"Fp8QuantConfig.hw_cvt needs a CUDA GPU of compute capability 8.9 or newer and no "
                             f"Triton interpreter, got {x2.device}")
        _QUANT.launch((triton.cdiv(n, rows),), x2, fold if fold is not None else scale, q, scale, n, k, x2.stride(0),
                      HAS_FOLD=fold is not None, BLOCK=cfg.block, ONE_PASS=one_pass, ROWS=rows,
                      HW_CVT=cfg.hw_cvt, num_warps=cfg.num_warps)
    return q.view(torch.float8_e4m3fn), scale


def hw_cvt_supported(device: torch.device) -> bool:
    """Whether Fp8QuantConfig.hw_cvt can run here: compiled (not interpreted) for a CUDA GPU of sm_89 or newer."""
    return (device.type == "cuda" and not _common.INTERPRET
            and torch.cuda.get_device_capability(device) >= (8, 9))

