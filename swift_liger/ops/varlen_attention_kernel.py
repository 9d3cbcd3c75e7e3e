"""Causal attention over packed rows (several documents per row), forward and backward, GQA-aware.

    out[b, i, h, :] = sum_j softmax_j(s_ij) v[b, h // G, j, :]     over keys j with
        doc(b, j) == doc(b, i),  j <= i,  i - j < window (when given)
    s_ij = scale * q[b, h, i, :] . k[b, h // G, j, :]    (softcap c: c * tanh(s_ij / c))

A row's documents are contiguous runs of equal ``seq_ids`` (what packing and padding-free batching produce:
position ids restart at each document). ``doc_bounds`` turns the ids into each token's document start and end,
computed once per forward and shared by every layer; the kernels read the start of a query block's first document
and the end of a key block's last document, so a block never visits keys of another document: a row of n documents
costs the sum of their own causal work, not the row's. FlashAttention-2's order of work: the forward keeps a running
max and sum per query row (log-sum-exp saved for the backward); the backward runs one program per key block for
dK/dV (looping over the G query heads of its KV head and the query blocks that can see it: no atomics) and one per
query block for dQ.

Pure kernel module: no transformers imports. Layouts: q [B, Hq, T, D], k/v [B, Hkv, T, D] (any strides with a
contiguous last dim: transformers hands over transposed views), out [B, T, Hq, D] (transformers' attention-output
layout), gradients in their input's layout.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _common, _launch

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """One kernel's tiles: block_m query rows by block_n keys, warps, pipeline stages."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


LAUNCH_CONFIGS = {"fwd": AttnConfig, "dkdv": AttnConfig, "dq": AttnConfig}

