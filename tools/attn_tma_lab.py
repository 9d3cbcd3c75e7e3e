"""Does loading attention tiles through Hopper's TMA (tensor descriptors) speed up our packed-row attention? A lab for
issue 31 (GPU, sm_90): python3 tools/attn_tma_lab.py --out $OUT/attn_tma_lab.json

The forward and the dK/dV kernel of swift_liger.ops.varlen_attention_kernel rewritten with tl.make_tensor_descriptor
loads (the same math, masks and key ranges: the module's own jit helpers) timed beside the module's kernels and SDPA
cuDNN at several tiles, one process, triton.testing.do_bench medians, outputs compared with the module's."""
import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from swift_liger.ops import varlen_attention_kernel as va
from swift_liger.ops.varlen_attention_kernel import LOG2E, _exp2_minus, _key_range, _scores, doc_bounds


@triton.jit
def _fwd_step_tma(q, k_desc, v_desc, lo_ptr, n0, m, doc_q, m_i, l_i, acc, T, scale, softcap, window,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    n = n0 + tl.arange(0, BLOCK_N)
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    if MASK:
        doc_k = tl.load(lo_ptr + n, mask=n < T, other=-2)
    else:
        doc_k = n
    s, _t = _scores(q, tl.trans(k), m[:, None], n[None, :], doc_q[:, None], doc_k[None, :], scale, softcap, window,
                    MASK, SOFTCAP, WINDOW, False)
    if SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * (scale * LOG2E))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = _exp2_minus(s, m_safe[:, None], scale, SOFTCAP)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "sd_b"])
def _fwd_tma_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lo_ptr, T, HQ, scale, softcap, window,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_t, so_h, sd_b,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    pid_bh, b, h, hk, m0, m, d, mmask, dmask = va._query_block(T, HQ, G, D, BLOCK_D, BLOCK_M)
    q_desc = tl.make_tensor_descriptor(q_ptr + b * sq_b + h * sq_h, shape=[T, D], strides=[sq_t, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(k_ptr + b * sk_b + hk * sk_h, shape=[T, D], strides=[sk_t, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(v_ptr + b * sv_b + hk * sv_h, shape=[T, D], strides=[sv_t, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    q = q_desc.load([m0, 0])
    lo_b = lo_ptr + b * sd_b
    doc_q = tl.load(lo_b + m, mask=mmask, other=-1)
    start, mid_lo, mid_hi, end = _key_range(lo_b, m0, T, window, BLOCK_M, BLOCK_N, WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, mid_lo, BLOCK_N):
        m_i, l_i, acc = _fwd_step_tma(q, k_desc, v_desc, lo_b, n0, m, doc_q, m_i, l_i, acc, T, scale, softcap,
                                      window, BLOCK_N, True, SOFTCAP, WINDOW)
    for n0 in range(mid_lo, mid_hi, BLOCK_N):
        m_i, l_i, acc = _fwd_step_tma(q, k_desc, v_desc, lo_b, n0, m, doc_q, m_i, l_i, acc, T, scale, softcap,
                                      window, BLOCK_N, False, SOFTCAP, WINDOW)
    for n0 in range(mid_hi, end, BLOCK_N):
        m_i, l_i, acc = _fwd_step_tma(q, k_desc, v_desc, lo_b, n0, m, doc_q, m_i, l_i, acc, T, scale, softcap,
                                      window, BLOCK_N, True, SOFTCAP, WINDOW)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + m[:, None] * so_t + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + pid_bh * T + m, m_i + tl.log2(l_safe), mask=mmask)


@triton.jit
def _dkdv_step_tma(k, v, dk, dv, q_desc, do_desc, lse_base, delta_base, lo_ptr, m0, n, doc_k, T, scale, softcap,
                   window, BLOCK_M: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    m = m0 + tl.arange(0, BLOCK_M)
    if MASK:
        mmask = m < T
        lse = tl.load(lse_base + m, mask=mmask, other=0.0)
        delta = tl.load(delta_base + m, mask=mmask, other=0.0)
        doc_q = tl.load(lo_ptr + m, mask=mmask, other=-1)
    else:
        lse = tl.load(lse_base + m)
        delta = tl.load(delta_base + m)
        doc_q = m
    q = q_desc.load([m0, 0])       # [BM, BLOCK_D]
    do = do_desc.load([m0, 0])     # [BM, BLOCK_D]
    qt = tl.trans(q)
    st, tt = _scores(k, qt, m[None, :], n[:, None], doc_q[None, :], doc_k[:, None], scale, softcap, window,
                     MASK, SOFTCAP, WINDOW, False)                   # [BN, BM]
    pt = _exp2_minus(st, lse[None, :], scale, SOFTCAP)
    dv += tl.dot(pt.to(do.dtype), do)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - tt * tt)
    dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.jit(do_not_specialize=["T", "sd_b"])
def _dkdv_tma_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, lo_ptr, hi_ptr, dk_ptr, dv_ptr,
                     T, HQ, HKV, scale, softcap, window,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_t, sg_h,
                     sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, sd_b,
                     G: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    nmask = n < T
    kvm = nmask[:, None] & (d < D)[None, :]
    k_desc = tl.make_tensor_descriptor(k_ptr + b * sk_b + hk * sk_h, shape=[T, D], strides=[sk_t, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(v_ptr + b * sv_b + hk * sv_h, shape=[T, D], strides=[sv_t, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    lo_b = lo_ptr + b * sd_b
    doc_k = tl.load(lo_b + n, mask=nmask, other=-2)
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    doc_end = tl.load(hi_ptr + b * sd_b + last)
    q_end = doc_end
    full_hi = doc_end // BLOCK_M * BLOCK_M
    if WINDOW:
        q_end = tl.minimum(q_end, last + window)
        full_hi = tl.minimum(full_hi, (n0 + window) // BLOCK_M * BLOCK_M)
    q_start = (n0 // BLOCK_M) * BLOCK_M
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
        q_desc = tl.make_tensor_descriptor(q_ptr + b * sq_b + h * sq_h, shape=[T, D], strides=[sq_t, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(do_ptr + b * sg_b + h * sg_h, shape=[T, D], strides=[sg_t, 1],
                                            block_shape=[BLOCK_M, BLOCK_D])
        lse_base = lse_ptr + (b * HQ + h) * T
        delta_base = delta_ptr + (b * HQ + h) * T
        for m0 in range(q_start, mid_lo, BLOCK_M):
            dk, dv = _dkdv_step_tma(k, v, dk, dv, q_desc, do_desc, lse_base, delta_base, lo_b, m0, n, doc_k, T,
                                    scale, softcap, window, BLOCK_M, True, SOFTCAP, WINDOW)
        for m0 in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = _dkdv_step_tma(k, v, dk, dv, q_desc, do_desc, lse_base, delta_base, lo_b, m0, n, doc_k, T,
                                    scale, softcap, window, BLOCK_M, False, SOFTCAP, WINDOW)
        for m0 in range(mid_hi, q_end, BLOCK_M):
            dk, dv = _dkdv_step_tma(k, v, dk, dv, q_desc, do_desc, lse_base, delta_base, lo_b, m0, n, doc_k, T,
                                    scale, softcap, window, BLOCK_M, True, SOFTCAP, WINDOW)
    dk = dk * scale
    ho = hk * (G // HPP) + split
    tl.store(dk_ptr + b * sdk_b + ho * sdk_h + n[:, None] * sdk_t + d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=kvm)
    tl.store(dv_ptr + b * sdv_b + ho * sdv_h + n[:, None] * sdv_t + d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kvm)


def _fwd(kernel, q, k, v, lo, scale, cfg, **flags):
    """A forward kernel (ours or the TMA one) at cfg's tiles: out [B, T, HQ, D], lse."""
    B, HQ, T, D = q.shape
    out = torch.empty((B, T, HQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    kernel[(triton.cdiv(T, cfg.block_m), B * HQ)](
        q, k, v, out, lse, lo, T, HQ, scale, 0.0, 0, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        so[0], so[1], so[2], lo.stride(0), G=HQ // k.shape[1], D=D, BLOCK_D=D, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, SOFTCAP=False, WINDOW=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    return out, lse


def fwd_tma(q, k, v, lo, scale, cfg):
    return _fwd(_fwd_tma_kernel, q, k, v, lo, scale, cfg)


def fwd_ours(q, k, v, lo, scale, cfg):
    """The module's forward kernel at the given tiles."""
    return _fwd(va._varlen_fwd_kernel, q, k, v, lo, scale, cfg, UPCAST=False, IEEE=False)


def _dkdv(kernel, q, k, v, go, lse, delta, lo, hi, scale, cfg, **flags):
    """fp32 partials per query head, as the module's launcher makes them for grouped heads."""
    B, HQ, T, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    dk = torch.empty((B, HQ, T, D), dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    sq, sk, sv, sg, sdk, sdv = q.stride(), k.stride(), v.stride(), go.stride(), dk.stride(), dv.stride()
    kernel[(triton.cdiv(T, cfg.block_n), B * HKV, G)](
        q, k, v, go, lse, delta, lo, hi, dk, dv, T, HQ, HKV, scale, 0.0, 0,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sg[0], sg[1], sg[2],
        sdk[0], sdk[1], sdk[2], sdv[0], sdv[1], sdv[2], lo.stride(0),
        G=G, HPP=1, D=D, BLOCK_D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SOFTCAP=False, WINDOW=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    return dk, dv


def dkdv_tma(q, k, v, go, lse, delta, lo, hi, scale, cfg):
    return _dkdv(_dkdv_tma_kernel, q, k, v, go, lse, delta, lo, hi, scale, cfg)


def dkdv_ours(q, k, v, go, lse, delta, lo, hi, scale, cfg):
    return _dkdv(va._varlen_dkdv_kernel, q, k, v, go, lse, delta, lo, hi, scale, cfg, UPCAST=False, IEEE=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_tma_lab.json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", default="28/4/128")
    ap.add_argument("--layouts", default="dense,packed")
    ap.add_argument("--fwd_tiles_only", action="store_true", help="only the module's forward at several tiles")
    a = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    import attn_lab   # lazy: tools/ is the script's directory
    C = va.AttnConfig
    rows = []
    t0 = time.time()
    for spec in a.heads.split(","):
        hq, hkv, d = (int(x) for x in spec.split("/"))
        T = a.tokens
        for layout in a.layouts.split(","):
            torch.manual_seed(0)
            lengths = [T] if layout == "dense" else attn_lab.doc_lengths(T, 0)
            seq_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].cuda()
            lo, hi = doc_bounds(seq_ids)
            useful = 4 * d * attn_lab.pairs_of(lengths) * hq
            qf = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16)
            kf = torch.randn(1, T, hkv, d, device="cuda", dtype=torch.bfloat16)
            vf = torch.randn(1, T, hkv, d, device="cuda", dtype=torch.bfloat16)
            q, k, v = qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)
            scale = d ** -0.5
            ref_o, ref_lse = va._fwd_launch(q, k, v, lo, scale, 0.0, 0)
            go = torch.randn_like(ref_o)
            delta = (ref_o.float() * go.float()).sum(-1).transpose(1, 2).contiguous()
            fwd_cfg = va.launch_config("fwd", d, 2, q.device)
            dkdv_cfg = va.launch_config("dkdv", d, 2, q.device)

            def rec(kind, impl, cfg, ms, err=None, flops=useful):
                r = {"heads": spec, "layout": layout, "kind": kind, "impl": impl,
                     "cfg": None if cfg is None else [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]}
                if err:
                    r["error"] = err
                else:
                    r.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                rows.append(r)
                print(r, flush=True)

            rec("fwd", "ours", fwd_cfg, do_bench(lambda: va._fwd_launch(q, k, v, lo, scale, 0.0, 0), warmup=25,
                                                  rep=200))
            if a.fwd_tiles_only:
                for cfg in (fwd_cfg, C(64, 64, 4, 3), C(64, 64, 4, 2), C(64, 32, 4, 3), C(128, 64, 4, 3),
                            C(64, 128, 4, 3), C(64, 64, 8, 3)):
                    try:
                        o, lse = fwd_ours(q, k, v, lo, scale, cfg)
                        err = (o.float() - ref_o.float()).abs().max().item()
                        ms = do_bench(lambda: fwd_ours(q, k, v, lo, scale, cfg), warmup=25, rep=200)
                        rec("fwd", f"ours at tiles (max|do| {err:.2e})", cfg, ms)
                    except Exception as e:   # noqa: BLE001
                        rec("fwd", "ours at tiles", cfg, 0, f"{type(e).__name__}: {str(e)[:200]}")
                dump(a, rows, t0)
                continue
            if layout == "dense":
                from torch.nn.attention import SDPBackend, sdpa_kernel   # lazy: GPU lab only
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    qs, ks, vs = q.contiguous(), k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
                    sdpa = torch.nn.functional.scaled_dot_product_attention
                    try:
                        rec("fwd", "sdpa_cudnn", None, do_bench(lambda: sdpa(qs, ks, vs, is_causal=True), warmup=25,
                                                                rep=200))
                    except Exception as e:   # noqa: BLE001
                        rec("fwd", "sdpa_cudnn", None, 0, f"{type(e).__name__}: {str(e)[:200]}")
            for cfg in (fwd_cfg, C(128, 128, 8, 2), C(128, 64, 8, 2), C(128, 64, 8, 4), C(128, 64, 4, 3),
                        C(64, 64, 4, 3), C(128, 32, 8, 3)):
                try:
                    o, lse = fwd_tma(q, k, v, lo, scale, cfg)
                    err = (o.float() - ref_o.float()).abs().max().item()
                    lerr = (lse - ref_lse).abs().max().item()
                    ms = do_bench(lambda: fwd_tma(q, k, v, lo, scale, cfg), warmup=25, rep=200)
                    rec("fwd", f"tma (max|do| {err:.2e}, lse {lerr:.2e})", cfg, ms)
                except Exception as e:   # noqa: BLE001 - a config that does not compile is a result
                    rec("fwd", "tma", cfg, 0, f"{type(e).__name__}: {str(e)[:200]}")
            # dK/dV alone (fp32 partials per query head, as the launcher makes them): 4 products per block pair
            dflops = useful * 2   # 4 of the forward's 2 products' worth: 2x the forward's FLOPs
            ref_dk, ref_dv = dkdv_ours(q, k, v, go, ref_lse, delta, lo, hi, scale, dkdv_cfg)
            rec("dkdv", "ours", dkdv_cfg, do_bench(lambda: dkdv_ours(q, k, v, go, ref_lse, delta, lo, hi, scale,
                                                                      dkdv_cfg), warmup=25, rep=200), flops=dflops)
            for cfg in (dkdv_cfg, C(64, 128, 8, 2), C(32, 128, 8, 3), C(64, 128, 8, 4), C(128, 128, 8, 2),
                        C(64, 64, 4, 3)):
                try:
                    dk, dv = dkdv_tma(q, k, v, go, ref_lse, delta, lo, hi, scale, cfg)
                    e1 = ((dk - ref_dk).abs().max() / ref_dk.abs().max()).item()
                    e2 = ((dv - ref_dv).abs().max() / ref_dv.abs().max()).item()
                    ms = do_bench(lambda: dkdv_tma(q, k, v, go, ref_lse, delta, lo, hi, scale, cfg), warmup=25,
                                  rep=200)
                    rec("dkdv", f"tma (rel dk {e1:.1e}, dv {e2:.1e})", cfg, ms, flops=dflops)
                except Exception as e:   # noqa: BLE001
                    rec("dkdv", "tma", cfg, 0, f"{type(e).__name__}: {str(e)[:200]}", flops=dflops)
            dump(a, rows, t0)


def dump(a, rows, t0):
    """The rows so far (after every layout: a call cut short keeps what ran)."""
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "command": "python3 " + " ".join(sys.argv), "tokens": a.tokens,
                   "seconds": round(time.time() - t0, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
