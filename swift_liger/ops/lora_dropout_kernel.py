"""LoRA dropout drawn inside the rank-r products: dropout(x) is never written, nor kept as a mask.

With LoRA dropout p (ms-swift's default 0.05) each projection needs x_lora = dropout(x) for u = x_lora A^T, and its
backward needs the same x_lora for dA = du^T x_lora and the same mask for dx += mask * (du A) / (1 - p). Written out
and re-created from bits (ops/lora_linear_op.py without this kernel) that moves ~29 bytes per bf16 element of x per
training step (forward, reentrant recompute, backward); here ~10: each pass reads x once and re-draws the keep
decisions from (seed, element index) with a counter-based generator (Philox 4x32, 7 rounds, via tl.randint4x).
At Qwen2.5-7B, 8k tokens, LoRA on every linear, that is ~6 GB less traffic per layer and step. Measured on an
H100 against the bits path in the same process (docs/benchmarks/train_lab_lora_dropout_h100.md): 1.047x per step at
7B 8k, 1.094x at 0.5B 8 x 512, with 10 Philox rounds. The draws (~100 integer instructions per 10-round call of 8
elements, plus unpacking) kept the kernels at 1.2-2.8x cuBLAS's time for the same product without dropout
(lora_dropout_lab_h100.md); 7 rounds (PHILOX_ROUNDS) made them 1.04-1.14x faster (1.16-2.50x cuBLAS's time).

    seed = dropout_seed(x.device)                       int64 [1], drawn from torch's generator for the device
    u    = lora_down(x, a, seed, p)                     x [N, in], a [r, in] -> [N, r]   (x's dtype)
    dA   = lora_down_weight_grad(x, du, seed, p)        du [N, r] -> [r, in]   (du's dtype, fp32 accumulation)
    dxl  = lora_down_input_grad(du, a, seed, p, dtype)  -> [N, in] = keep * (du a) / (1 - p)
    keep = keep_mask(n, in, seed, p, device)            bool [N, in]: the decisions the three above use (tests)

The seed is a device tensor drawn by ``torch.randint`` from the current generator, so a reentrant checkpoint's
recompute (which restores the RNG state) draws the first pass's decisions again, and a CUDA-graph replay draws new
ones (the generator's offset advances per replay). Element (n, k) keeps when 16 random bits are >= round(p * 2^16):
the drop probability is p to within 2^-17; kept values are scaled by 1 / (1 - p), computed in fp32 and rounded once
to x's dtype before the product, as torch's dropout does. Eight consecutive elements of a row share one Philox call
(in % 8 == 0). The draws differ from ``torch.native_dropout``'s (same distribution, another generator).

Limits (``applies``): x 16-bit and contiguous, in % 8 == 0, 1 <= r <= 64, Triton available for x's device.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _common, _launch

MAX_RANK = 64
# Philox rounds per draw: 7, as the dropout of FlashAttention-2 (torch's bundled copy included) draws; Philox4x32-7
# passes TestU01's BigCrush (Salmon et al., SC 2011), 10 is the generator's default with a safety margin. The draws are
# what bounds these kernels; 7 rounds: 30% fewer of their instructions, 1.04-1.14x faster (lora_dropout_lab_h100.md).
PHILOX_ROUNDS = tl.constexpr(7)
ENABLED = True   # False: lora_linear keeps dropout masks as bits instead (A/B benchmarks)


@dataclasses.dataclass(frozen=True)
class LoraDropoutConfig:
    """Tile of a launch: block_n rows x block_k input features (block_k a multiple of 8); num_warps, num_stages.
    `splits`: lora_down splits the input features, the weight gradient the rows, over that many programs per block
    (fp32 partial sums added after)."""
    block_n: int
    block_k: int
    num_warps: int
    splits: int = 1
    num_stages: int = 3


LAUNCH_CONFIGS = {"down": LoraDropoutConfig, "wgrad": LoraDropoutConfig, "igrad": LoraDropoutConfig}


def launch_config(kind: str, n: int, n_in: int, device) -> LoraDropoutConfig:
    """Measured on an H100 (tools/lora_dropout_lab.py, docs/benchmarks/lora_dropout_lab_h100.md): the Philox draws
    make these kernels latency-bound at one 4-warp program per SM, so the rules below buy parallelism.
    "down": 32-row programs (16 where too few rows fill 1.5 programs per SM), the input features split in pieces of
    >= 2048 until ~8 programs per SM run (1.03-4.65x over one 64-row program per SM; most where rows are few and
    features many). "wgrad": 64 x 64 tiles of dA, the rows split for ~8 programs per SM and at most 1024 rows per
    split (1.05-1.30x over 128-feature tiles at ~4 programs per SM). "igrad": 64 x 64 tiles of dx (no setting of the
    sweep was 3% faster). Each rule lands within 13% of the best point the sweep found, most within 6%."""
    sms = _common.target(device).sm_count
    if kind == "down":
        splits = max(1, min(n_in // 2048, triton.cdiv(8 * sms, triton.cdiv(n, 32))))
        cfg = LoraDropoutConfig(32 if triton.cdiv(n, 32) * splits * 2 >= 3 * sms else 16, 128, 4, splits)
    elif kind == "igrad":
        cfg = LoraDropoutConfig(64, 64, 4)
    elif kind == "wgrad":
        splits = max(triton.cdiv(8 * sms, triton.cdiv(n_in, 64)), triton.cdiv(n, 1024))
        cfg = LoraDropoutConfig(64, 64, 4, max(1, min(splits, triton.cdiv(n, 64))), num_stages=2)
    else:
        raise ValueError(f"kind must be 'down', 'wgrad' or 'igrad', got {kind!r}")
    return _common.apply_override(__name__, kind, cfg)


@triton.jit
def _keep(seed, rows, k0, n_in, thresh, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] keep decisions of columns k0 .. k0 + BK of `rows` (int64 [BN]). The 8 elements of flat group
    (row * n_in + k) // 8 share one Philox call: its four 32-bit words give eight 16-bit draws."""
    g = (rows[:, None] * n_in + k0) // 8 + tl.arange(0, BK // 8)[None, :]          # [BN, BK // 8] int64
    r0, r1, r2, r3 = tl.randint4x(seed, g, PHILOX_ROUNDS)
    h = tl.join(tl.join(tl.join(r0 & 65535, r0 >> 16), tl.join(r1 & 65535, r1 >> 16)),
                tl.join(tl.join(r2 & 65535, r2 >> 16), tl.join(r3 & 65535, r3 >> 16)))   # [BN, BK // 8, 2, 2, 2]
    return tl.reshape(h, (BN, BK)).to(tl.int32) >= thresh


