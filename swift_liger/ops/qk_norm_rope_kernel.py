"""Fused per-head QK-RMSNorm + rotary embedding (Qwen3 q_norm/k_norm, Gemma3 (1 + w) norm), q and k in one launch.

    q_out = rope(rmsnorm(q, q_weight)),  k_out = rope(rmsnorm(k, k_weight)),  RMSNorm over head_dim D per head.

Rounding follows Hugging Face eager: "llama" casting (Qwen3RMSNorm) normalizes in fp32, rounds to the input dtype,
multiplies by the weight and rounds again (unless the weight's dtype promotes the product to fp32); "gemma"
casting multiplies by (offset + w) in fp32 and rounds once. The rotation then runs in fp32 on that rounded value.

Forward: one program per token loads cos/sin once, normalizes and rotates every q and k head of the token.
Backward: a persistent grid strides over tokens, recomputes rstd from the saved input, applies the transposed
rotation and the RMSNorm backward, and keeps fp32 per-program weight-gradient partials that a second small
kernel sums (no atomics). Nothing is saved but the inputs (q, k, weights, cos, sin).

Pure kernel module: no transformers / ms-swift imports.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import torch
import triton
import triton.language as tl

from . import _common, _launch, _reduce
from .rope_kernel import (RoPEConfig, apply_rope_reference, check_rope_args, cos_sin_strides, last_dim_contiguous,
                   load_cos_sin, load_heads, rotary_config, rotate, store_heads, token_coords)

CASTINGS = ("llama", "gemma")


# ---------------------------------------------------------------------------------------------------------------
# Kernels (tile helpers shared with rope.py)
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 value rounded to DT and back: HF's intermediate cast. A no-op for fp32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _scale(n, w, offset, DT: tl.constexpr, GEMMA: tl.constexpr, ROUND_Y: tl.constexpr):
    """Weight the normalized value n (fp32) where HF rounds: gemma (n * (offset + w)).to(DT); llama
    (offset + w) * n.to(DT), rounded to DT again unless the weight dtype promotes the product to fp32."""
    if GEMMA:
        y = _round(n * (offset + w), DT)
    else:
        y = _round(n, DT) * (offset + w)
        if ROUND_Y:
            y = _round(y, DT)
    return y


@triton.jit
def _norm_rope_fwd_math(x1, x2, x3, w1, w2, w3, c1, c2, s1, s2, eps, offset, DT: tl.constexpr,
                        D: tl.constexpr, GEMMA: tl.constexpr, ROUND_Y: tl.constexpr):
    """Per-head RMSNorm over all D dims (x1, x2: rotary halves, x3: tail), weight, then rotate the halves."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    rstd = tl.rsqrt(ss / D + eps)[:, None]
    y1 = _scale(x1 * rstd, w1, offset, DT, GEMMA, ROUND_Y)
    y2 = _scale(x2 * rstd, w2, offset, DT, GEMMA, ROUND_Y)
    y3 = _scale(x3 * rstd, w3, offset, DT, GEMMA, ROUND_Y)
    o1, o2 = rotate(y1, y2, c1, c2, s1, s2, False)
    return o1, o2, y3