_C = AttnConfig
# Most preferred first, per kernel kind and padded head dim (<= 64, <= 128, 256). The first candidate whose estimated
# shared memory fits the device is launched; 32-bit inputs skip the first one (its fp32 tiles spill registers).
# Firsts from H200 tile sweeps (docs/benchmarks/attention_packed_h200.md): head dim 128, dK/dV 64x128 and dQ 128x64
# took 7B heads' fwd+bwd from 5.54 to 4.79 ms; head dim 256, dK/dV 64x64 and dQ 128x32 each cut 1.8 / 2.8 ms off 13.97
# (timed one at a time); head dim 64 keeps session 18's tiles (not swept since the dK/dV step was transposed).
CANDIDATES = {
    ("fwd", 64): (_C(128, 64, 4, 3), _C(64, 64, 4, 2), _C(64, 32, 4, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
    ("fwd", 128): (_C(128, 64, 8, 3), _C(64, 64, 4, 2), _C(64, 32, 4, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
    ("fwd", 256): (_C(64, 64, 8, 2), _C(64, 32, 4, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
    ("dkdv", 64): (_C(32, 128, 8, 3), _C(32, 64, 4, 2), _C(16, 64, 4, 2), _C(16, 32, 4, 1), _C(16, 16, 4, 1)),
    ("dkdv", 128): (_C(64, 128, 8, 3), _C(32, 128, 8, 3), _C(32, 64, 4, 2), _C(16, 64, 4, 2), _C(16, 32, 4, 1),
                    _C(16, 16, 4, 1)),
    ("dkdv", 256): (_C(64, 64, 8, 2), _C(32, 64, 8, 2), _C(16, 64, 4, 2), _C(16, 32, 4, 1), _C(16, 16, 4, 1)),
    ("dq", 64): (_C(128, 32, 8, 3), _C(64, 32, 4, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
    ("dq", 128): (_C(128, 64, 8, 3), _C(128, 32, 8, 3), _C(64, 32, 4, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
    ("dq", 256): (_C(128, 32, 8, 2), _C(64, 32, 8, 2), _C(32, 32, 4, 1), _C(16, 16, 4, 1)),
}


def shared_estimate(kind: str, cfg: AttnConfig, block_d: int, elt_bytes: int, cc: int = 90) -> int:
    """Upper estimate of shared memory, bytes: the resident tiles (fwd: Q; dkdv: K, V; dq: Q, dO) plus the streamed
    pair per pipeline stage, plus one fp32 score tile. Against the compiled kernels (tests/ops/test_portability.py
    checks the chosen ones on every target) it was at or above the real figure."""
    if kind == "fwd":
        rows = cfg.block_m + 2 * cfg.block_n * cfg.num_stages
    elif kind == "dkdv":
        rows = 2 * cfg.block_n + 2 * cfg.block_m * cfg.num_stages
        # pre-Ampere: operand layout changes go through shared memory (98304 B real, sm_75 bf16 D=256 16x32)
        if cc < 80:
            rows *= 2
    else:
        rows = 2 * cfg.block_m + 2 * cfg.block_n * cfg.num_stages
    return rows * block_d * elt_bytes + cfg.block_m * cfg.block_n * 4


def config_for(kind: str, block_d: int, elt_bytes: int, device) -> AttnConfig:
    """Tiles for a kernel kind, padded head dim and input width on a device (torch.device or _common.Target).
    Under the interpreter: 16 x 16 tiles (small programs, fast tests)."""
    t = _common.target(device)
    if t.type != "cuda":
        return AttnConfig(16, 16, 1, 1)
    cands = CANDIDATES[(kind, 64 if block_d <= 64 else 128 if block_d <= 128 else 256)]
    if elt_bytes >= 4:
        cands = cands[1:]
    for cfg in cands:
        if shared_estimate(kind, cfg, block_d, elt_bytes, t.cc) <= t.max_shared:
            return cfg
    return cands[-1]


def launch_config(kind: str, block_d: int, elt_bytes: int, device) -> AttnConfig:
    return _common.apply_override(__name__, kind, config_for(kind, block_d, elt_bytes, device))


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # tl.exp only (runs under the interpreter); exact enough in fp32 (|error| < 1e-7 away from 0, overflow -> +-1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _scores(a, b, mq, nk, docq, dock, qk_scale, softcap, window,
            MASK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    """Scores of dot(a, b) (masked to -inf under MASK) and, under SOFTCAP, tanh(raw / softcap) (for the backward).
    Under SOFTCAP in the log2 domain; otherwise raw: _exp2_minus folds qk_scale * log2(e) into the exponent's FMA
    (sm_90 SASS at head dim 128: 90 fewer FP32 instructions in the forward, 64 in dK/dV). Either [BM, BN] (a = q,
    b = k^T; mq = m[:, None], nk = n[None, :], docs alike) or transposed [BN, BM] (a = k, b = q^T; mq = m[None, :],
    nk = n[:, None])."""
    s = _dot(a, b, IEEE)
    if SOFTCAP:
        t = _tanh(s * (qk_scale / softcap))          # qk_scale here is the natural-log scale
        s = (softcap * LOG2E) * t
    else:
        t = s
    if MASK:
        valid = (docq == dock) & (nk <= mq)
        if WINDOW:
            valid = valid & (mq - nk < window)
        s = tl.where(valid, s, float("-inf"))
    return s, t


@triton.jit
def _exp2_minus(s, sub, qk_scale, SOFTCAP: tl.constexpr):
    """exp2(log2-domain score - sub) for _scores' s: 0 where masked (-inf)."""
    if SOFTCAP:
        return tl.exp2(s - sub)
    return tl.exp2(s * (qk_scale * LOG2E) - sub)


@triton.jit
def _key_range(lo_ptr, m0, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Key blocks a query block visits, [start, end) in BLOCK_N steps, and within it [mid_lo, mid_hi): the blocks
    every row of the query block sees whole (one document, below the diagonal, inside the window), which need no
    mask."""
    m_last = tl.minimum(m0 + BLOCK_M, T) - 1
    doc_first = tl.load(lo_ptr + m0)
    doc_last = tl.load(lo_ptr + m_last)
    start = doc_first
    full_lo = (doc_first + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if WINDOW:
        start = tl.maximum(start, m0 - window + 1)
        full_lo = tl.maximum(full_lo, (tl.maximum(m_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    start = (start // BLOCK_N) * BLOCK_N
    end = m_last + 1
    full_hi = (m0 + 1) // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, start), end)
    mid_hi = tl.maximum(tl.minimum(full_hi, end), mid_lo)
    one = doc_first == doc_last
    mid_lo = tl.where(one, mid_lo, start)
    mid_hi = tl.where(one, mid_hi, start)
    return start, mid_lo, mid_hi, end


@triton.jit
def _load_keys(k_base, v_base, lo_ptr, n0, d, dmask, T, sk_t, sv_t, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               UPCAST: tl.constexpr):
    """One key block: positions n, K and V tiles, and (under MASK) each key's document; unmasked blocks lie wholly
    inside T and one document, so only the head-dim padding is masked."""
    n = n0 + tl.arange(0, BLOCK_N)
    if MASK:
        nmask = n < T
        kvm = nmask[:, None] & dmask[None, :]
        doc_k = tl.load(lo_ptr + n, mask=nmask, other=-2)
    else:
        kvm = dmask[None, :]
        doc_k = n
    k = tl.load(k_base + n[:, None] * sk_t + d[None, :], mask=kvm, other=0.0)
    v = tl.load(v_base + n[:, None] * sv_t + d[None, :], mask=kvm, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return n, k, v, doc_k


@triton.jit
def _fwd_step(q, k_base, v_base, lo_ptr, n0, m, doc_q, m_i, l_i, acc, d, dmask, T, sk_t, sv_t, scale, softcap,
              window, BLOCK_N: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
              UPCAST: tl.constexpr, IEEE: tl.constexpr):
    n, k, v, doc_k = _load_keys(k_base, v_base, lo_ptr, n0, d, dmask, T, sk_t, sv_t, BLOCK_N, MASK, UPCAST)
    s, _t = _scores(q, tl.trans(k), m[:, None], n[None, :], doc_q[:, None], doc_k[None, :], scale, softcap, window,
                    MASK, SOFTCAP, WINDOW, IEEE)
    if SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * (scale * LOG2E))    # the scale is positive: max commutes with it
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with no visible key yet
    alpha = tl.exp2(m_i - m_safe)
    p = _exp2_minus(s, m_safe[:, None], scale, SOFTCAP)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _query_block(T, HQ, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Coordinates of a (query block, batch x query head) program; the longest query blocks (most keys under the
    causal mask) get the lowest program ids, so they start first and the tail at the end is short."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    m0 = pid_m * BLOCK_M
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    return pid_bh, b, h, h // G, m0, m, d, m < T, d < D


# T and the bounds' row stride (T) change with every packed row's length; left unspecialised, one compile per
# configuration serves every length (specialised, Triton compiles again whenever T % 16 == 0 flips: seconds per step).
@triton.jit(do_not_specialize=["T", "sd_b"])
def _varlen_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lo_ptr, T, HQ, scale, softcap, window,
                       sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_t, so_h, sd_b,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                       IEEE: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * HQ). o rows and lse (log2 domain, [B, HQ, T] fp32)."""
    pid_bh, b, h, hk, m0, m, d, mmask, dmask = _query_block(T, HQ, G, D, BLOCK_D, BLOCK_M)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_t + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    lo_b = lo_ptr + b * sd_b
    doc_q = tl.load(lo_b + m, mask=mmask, other=-1)
    start, mid_lo, mid_hi, end = _key_range(lo_b, m0, T, window, BLOCK_M, BLOCK_N, WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    for n0 in range(start, mid_lo, BLOCK_N):
        m_i, l_i, acc = _fwd_step(q, k_base, v_base, lo_b, n0, m, doc_q, m_i, l_i, acc, d, dmask, T, sk_t, sv_t,
                                  scale, softcap, window, BLOCK_N, True, SOFTCAP, WINDOW, UPCAST, IEEE)
    for n0 in range(mid_lo, mid_hi, BLOCK_N):
        m_i, l_i, acc = _fwd_step(q, k_base, v_base, lo_b, n0, m, doc_q, m_i, l_i, acc, d, dmask, T, sk_t, sv_t,
                                  scale, softcap, window, BLOCK_N, False, SOFTCAP, WINDOW, UPCAST, IEEE)
    for n0 in range(mid_hi, end, BLOCK_N):
        m_i, l_i, acc = _fwd_step(q, k_base, v_base, lo_b, n0, m, doc_q, m_i, l_i, acc, d, dmask, T, sk_t, sv_t,
                                  scale, softcap, window, BLOCK_N, True, SOFTCAP, WINDOW, UPCAST, IEEE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + m[:, None] * so_t + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + pid_bh * T + m, m_i + tl.log2(l_safe), mask=mmask)


@triton.jit(do_not_specialize=["T"])
def _varlen_delta_kernel(o_ptr, do_ptr, delta_ptr, T, HQ, so_b, so_t, so_h, sg_b, sg_t, sg_h,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * HQ). delta[b, h, i] = sum_d o * dO (fp32): the softmax backward's row term."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    msk = (m < T)[:, None] & (d < D)[None, :]
    o = tl.load(o_ptr + b * so_b + h * so_h + m[:, None] * so_t + d[None, :], mask=msk, other=0.0).to(tl.float32)
    g = tl.load(do_ptr + b * sg_b + h * sg_h + m[:, None] * sg_t + d[None, :], mask=msk, other=0.0).to(tl.float32)
    tl.store(delta_ptr + pid_bh * T + m, tl.sum(o * g, 1), mask=m < T)


@triton.jit
def _dkdv_step(k, v, dk, dv, q_base, do_base, lse_base, delta_base, lo_ptr, m0, n, doc_k, d, dmask, T, sq_t, sg_t,
               scale, softcap, window, BLOCK_M: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
               WINDOW: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One query block's share of dK and dV, in the transposed form [keys, queries]: P^T and dS^T come out of the
    products as the left operands of the dV and dK products, so no register tile is transposed."""
    m = m0 + tl.arange(0, BLOCK_M)
    if MASK:
        mmask = m < T
        qm = mmask[:, None] & dmask[None, :]
        qtm = dmask[:, None] & mmask[None, :]
        lse = tl.load(lse_base + m, mask=mmask, other=0.0)
        delta = tl.load(delta_base + m, mask=mmask, other=0.0)
        doc_q = tl.load(lo_ptr + m, mask=mmask, other=-1)
    else:
        qm = dmask[None, :]
        qtm = dmask[:, None]
        lse = tl.load(lse_base + m)
        delta = tl.load(delta_base + m)
        doc_q = m
    qt = tl.load(q_base + m[None, :] * sq_t + d[:, None], mask=qtm, other=0.0)    # [BLOCK_D, BM]
    do = tl.load(do_base + m[:, None] * sg_t + d[None, :], mask=qm, other=0.0)    # [BM, BLOCK_D]
    if UPCAST:
        qt = qt.to(tl.float32)
        do = do.to(tl.float32)
    st, tt = _scores(k, qt, m[None, :], n[:, None], doc_q[None, :], doc_k[:, None], scale, softcap, window,
                     MASK, SOFTCAP, WINDOW, IEEE)                   # [BN, BM]
    pt = _exp2_minus(st, lse[None, :], scale, SOFTCAP)            # 0 where masked
    dv += _dot(pt.to(do.dtype), do, IEEE)
    dpt = _dot(v, tl.trans(do), IEEE)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - tt * tt)
    dk += _dot(dst.to(qt.dtype), tl.trans(qt), IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["T", "sd_b"])
def _varlen_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, lo_ptr, hi_ptr, dk_ptr, dv_ptr,
                        T, HQ, HKV, scale, softcap, window,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_t, sg_h,
                        sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, sd_b,
                        G: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Grid (cdiv(T, BLOCK_N), B * HKV, G // HPP). dK and dV of one key block, summed over HPP of the G query heads
    that share it; with HPP < G, dk/dv are fp32 partials [B, HKV * G // HPP, T, D] that the launcher sums."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    nmask = n < T
    dmask = d < D
    kvm = nmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + b * sk_b + hk * sk_h + n[:, None] * sk_t + d[None, :], mask=kvm, other=0.0)
    v = tl.load(v_ptr + b * sv_b + hk * sv_h + n[:, None] * sv_t + d[None, :], mask=kvm, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    lo_b = lo_ptr + b * sd_b
    doc_k = tl.load(lo_b + n, mask=nmask, other=-2)
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    doc_end = tl.load(hi_ptr + b * sd_b + last)           # end of the last key's document
    q_end = doc_end
    full_hi = doc_end // BLOCK_M * BLOCK_M
    if WINDOW:
        q_end = tl.minimum(q_end, last + window)
        full_hi = tl.minimum(full_hi, (n0 + window) // BLOCK_M * BLOCK_M)
    q_start = (n0 // BLOCK_M) * BLOCK_M
    # query blocks that see every key of this block (all rows after its last key, in its one document, in window)
    full_lo = (n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    mid_lo = tl.minimum(tl.maximum(full_lo, q_start), q_end)
    mid_hi = tl.maximum(tl.minimum(full_hi, q_end), mid_lo)
    one = (tl.load(lo_b + n0) == tl.load(lo_b + last)) & (last == n0 + BLOCK_N - 1)
    mid_lo = tl.where(one, mid_lo, q_start)
    mid_hi = tl.where(one, mid_hi, q_start)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(HPP):
        h = hk * G + split * HPP + g
        q_base = q_ptr + b * sq_b + h * sq_h
        do_base = do_ptr + b * sg_b + h * sg_h
        lse_base = lse_ptr + (b * HQ + h) * T
        delta_base = delta_ptr + (b * HQ + h) * T
        for m0 in range(q_start, mid_lo, BLOCK_M):
            dk, dv = _dkdv_step(k, v, dk, dv, q_base, do_base, lse_base, delta_base, lo_b, m0, n, doc_k, d, dmask,
                                T, sq_t, sg_t, scale, softcap, window, BLOCK_M, True, SOFTCAP, WINDOW, UPCAST, IEEE)
        for m0 in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = _dkdv_step(k, v, dk, dv, q_base, do_base, lse_base, delta_base, lo_b, m0, n, doc_k, d, dmask,
                                T, sq_t, sg_t, scale, softcap, window, BLOCK_M, False, SOFTCAP, WINDOW, UPCAST, IEEE)
        for m0 in range(mid_hi, q_end, BLOCK_M):
            dk, dv = _dkdv_step(k, v, dk, dv, q_base, do_base, lse_base, delta_base, lo_b, m0, n, doc_k, d, dmask,
                                T, sq_t, sg_t, scale, softcap, window, BLOCK_M, True, SOFTCAP, WINDOW, UPCAST, IEEE)
    dk = dk * scale
    ho = hk * (G // HPP) + split
    tl.store(dk_ptr + b * sdk_b + ho * sdk_h + n[:, None] * sdk_t + d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=kvm)
    tl.store(dv_ptr + b * sdv_b + ho * sdv_h + n[:, None] * sdv_t + d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kvm)


@triton.jit
def _dq_step(q, do, lse, delta, dq, k_base, v_base, lo_ptr, n0, m, doc_q, d, dmask, T, sk_t, sv_t, scale, softcap,
             window, BLOCK_N: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
             UPCAST: tl.constexpr, IEEE: tl.constexpr):
    n, k, v, doc_k = _load_keys(k_base, v_base, lo_ptr, n0, d, dmask, T, sk_t, sv_t, BLOCK_N, MASK, UPCAST)
    s, t = _scores(q, tl.trans(k), m[:, None], n[None, :], doc_q[:, None], doc_k[None, :], scale, softcap, window,
                   MASK, SOFTCAP, WINDOW, IEEE)
    p = _exp2_minus(s, lse[:, None], scale, SOFTCAP)
    dp = _dot(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq += _dot(ds.to(k.dtype), k, IEEE)
    return dq


@triton.jit(do_not_specialize=["T", "sd_b"])
def _varlen_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, lo_ptr, dq_ptr, T, HQ, scale, softcap,
                      window, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_t, sg_h,
                      sdq_b, sdq_h, sdq_t, sd_b,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                      IEEE: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * HQ). dQ of one query block over the keys the forward visited."""
    pid_bh, b, h, hk, m0, m, d, mmask, dmask = _query_block(T, HQ, G, D, BLOCK_D, BLOCK_M)
    qm = mmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_t + d[None, :], mask=qm, other=0.0)
    do = tl.load(do_ptr + b * sg_b + h * sg_h + m[:, None] * sg_t + d[None, :], mask=qm, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + pid_bh * T + m, mask=mmask, other=0.0)
    delta = tl.load(delta_ptr + pid_bh * T + m, mask=mmask, other=0.0)
    lo_b = lo_ptr + b * sd_b
    doc_q = tl.load(lo_b + m, mask=mmask, other=-1)
    start, mid_lo, mid_hi, end = _key_range(lo_b, m0, T, window, BLOCK_M, BLOCK_N, WINDOW)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    for n0 in range(start, mid_lo, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, dq, k_base, v_base, lo_b, n0, m, doc_q, d, dmask, T, sk_t, sv_t, scale,
                      softcap, window, BLOCK_N, True, SOFTCAP, WINDOW, UPCAST, IEEE)
    for n0 in range(mid_lo, mid_hi, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, dq, k_base, v_base, lo_b, n0, m, doc_q, d, dmask, T, sk_t, sv_t, scale,
                      softcap, window, BLOCK_N, False, SOFTCAP, WINDOW, UPCAST, IEEE)
    for n0 in range(mid_hi, end, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, dq, k_base, v_base, lo_b, n0, m, doc_q, d, dmask, T, sk_t, sv_t, scale,
                      softcap, window, BLOCK_N, True, SOFTCAP, WINDOW, UPCAST, IEEE)
    dq = dq * scale
    tl.store(dq_ptr + b * sdq_b + h * sdq_h + m[:, None] * sdq_t + d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=qm)


_FWD = _launch.FastLaunch(_varlen_fwd_kernel)
_DELTA = _launch.FastLaunch(_varlen_delta_kernel)
_DKDV = _launch.FastLaunch(_varlen_dkdv_kernel)
_DQ = _launch.FastLaunch(_varlen_dq_kernel)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------

def _flags(q: torch.Tensor, softcap: float, window: int):
    return dict(SOFTCAP=softcap > 0, WINDOW=window > 0, UPCAST=_common.INTERPRET, IEEE=q.dtype == torch.float32)


def _fwd_launch(q, k, v, lo, scale: float, softcap: float, window: int) -> Tuple[torch.Tensor, torch.Tensor]:
    B, HQ, T, D = q.shape
    HKV = k.shape[1]
    out = _common.new_empty((B, T, HQ, D), dtype=q.dtype, device=q.device)
    lse = _common.new_empty((B, HQ, T), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    block_d = max(16, _common.next_pow2(D))
    cfg = launch_config("fwd", block_d, q.element_size(), q.device)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    _FWD.launch((_common.cdiv(T, cfg.block_m), B * HQ),
                q, k, v, out, lse, lo, T, HQ, scale, softcap, window,
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2], lo.stride(0),
                G=HQ // HKV, D=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                **_flags(q, softcap, window), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def _bwd_launch(grad, q, k, v, out, lse, lo, hi, scale: float, softcap: float, window: int):
    B, HQ, T, D = q.shape
    HKV = k.shape[1]
    dq, dk, dv = _common.new_empty_like(q), _common.new_empty_like(k), _common.new_empty_like(v)
    if q.numel() == 0:
        return dq, dk, dv
    block_d = max(16, _common.next_pow2(D))
    flags = _flags(q, softcap, window)
    delta = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    so, sg = out.stride(), grad.stride()
    dm = 16 if _common.INTERPRET else 64
    _DELTA.launch((_common.cdiv(T, dm), B * HQ), out, grad, delta, T, HQ, so[0], so[1], so[2], sg[0], sg[1], sg[2],
                  D=D, BLOCK_D=block_d, BLOCK_M=dm, UPCAST=flags["UPCAST"], num_warps=4)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    sdq, sdk, sdv = dq.stride(), dk.stride(), dv.stride()
    elt = q.element_size()
    cfg = launch_config("dkdv", block_d, elt, q.device)
    G = HQ // HKV
    # one program per (key block, query head) when grouped: G x the programs (at Qwen2.5-7B shapes, 8k tokens, 256
    # programs for 132 SMs otherwise, the first ones with the most work); the fp32 partials are summed after
    hpp = 1 if G > 1 else G
    if hpp < G:
        dk_out, dv_out = dk, dv
        dk = torch.empty((B, HQ // hpp, T, D), dtype=torch.float32, device=q.device)
        dv = torch.empty_like(dk)
        sdk, sdv = dk.stride(), dv.stride()
    _DKDV.launch((_common.cdiv(T, cfg.block_n), B * HKV, G // hpp),
                 q, k, v, grad, lse, delta, lo, hi, dk, dv, T, HQ, HKV, scale, softcap, window,
                 sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sg[0], sg[1], sg[2],
                 sdk[0], sdk[1], sdk[2], sdv[0], sdv[1], sdv[2], lo.stride(0),
                 G=G, HPP=hpp, D=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if hpp < G:
        dk_out.copy_(dk.view(B, HKV, G // hpp, T, D).sum(2))
        dv_out.copy_(dv.view(B, HKV, G // hpp, T, D).sum(2))
        dk, dv = dk_out, dv_out
    cfg = launch_config("dq", block_d, elt, q.device)
    _DQ.launch((_common.cdiv(T, cfg.block_m), B * HQ),
               q, k, v, grad, lse, delta, lo, dq, T, HQ, scale, softcap, window,
               sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sg[0], sg[1], sg[2],
               sdq[0], sdq[1], sdq[2], lo.stride(0),
               G=HQ // HKV, D=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq, dk, dv


@torch.library.custom_op("swift_liger::varlen_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, scale: float, softcap: float,
            window: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return _fwd_launch(q, k, v, lo, scale, softcap, window)


@_fwd_op.register_fake
def _(q, k, v, lo, scale, softcap, window):
    B, HQ, T, D = q.shape
    return q.new_empty((B, T, HQ, D)), q.new_empty((B, HQ, T), dtype=torch.float32)


@torch.library.custom_op("swift_liger::varlen_attention_bwd", mutates_args=())
def _bwd_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float, softcap: float,
            window: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_launch(grad, q, k, v, out, lse, lo, hi, scale, softcap, window)


@_bwd_op.register_fake
def _(grad, q, k, v, out, lse, lo, hi, scale, softcap, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class VarlenAttentionFunction(torch.autograd.Function):
    """Autograd wrapper; under torch.compile the launches are the custom ops above (one opaque node each, so a
    compiled decoder layer keeps packed attention without a graph break)."""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale, softcap, window):
        out, lse = _common.compiled_or_eager("swift_liger::varlen_attention_fwd", _fwd_launch)(
            q, k, v, lo, scale, softcap, window)
        ctx.save_for_backward(q, k, v, out, lse, lo, hi)
        ctx.args = (scale, softcap, window)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, lo, hi = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dq, dk, dv = _common.compiled_or_eager("swift_liger::varlen_attention_bwd", _bwd_launch)(
            grad, q, k, v, out, lse, lo, hi, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def doc_bounds(seq_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's document start and end (exclusive), int32 [B, T], from document ids [B, T] whose documents are
    contiguous runs of one id. The start doubles as the document's id in the kernels. Six small ops, no host sync:
    compute once per forward and pass ``bounds=`` to every layer."""
    B, T = seq_ids.shape
    idx = torch.arange(T, device=seq_ids.device, dtype=torch.int32).expand(B, T)
    new = torch.ones_like(seq_ids, dtype=torch.bool)
    new[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
    lo = torch.where(new, idx, 0).cummax(dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    hi = torch.where(last, idx + 1, T).flip(1).cummin(dim=1).values.flip(1)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def seq_ids_from_positions(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Document ids [B, T] from position ids [B, T] (a document starts where a position is not its predecessor + 1,
    as transformers reads packed rows) and an optional 2D padding mask (a run of padding is a document of its own:
    its rows are ignored downstream and attend only to themselves)."""
    first = position_ids[:, :1] - 1
    start = torch.diff(position_ids, prepend=first, dim=-1) != 1
    if attention_mask is not None:
        am = attention_mask.to(torch.bool)
        start = start | torch.cat([torch.zeros_like(am[:, :1]), am[:, 1:] != am[:, :-1]], dim=1)
    return start.cumsum(-1)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_ids: torch.Tensor, *,
                               scale: float, softcap: Optional[float] = None, window: Optional[int] = None,
                               acc_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """PyTorch reference (CPU backend and test oracle): one dense masked attention per document, math in float32
    or wider (``acc_dtype``). Differentiable."""
    B, HQ, T, D = q.shape
    G = HQ // k.shape[1]
    acc = acc_dtype or torch.promote_types(q.dtype, torch.float32)
    lo, hi = doc_bounds(seq_ids)
    rows = []
    for b in range(B):
        starts = torch.nonzero(lo[b] == torch.arange(T, device=lo.device, dtype=lo.dtype)).flatten().tolist()
        ends = starts[1:] + [T]
        parts = []
        for s0, e0 in zip(starts, ends):
            qq = q[b, :, s0:e0].to(acc)
            kk = k[b, :, s0:e0].to(acc).repeat_interleave(G, dim=0)
            vv = v[b, :, s0:e0].to(acc).repeat_interleave(G, dim=0)
            s = qq @ kk.transpose(-1, -2) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            i = torch.arange(e0 - s0, device=q.device)
            keep = i[None, :] <= i[:, None]
            if window:
                keep = keep & (i[:, None] - i[None, :] < window)
            s = s.masked_fill(~keep, float("-inf"))
            parts.append(torch.softmax(s, dim=-1) @ vv)
        rows.append(torch.cat(parts, dim=1) if parts else q.new_zeros((HQ, 0, D), dtype=acc))
    return torch.stack(rows).transpose(1, 2).to(q.dtype)


def varlen_attention_unchecked(q, k, v, bounds: Tuple[torch.Tensor, torch.Tensor], scale: float,
                               softcap: float = 0.0, window: int = 0, seq_ids: Optional[torch.Tensor] = None):
    """No argument checks: the attention function of a model calls this once per layer with bounds it computed
    once per forward. ``seq_ids`` is only read by the CPU reference (bounds carry the same information)."""
    if _common.use_triton(q):
        lo, hi = bounds
        if _common.records_grad(q, k, v):
            return VarlenAttentionFunction.apply(q, k, v, lo, hi, scale, softcap, window)
        return _common.compiled_or_eager("swift_liger::varlen_attention_fwd", _fwd_launch)(
            q, k, v, lo, scale, softcap, window)[0]
    ids = seq_ids if seq_ids is not None else bounds[0]
    return varlen_attention_reference(q, k, v, ids, scale=scale, softcap=softcap or None, window=window or None)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_ids: Optional[torch.Tensor] = None, *,
                     scale: float, softcap: Optional[float] = None, window: Optional[int] = None,
                     bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Causal attention within documents packed along each row.

    Args:
        q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] with Hq % Hkv == 0; one float dtype; last dim contiguous; D <= 256.
        seq_ids: [B, T] integer document ids, each document a contiguous run (e.g. ``seq_ids_from_positions``).
            None: one document per row.
        scale: the softmax scale (head_dim ** -0.5 for most models).
        softcap: Gemma-2's attention logit soft cap (scores become softcap * tanh(scores / softcap)); None: off.
        window: sliding window: query i sees keys j with i - j < window (transformers' convention); None: off.
        bounds: ``doc_bounds(seq_ids)`` when the caller already has it (one computation per forward).
    Returns:
        [B, T, Hq, D] in q's dtype (transformers' attention-output layout).
    """
    _common.check_qkv(q, k, v)
    B, HQ, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k and v must be [B, Hkv, T, D] = [{B}, *, {T}, {D}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[1] == 0 or HQ % k.shape[1]:
        raise ValueError(f"query heads ({HQ}) must be a multiple of KV heads ({k.shape[1]})")
    if D > 256:
        raise ValueError(f"head dim must be at most 256, got {D}")
    _common.check_positive("scale", scale)
    if softcap is not None:
        _common.check_positive("softcap", softcap)
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if seq_ids is None and bounds is None:
        seq_ids = torch.zeros((B, T), dtype=torch.int32, device=q.device)
    if seq_ids is not None:
        _common.check_tensor("seq_ids", seq_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if tuple(seq_ids.shape) != (B, T):
            raise ValueError(f"seq_ids must be [B, T] = [{B}, {T}], got {tuple(seq_ids.shape)}")
        _common.check_same_device(q=q, seq_ids=seq_ids)
    if bounds is None:
        bounds = doc_bounds(seq_ids)
    else:
        for name, t in zip(("bounds[0]", "bounds[1]"), bounds):
            _common.check_tensor(name, t, ndim=2, dtypes=(torch.int32,))
            if tuple(t.shape) != (B, T) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 [B, T] = [{B}, {T}] tensor from doc_bounds")
    return varlen_attention_unchecked(q, k, v, bounds, float(scale), float(softcap or 0.0), int(window or 0),
                                      seq_ids)