@triton.jit
def _mm(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation; UPCAST (Triton's interpreter, whose 16-bit dot is wrong) multiplies the
    16-bit values as fp32, exactly."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dropped(x_ptr, seed, rows, k0, n, n_in, thresh, scale, BN: tl.constexpr, BK: tl.constexpr):
    """dropout(x)[rows, k0:k0 + BK] in x's dtype: kept values times scale, rounded once; the rest 0."""
    ks = k0 + tl.arange(0, BK)
    inb = (rows[:, None] < n) & (ks[None, :] < n_in)
    x = tl.load(x_ptr + rows[:, None] * n_in + ks[None, :], mask=inb, other=0.0).to(tl.float32)
    keep = _keep(seed, rows, k0, n_in, thresh, BN, BK)
    return tl.where(keep, x * scale, 0.0).to(x_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["n"])   # any row count: one compiled kernel
def _down_kernel(x_ptr, a_ptr, u_ptr, seed_ptr, n, n_in, r, thresh, scale, k_per_split,
                 BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, UPCAST: tl.constexpr):
    """Program (i, s): rows i * BN .. over input features s * k_per_split ..; u_ptr is [splits, n, r] (fp32 partial
    sums) when the features are split, else [n, r] in x's dtype."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)                   # int64: n * n_in may pass 2^31
    split = tl.program_id(1)
    rr = tl.arange(0, BR)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BN, BR), tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, n_in), BK):
        xd = _dropped(x_ptr, seed, rows, k0, n, n_in, thresh, scale, BN, BK)       # [BN, BK]
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rr[None, :] * n_in + ks[:, None], mask=(rr[None, :] < r) & (ks[:, None] < n_in),
                    other=0.0)                                                      # [BK, BR] = a^T tile
        acc = _mm(xd, a, acc, UPCAST)
    tl.store(u_ptr + split.to(tl.int64) * n * r + rows[:, None] * r + rr[None, :], acc.to(u_ptr.dtype.element_ty),
             mask=(rows[:, None] < n) & (rr[None, :] < r))


@triton.jit(do_not_specialize=["n"])   # any row count: one compiled kernel
def _wgrad_kernel(x_ptr, du_ptr, out_ptr, seed_ptr, n, n_in, r, thresh, scale, rows_per_split,
                  BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, UPCAST: tl.constexpr):
    k0 = tl.program_id(0) * BK
    split = tl.program_id(1)
    rr = tl.arange(0, BR)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BR, BK), tl.float32)
    start = split.to(tl.int64) * rows_per_split
    for i in range(0, rows_per_split, BN):
        rows = start + i + tl.arange(0, BN)
        xd = _dropped(x_ptr, seed, rows, k0, n, n_in, thresh, scale, BN, BK)       # [BN, BK]
        du = tl.load(du_ptr + rows[:, None] * r + rr[None, :], mask=(rows[:, None] < n) & (rr[None, :] < r),
                     other=0.0)                                                     # [BN, BR]
        acc = _mm(tl.trans(du), xd, acc, UPCAST)                                   # [BR, BK]
    ks = k0 + tl.arange(0, BK)
    tl.store(out_ptr + split * r * n_in + rr[:, None] * n_in + ks[None, :], acc,
             mask=(rr[:, None] < r) & (ks[None, :] < n_in))


@triton.jit(do_not_specialize=["n"])   # any row count: one compiled kernel
def _igrad_kernel(du_ptr, a_ptr, out_ptr, seed_ptr, n, n_in, r, thresh, scale,
                  BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ks = k0 + tl.arange(0, BK)
    rr = tl.arange(0, BR)
    seed = tl.load(seed_ptr)
    du = tl.load(du_ptr + rows[:, None] * r + rr[None, :], mask=(rows[:, None] < n) & (rr[None, :] < r), other=0.0)
    a = tl.load(a_ptr + rr[:, None] * n_in + ks[None, :], mask=(rr[:, None] < r) & (ks[None, :] < n_in), other=0.0)
    g = _mm(du, a, tl.zeros((BN, BK), tl.float32), UPCAST)                       # [BN, BK] fp32
    keep = _keep(seed, rows, k0, n_in, thresh, BN, BK)
    out = tl.where(keep, g * scale, 0.0)
    tl.store(out_ptr + rows[:, None] * n_in + ks[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < n) & (ks[None, :] < n_in))


@triton.jit(do_not_specialize=["n"])   # any row count: one compiled kernel
def _keep_kernel(out_ptr, seed_ptr, n, n_in, thresh, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ks = k0 + tl.arange(0, BK)
    keep = _keep(tl.load(seed_ptr), rows, k0, n_in, thresh, BN, BK)
    tl.store(out_ptr + rows[:, None] * n_in + ks[None, :], keep.to(tl.int8),
             mask=(rows[:, None] < n) & (ks[None, :] < n_in))


_DOWN = _launch.FastLaunch(_down_kernel)
_WGRAD = _launch.FastLaunch(_wgrad_kernel)
_IGRAD = _launch.FastLaunch(_igrad_kernel)
_KEEP = _launch.FastLaunch(_keep_kernel)


def applies(x: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether these kernels take this projection's dropout (see the module docstring's limits)."""
    return (ENABLED and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous() and x.shape[-1] % 8 == 0
            and 1 <= lora_a.shape[0] <= MAX_RANK and _common.use_triton(x))


def dropout_seed(device: torch.device) -> torch.Tensor:
    """One int64 seed on `device`, drawn from its current generator (graph-capturable on CUDA)."""
    return torch.randint(0, 1 << 62, (1,), device=device, dtype=torch.int64)


def _threshold(p: float) -> int:
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    return min(65535, max(1, round(p * 65536)))


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def lora_down(x: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """dropout(x) a^T for x [N, in] (contiguous, 16-bit) and a [r, in] in x's dtype -> [N, r] in x's dtype."""
    n, n_in = x.shape
    r = a.shape[0]
    if not n:
        return torch.empty(0, r, dtype=x.dtype, device=x.device)
    cfg = launch_config("down", n, n_in, x.device)
    k_per_split = triton.cdiv(triton.cdiv(n_in, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(n_in, k_per_split)
    u = torch.empty(splits, n, r, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _DOWN.launch((triton.cdiv(n, cfg.block_n), splits), x, a.contiguous(), u, seed, n, n_in, r, _threshold(p),
                 1.0 / (1.0 - p), k_per_split, BN=cfg.block_n, BK=cfg.block_k, BR=_rank_block(r),
                 UPCAST=_common.INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return u[0] if splits == 1 else u.sum(0).to(x.dtype)


def lora_down_weight_grad(x: torch.Tensor, du: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """du^T dropout(x) -> [r, in]: fp32 sums, rounded once to du's dtype (a GEMM's output rounding)."""
    n, n_in = x.shape
    r = du.shape[1]
    cfg = launch_config("wgrad", n, n_in, x.device)
    rows_per_split = triton.cdiv(triton.cdiv(max(n, 1), cfg.splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(max(n, 1), rows_per_split)
    part = (torch.empty if n else torch.zeros)(splits, r, n_in, dtype=torch.float32, device=x.device)   # all written
    if n:
        _WGRAD.launch((triton.cdiv(n_in, cfg.block_k), splits), x, du.contiguous(), part, seed, n, n_in, r,
                      _threshold(p), 1.0 / (1.0 - p), rows_per_split, BN=cfg.block_n, BK=cfg.block_k,
                      BR=_rank_block(r), UPCAST=_common.INTERPRET, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return (part[0] if splits == 1 else part.sum(0)).to(du.dtype)


def lora_down_input_grad(du: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float,
                         dtype: torch.dtype) -> torch.Tensor:
    """keep * (du a) / (1 - p) -> [N, in] in `dtype` (the gradient reaching x through the dropout)."""
    n, r = du.shape
    n_in = a.shape[1]
    out = torch.empty(n, n_in, dtype=dtype, device=du.device)
    if n:
        cfg = launch_config("igrad", n, n_in, du.device)
        _IGRAD.launch((triton.cdiv(n, cfg.block_n), triton.cdiv(n_in, cfg.block_k)), du.contiguous(), a.contiguous(),
                      out, seed, n, n_in, r, _threshold(p), 1.0 / (1.0 - p), BN=cfg.block_n, BK=cfg.block_k,
                      BR=_rank_block(r), UPCAST=_common.INTERPRET, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return out


def keep_mask(n: int, n_in: int, seed: torch.Tensor, p: float, device) -> torch.Tensor:
    """The bool [n, n_in] keep decisions the kernels above draw for this seed and p."""
    if n_in % 8:
        raise ValueError(f"n_in must be a multiple of 8, got {n_in}")
    out = torch.empty(n, n_in, dtype=torch.int8, device=device)
    if n:
        _KEEP.launch((triton.cdiv(n, 64), triton.cdiv(n_in, 64)), out, seed, n, n_in, _threshold(p), BN=64, BK=64)
    return out.bool()