@triton.jit
def _norm_rope_bwd_math(x1, x2, x3, g1, g2, g3, w1, w2, w3, c1, c2, s1, s2, eps, offset, DT: tl.constexpr,
                        D: tl.constexpr, GEMMA: tl.constexpr):
    """Returns (dx1, dx2, dx3, dw1, dw2, dw3): input gradients and this tile's weight-gradient terms (per row)."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    rstd = tl.rsqrt(ss / D + eps)[:, None]
    n1 = x1 * rstd
    n2 = x2 * rstd
    n3 = x3 * rstd
    dy1, dy2 = rotate(g1, g2, c1, c2, s1, s2, True)  # gradient w.r.t. the weighted, normalized y
    dn1 = dy1 * (offset + w1)
    dn2 = dy2 * (offset + w2)
    dn3 = g3 * (offset + w3)
    mean = ((tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1) + tl.sum(dn3 * n3, axis=1)) / D)[:, None]
    if GEMMA:  # gemma scales the fp32 n; llama the n rounded to the input dtype
        dw1 = dy1 * n1
        dw2 = dy2 * n2
        dw3 = g3 * n3
    else:
        dw1 = dy1 * _round(n1, DT)
        dw2 = dy2 * _round(n2, DT)
        dw3 = g3 * _round(n3, DT)
    return rstd * (dn1 - n1 * mean), rstd * (dn2 - n2 * mean), rstd * (dn3 - n3 * mean), dw1, dw2, dw3


@triton.jit
def _load_vec(ptr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, D: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """A length-D vector as fp32 rows [1, BLOCK_HALF] x2 (rotary halves) and [1, BLOCK_PASS] (tail)."""
    d = tl.arange(0, BLOCK_HALF)
    p = tl.arange(0, BLOCK_PASS)
    v1 = tl.load(ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    v2 = tl.load(ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    v3 = tl.load(ptr + 2 * HALF + p, mask=p < D - 2 * HALF, other=0.0).to(tl.float32)[None, :]
    return v1, v2, v3


@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_fwd_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                             T, eps, offset,
                             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                             sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                             sc_b, sc_t, ss_b, ss_t,
                             HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_PASS: tl.constexpr, GEMMA: tl.constexpr, ROUND_Y: tl.constexpr):
    """Grid: (B * T,), one program per token = b * T + t (as rope's kernel, whose persistent loop cost 20
    registers per thread)."""
    DT: tl.constexpr = q_ptr.dtype.element_ty
    wq1, wq2, wq3 = _load_vec(qw_ptr, HALF, BLOCK_HALF, D, BLOCK_PASS)
    wk1, wk2, wk3 = _load_vec(kw_ptr, HALF, BLOCK_HALF, D, BLOCK_PASS)
    b, t = token_coords(tl.program_id(0), T)
    c1, c2, s1, s2 = load_cos_sin(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF, BLOCK_HALF)
    q_in = q_ptr + b * sq_b + t * sq_t
    k_in = k_ptr + b * sk_b + t * sk_t
    q_out = qo_ptr + b * sqo_b + t * sqo_t
    k_out = ko_ptr + b * sko_b + t * sko_t
    if BLOCK_HQ >= HQ and BLOCK_HK >= HK:  # every load of the token before the first store
        q1, q2, q3 = load_heads(q_in, sq_h, 0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
        k1, k2, k3 = load_heads(k_in, sk_h, 0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
        o1, o2, o3 = _norm_rope_fwd_math(q1, q2, q3, wq1, wq2, wq3, c1, c2, s1, s2, eps, offset,
                                         DT, D, GEMMA, ROUND_Y)
        store_heads(q_out, sqo_h, 0, o1, o2, o3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
        o1, o2, o3 = _norm_rope_fwd_math(k1, k2, k3, wk1, wk2, wk3, c1, c2, s1, s2, eps, offset,
                                         DT, D, GEMMA, ROUND_Y)
        store_heads(k_out, sko_h, 0, o1, o2, o3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
    else:
        for h0 in range(0, HQ, BLOCK_HQ):
            x1, x2, x3 = load_heads(q_in, sq_h, h0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
            o1, o2, o3 = _norm_rope_fwd_math(x1, x2, x3, wq1, wq2, wq3, c1, c2, s1, s2, eps, offset,
                                             DT, D, GEMMA, ROUND_Y)
            store_heads(q_out, sqo_h, h0, o1, o2, o3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
        for h0 in range(0, HK, BLOCK_HK):
            x1, x2, x3 = load_heads(k_in, sk_h, h0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
            o1, o2, o3 = _norm_rope_fwd_math(x1, x2, x3, wk1, wk2, wk3, c1, c2, s1, s2, eps, offset,
                                             DT, D, GEMMA, ROUND_Y)
            store_heads(k_out, sko_h, h0, o1, o2, o3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)


@triton.jit(do_not_specialize=["n_tok", "T"])
def _qk_norm_rope_bwd_kernel(q_ptr, k_ptr, gq_ptr, gk_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, dq_ptr, dk_ptr,
                             part_ptr, n_tok, T, eps, offset,
                             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                             sgq_b, sgq_h, sgq_t, sgk_b, sgk_h, sgk_t,
                             sdq_b, sdq_h, sdq_t, sdk_b, sdk_h, sdk_t,
                             sc_b, sc_t, ss_b, ss_t,
                             HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_PASS: tl.constexpr, GEMMA: tl.constexpr, COMPUTE_DW: tl.constexpr):
    """Grid: (P,) persistent over tokens. Writes dq, dk and, with COMPUTE_DW, fp32 partials part[0, pid, :]
    (q weight) and part[1, pid, :] (k weight), each summed over the program's (token, head) rows."""
    DT: tl.constexpr = q_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wq1, wq2, wq3 = _load_vec(qw_ptr, HALF, BLOCK_HALF, D, BLOCK_PASS)
    wk1, wk2, wk3 = _load_vec(kw_ptr, HALF, BLOCK_HALF, D, BLOCK_PASS)
    # Per-(head, dim) accumulators: one cross-row reduction at the end instead of one per token.
    aq1 = tl.zeros([BLOCK_HQ, BLOCK_HALF], dtype=tl.float32)
    aq2 = tl.zeros([BLOCK_HQ, BLOCK_HALF], dtype=tl.float32)
    aq3 = tl.zeros([BLOCK_HQ, BLOCK_PASS], dtype=tl.float32)
    ak1 = tl.zeros([BLOCK_HK, BLOCK_HALF], dtype=tl.float32)
    ak2 = tl.zeros([BLOCK_HK, BLOCK_HALF], dtype=tl.float32)
    ak3 = tl.zeros([BLOCK_HK, BLOCK_PASS], dtype=tl.float32)
    for tok in range(pid, n_tok, nprog):
        b, t = token_coords(tok, T)
        c1, c2, s1, s2 = load_cos_sin(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF, BLOCK_HALF)
        q_in = q_ptr + b * sq_b + t * sq_t
        k_in = k_ptr + b * sk_b + t * sk_t
        gq_in = gq_ptr + b * sgq_b + t * sgq_t
        gk_in = gk_ptr + b * sgk_b + t * sgk_t
        dq_out = dq_ptr + b * sdq_b + t * sdq_t
        dk_out = dk_ptr + b * sdk_b + t * sdk_t
        if BLOCK_HQ >= HQ and BLOCK_HK >= HK:  # every load of the token before the first store
            x1, x2, x3 = load_heads(q_in, sq_h, 0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
            g1, g2, g3 = load_heads(gq_in, sgq_h, 0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
            y1, y2, y3 = load_heads(k_in, sk_h, 0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
            e1, e2, e3 = load_heads(gk_in, sgk_h, 0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
            o1, o2, o3, dw1, dw2, dw3 = _norm_rope_bwd_math(x1, x2, x3, g1, g2, g3, wq1, wq2, wq3,
                                                            c1, c2, s1, s2, eps, offset, DT, D, GEMMA)
            store_heads(dq_out, sdq_h, 0, o1, o2, o3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
            if COMPUTE_DW:
                aq1 += dw1
                aq2 += dw2
                aq3 += dw3
            o1, o2, o3, dw1, dw2, dw3 = _norm_rope_bwd_math(y1, y2, y3, e1, e2, e3, wk1, wk2, wk3,
                                                            c1, c2, s1, s2, eps, offset, DT, D, GEMMA)
            store_heads(dk_out, sdk_h, 0, o1, o2, o3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
            if COMPUTE_DW:
                ak1 += dw1
                ak2 += dw2
                ak3 += dw3
        else:
            for h0 in range(0, HQ, BLOCK_HQ):
                x1, x2, x3 = load_heads(q_in, sq_h, h0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
                g1, g2, g3 = load_heads(gq_in, sgq_h, h0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
                o1, o2, o3, dw1, dw2, dw3 = _norm_rope_bwd_math(x1, x2, x3, g1, g2, g3, wq1, wq2, wq3,
                                                                c1, c2, s1, s2, eps, offset, DT, D, GEMMA)
                store_heads(dq_out, sdq_h, h0, o1, o2, o3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS)
                if COMPUTE_DW:
                    aq1 += dw1
                    aq2 += dw2
                    aq3 += dw3
            for h0 in range(0, HK, BLOCK_HK):
                x1, x2, x3 = load_heads(k_in, sk_h, h0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
                g1, g2, g3 = load_heads(gk_in, sgk_h, h0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
                o1, o2, o3, dw1, dw2, dw3 = _norm_rope_bwd_math(x1, x2, x3, g1, g2, g3, wk1, wk2, wk3,
                                                                c1, c2, s1, s2, eps, offset, DT, D, GEMMA)
                store_heads(dk_out, sdk_h, h0, o1, o2, o3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS)
                if COMPUTE_DW:
                    ak1 += dw1
                    ak2 += dw2
                    ak3 += dw3
    if COMPUTE_DW:
        d = tl.arange(0, BLOCK_HALF)
        p = tl.arange(0, BLOCK_PASS)
        dmask = d < HALF
        pmask = p < D - 2 * HALF
        rq = part_ptr + pid * D
        rk = part_ptr + (nprog + pid) * D
        tl.store(rq + d, tl.sum(aq1, axis=0), mask=dmask)
        tl.store(rq + HALF + d, tl.sum(aq2, axis=0), mask=dmask)
        tl.store(rq + 2 * HALF + p, tl.sum(aq3, axis=0), mask=pmask)
        tl.store(rk + d, tl.sum(ak1, axis=0), mask=dmask)
        tl.store(rk + HALF + d, tl.sum(ak2, axis=0), mask=dmask)
        tl.store(rk + 2 * HALF + p, tl.sum(ak3, axis=0), mask=pmask)


# ---------------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------------

QKNormRoPEConfig = RoPEConfig   # forward: one program per token


@dataclasses.dataclass(frozen=True)
class QKNormRoPEBwdConfig(RoPEConfig):
    """Launch of the persistent backward: RoPEConfig's head tiles and warps, plus programs (grid size; each program
    keeps fp32 weight-gradient partials, summed by ``_reduce.column_sums``)."""
    programs: int


LAUNCH_CONFIGS = {"fwd": QKNormRoPEConfig, "bwd": QKNormRoPEBwdConfig}


def launch_config(kind: str, n_tok: int, HQ: int, HK: int, D: int, half: int, device):
    """Launch parameters for ``kind`` in ("fwd", "bwd"); n_tok = B * T tokens, the rest as rope.launch_config.

    fwd: one program per token, rope's tiles and warps (``rope.rotary_config``), 8 warps when it loops over head
    blocks. bwd: a persistent grid of 4 programs per SM capped at the token count, 8 warps.
    """
    if kind == "fwd":
        cfg = rotary_config(HQ, HK, D, half)
        if cfg.block_hq < HQ or cfg.block_hk < HK:
            # Head-block loop (D=256 with 40/64 query heads): with rope's 2 warps this heavier kernel takes 244-253
            # registers (sm_90) and measured 0.896 / 1.158 ms fwd+bwd on the H200 against 0.867 / 1.115 for the
            # previous persistent kernel at 8 warps; 8 warps here (~100 registers) is not timed on its own yet.
            cfg = dataclasses.replace(cfg, num_warps=8)
    elif kind == "bwd":
        programs = max(1, min(n_tok, _common.target(device).sm_count * 4))
        cfg = QKNormRoPEBwdConfig(**dataclasses.asdict(rotary_config(HQ, HK, D, half, num_warps=8)),
                                  programs=programs)
    else:
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    return _common.apply_override(__name__, kind, cfg)


def _round_y(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """HF's ``weight * x.to(dtype)`` is rounded to x's dtype unless the weight's dtype promotes it (to fp32)."""
    return torch.promote_types(x_dtype, w_dtype) == x_dtype


_FWD = _launch.FastLaunch(_qk_norm_rope_fwd_kernel)
_BWD = _launch.FastLaunch(_qk_norm_rope_bwd_kernel)


def _fwd_launch(q, k, q_weight, k_weight, cos, sin, eps: float, offset: float, gemma: bool):
    """q [B, Hq, T, D], k [B, Hk, T, D] (last dim contiguous), weights [D], cos/sin [Bc, T, Dr].
    Returns (q_out, k_out) laid out like q and k."""
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1] // 2
    qo = _common.new_empty_like(q)
    ko = _common.new_empty_like(k)
    n_tok = B * T
    if n_tok == 0 or (HQ == 0 and HK == 0):
        return qo, ko
    cfg = launch_config("fwd", n_tok, HQ, HK, D, half, q.device)
    _FWD.launch(
        (n_tok,),
        q, k, q_weight, k_weight, cos, sin, qo, ko, T, float(eps), float(offset),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        *cos_sin_strides(cos, sin),
        HQ=HQ, HK=HK, HALF=half, D=D, BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk, BLOCK_HALF=cfg.block_half,
        BLOCK_PASS=cfg.block_pass, GEMMA=gemma, ROUND_Y=_round_y(q.dtype, q_weight.dtype), num_warps=cfg.num_warps)
    return qo, ko


def _bwd_launch(q, k, gq, gk, q_weight, k_weight, cos, sin, eps: float, offset: float, gemma: bool,
                compute_dw: bool):
    """Returns (dq, dk, dq_weight, dk_weight); dq/dk laid out like gq/gk; the weight grads have the weights'
    dtype, or are empty [0] tensors when ``compute_dw`` is False."""
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1] // 2
    dq = _common.new_empty_like(gq)
    dk = _common.new_empty_like(gk)
    n_tok = B * T
    if compute_dw:
        dqw = _common.new_empty_like(q_weight)
        dkw = _common.new_empty_like(k_weight)
    else:
        dqw = q_weight.new_empty(0)
        dkw = k_weight.new_empty(0)
    if n_tok == 0 or (HQ == 0 and HK == 0):
        if compute_dw:
            dqw.zero_()
            dkw.zero_()
        return dq, dk, dqw, dkw
    cfg = launch_config("bwd", n_tok, HQ, HK, D, half, q.device)
    P = cfg.programs
    part = _common.new_empty((2, P, D) if compute_dw else (1,), dtype=torch.float32, device=q.device)
    _BWD.launch(
        (P,), q, k, gq, gk, q_weight, k_weight, cos, sin, dq, dk, part, n_tok, T, float(eps), float(offset),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        gq.stride(0), gq.stride(1), gq.stride(2), gk.stride(0), gk.stride(1), gk.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        *cos_sin_strides(cos, sin),
        HQ=HQ, HK=HK, HALF=half, D=D, BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk, BLOCK_HALF=cfg.block_half,
        BLOCK_PASS=cfg.block_pass, GEMMA=gemma, COMPUTE_DW=compute_dw, num_warps=cfg.num_warps)
    if compute_dw:
        _reduce.column_sums(part, dqw, dkw)
    return dq, dk, dqw, dkw


@torch.library.custom_op("swift_liger::qk_norm_rope_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, eps: float, offset: float, gemma: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _fwd_launch(q, k, q_weight, k_weight, cos, sin, eps, offset, gemma)


@_fwd_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, offset, gemma):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("swift_liger::qk_norm_rope_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, gq: torch.Tensor, gk: torch.Tensor, q_weight: torch.Tensor,
            k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, offset: float, gemma: bool,
            compute_dw: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_launch(q, k, gq, gk, q_weight, k_weight, cos, sin, eps, offset, gemma, compute_dw)


@_bwd_op.register_fake
def _(q, k, gq, gk, q_weight, k_weight, cos, sin, eps, offset, gemma, compute_dw):
    if compute_dw:
        return torch.empty_like(gq), torch.empty_like(gk), torch.empty_like(q_weight), torch.empty_like(k_weight)
    return torch.empty_like(gq), torch.empty_like(gk), q_weight.new_empty(0), k_weight.new_empty(0)


class QKNormRoPEFunction(torch.autograd.Function):
    """Autograd wrapper. q [B, Hq, T, D], k [B, Hk, T, D], weights [D], cos/sin [Bc, T, Dr]
    (validated by ``qk_norm_rope``)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, offset, gemma):
        qo, ko = _common.compiled_or_eager("swift_liger::qk_norm_rope_fwd", _fwd_launch)(
            q, k, q_weight, k_weight, cos, sin, eps, offset, gemma)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        return qo, ko

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        need_qw, need_kw = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        compute_dw = bool(need_qw or need_kw)
        dq, dk, dqw, dkw = _common.compiled_or_eager("swift_liger::qk_norm_rope_bwd", _bwd_launch)(
            q, k, last_dim_contiguous(gq), last_dim_contiguous(gk), q_weight, k_weight, cos, sin,
            ctx.eps, ctx.offset, ctx.gemma, compute_dw)
        return dq, dk, (dqw if need_qw else None), (dkw if need_kw else None), None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Reference and public function
# ---------------------------------------------------------------------------------------------------------------

def _rms_norm_hf(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    """HF eager per-head RMSNorm over the last dim (Qwen3RMSNorm for "llama", Gemma3RMSNorm for "gemma").
    Computes in fp32 (float64 inputs stay float64, so the same code is the float64 reference)."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (h * (offset + w.to(h.dtype))).to(dtype)
    return (offset + w) * h.to(dtype)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0,
                           casting: str = "llama", unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face eager q_norm -> k_norm -> apply_rotary_pos_emb (rounding where HF rounds); same shapes as
    ``qk_norm_rope``. Outputs are cast to q's dtype."""
    qn = _rms_norm_hf(q, q_weight, eps, offset, casting)
    kn = _rms_norm_hf(k, k_weight, eps, offset, casting)
    qo, ko = apply_rope_reference(qn, kn, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return qo.to(q.dtype), ko.to(k.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0,
                 casting: str = "llama", unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """rope(rmsnorm(q, q_weight)), rope(rmsnorm(k, k_weight)) in one launch (RMSNorm per head over head_dim D).

    Args:
        q: [B, Hq, T, D] (unsqueeze_dim=1) or [B, T, Hq, D] (unsqueeze_dim=2); any strides, last dim contiguous.
        k: [B, Hk, T, D] / [B, T, Hk, D]; same dtype as q.
        q_weight, k_weight: [D], one float dtype for both (grads in that dtype, from fp32 partials).
        cos, sin: [B, T, Dr], [1, T, Dr] or [T, Dr]; Dr <= D even; only the first Dr dims rotate.
        eps: > 0. offset: added to the weight ((1 + w) for Gemma3: casting="gemma", offset=1.0).
        casting: "llama" (Qwen3RMSNorm: fp32 normalize, round to q's dtype, times weight) or "gemma" (fp32 throughout,
            round once).
    Returns:
        (q_out, k_out) with q's / k's shape, dtype and memory layout (``empty_like``).
    """
    q4, k4, cos3, sin3, transposed = check_rope_args(q, k, cos, sin, unsqueeze_dim, op="qk_norm_rope")
    D = q4.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        _common.check_tensor(name, w, ndim=1)
        if w.shape[0] != D:
            raise ValueError(f"qk_norm_rope: {name} must have shape [{D}] (head_dim), got {tuple(w.shape)}")
        _common.check_last_dim_contiguous(name, w)
    _common.check_same_dtype(q_weight=q_weight, k_weight=k_weight)
    _common.check_same_device(q=q, q_weight=q_weight, k_weight=k_weight)
    _common.check_positive("eps", eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be a number, got {offset!r}")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {', '.join(CASTINGS)}, got {casting!r}")
    if not _common.use_triton(q) or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps=eps, offset=offset, casting=casting,
                                      unsqueeze_dim=unsqueeze_dim)
    if _common.records_grad(q4, k4, q_weight, k_weight):
        qo, ko = QKNormRoPEFunction.apply(q4, k4, q_weight, k_weight, cos3, sin3, float(eps), float(offset),
                                          casting == "gemma")
    else:
        qo, ko = _common.compiled_or_eager("swift_liger::qk_norm_rope_fwd", _fwd_launch)(
            q4, k4, q_weight, k_weight, cos3, sin3, float(eps), float(offset), casting == "gemma")
    if transposed:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko
