"""RoPE forward-kernel variants against Liger-Kernel's kernel, each timed as one CUDA graph of 20 launches
(median / 20): python3 tools/rope_lab.py (GPU, liger-kernel installed) -> $OUT/rope_lab.json, printed summary.
Results and reading: docs/benchmarks/rope_lab_h200.md. The variant kernel below is the rotation kernel with
switches (SEQ, SAME, F32CS, RELOAD) for the experiment only; swift_liger.ops.rope_kernel is what ships."""
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from swift_liger.bench import harness
from swift_liger.bench.kernels import SWEEP_HEAD_DIMS, SWEEP_HEADS, SWEEP_ROPE_TOKENS
from swift_liger.ops import rope_kernel as rope
from swift_liger.ops.rope_kernel import load_heads, store_heads, rotate, token_coords
from liger_kernel.ops import rope as lrope


@triton.jit
def _cs(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
        SAME: tl.constexpr, F32: tl.constexpr):
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c_off = b * sc_b + t * sc_t
    s_off = b * ss_b + t * ss_t
    c1 = tl.load(cos_ptr + c_off + d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + s_off + d, mask=dmask, other=0.0)[None, :]
    if SAME:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(cos_ptr + c_off + HALF + d, mask=dmask, other=0.0)[None, :]
        s2 = tl.load(sin_ptr + s_off + HALF + d, mask=dmask, other=0.0)[None, :]
    if F32:
        c1 = c1.to(tl.float32)
        c2 = c2.to(tl.float32)
        s1 = s1.to(tl.float32)
        s2 = s2.to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rot(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    return rotate(x1, x2, c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32), BACKWARD)


@triton.jit
def rope_var_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                    n_tok, T,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                    sc_b, sc_t, ss_b, ss_t,
                    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr,
                    SEQ: tl.constexpr, SAME: tl.constexpr, F32CS: tl.constexpr, RELOAD: tl.constexpr):
    """SEQ: q rotated and stored before k is loaded. SAME: one half of cos/sin. F32CS: cos/sin upcast at load
    (else at use). RELOAD: cos/sin loaded again for k (short live range)."""
    tok = tl.program_id(0)
    b, t = token_coords(tok, T)
    c1, c2, s1, s2 = _cs(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF, BLOCK_HALF, SAME, F32CS)
    q_in = q_ptr + b * sq_b + t * sq_t
    k_in = k_ptr + b * sk_b + t * sk_t
    q_out = qo_ptr + b * sqo_b + t * sqo_t
    k_out = ko_ptr + b * sko_b + t * sko_t
    if SEQ:
        for h0 in range(0, HQ, BLOCK_HQ):
            x1, x2, x3 = load_heads(q_in, sq_h, h0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
            o1, o2 = _rot(x1, x2, c1, c2, s1, s2, BACKWARD)
            store_heads(q_out, sqo_h, h0, o1, o2, x3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        if RELOAD:
            c1, c2, s1, s2 = _cs(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF, BLOCK_HALF, SAME, F32CS)
        for h0 in range(0, HK, BLOCK_HK):
            x1, x2, x3 = load_heads(k_in, sk_h, h0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
            o1, o2 = _rot(x1, x2, c1, c2, s1, s2, BACKWARD)
            store_heads(k_out, sko_h, h0, o1, o2, x3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
    else:
        q1, q2, q3 = load_heads(q_in, sq_h, 0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        k1, k2, k3 = load_heads(k_in, sk_h, 0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        o1, o2 = _rot(q1, q2, c1, c2, s1, s2, BACKWARD)
        store_heads(q_out, sqo_h, 0, o1, o2, q3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        o1, o2 = _rot(k1, k2, c1, c2, s1, s2, BACKWARD)
        store_heads(k_out, sko_h, 0, o1, o2, k3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)

BF16 = torch.bfloat16
LAYOUTS = [(h, kv, d) for d in SWEEP_HEAD_DIMS for h, kv in SWEEP_HEADS]   # the sweep's RoPE grid
T = SWEEP_ROPE_TOKENS
out = []

def graph_ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    g = harness.capture_graph(lambda: [fn() for _ in range(n)], warmup=1)
    return do_bench(g.replay, warmup=25, rep=150, return_mode="median") / n

for HQ, HK, D in LAYOUTS:
    half = D // 2
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=BF16).transpose(1, 2)
    k = torch.randn(1, T, HK, D, device="cuda", dtype=BF16).transpose(1, 2)
    cos = torch.randn(1, T, D, device="cuda", dtype=BF16)
    sin = torch.randn(1, T, D, device="cuda", dtype=BF16)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    c = rope.rotary_config(HQ, HK, D, half)
    nbytes = 2 * T * (HQ + HK) * D * 2 + 2 * T * D * 2
    row = {"layout": f"q{HQ}/kv{HK} D{D}"}
    row["ours"] = graph_ms(lambda: rope._rope_launch(q, k, cos, sin, False))  # the shipped kernel
    # Liger: in place, [B, T, H, D] physical
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    p2 = triton.next_power_of_2
    def lig():
        lrope._triton_rope[(T,)](qt, qt.stride(1), kt, kt.stride(1), cos, cos.stride(-2), sin, sin.stride(-2), T,
                                 1, 1, HQ, HK, D, p2(HQ), p2(HK), p2(D), p2(D), D, BLOCK_SIZE=max(p2(HQ), p2(HK)),
                                 BACKWARD_PASS=False)
    row["liger"] = graph_ms(lig)
    fits = c.block_hq >= HQ and c.block_hk >= HK
    for seq, same, f32, reload in [(0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 1, 1, 0), (1, 0, 0, 1)]:
        if not seq and not fits:
            continue
        for nw in (2, 4, 8):
            for inplace in ((False, True) if (seq, same, f32, reload, nw) == (0, 0, 1, 0, c.num_warps) else (False,)):
                a, b = (q, k) if inplace else (qo, ko)
                def var():
                    rope_var_kernel[(T,)](
                        q, k, cos, sin, a, b, T, T, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                        k.stride(2), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
                        0, cos.stride(1), 0, sin.stride(1), HQ=HQ, HK=HK, HALF=half, D=D, BLOCK_HQ=c.block_hq,
                        BLOCK_HK=c.block_hk, BLOCK_HALF=c.block_half, BLOCK_PASS=c.block_pass, BACKWARD=False,
                        INTERLEAVED=False, SEQ=bool(seq), SAME=bool(same), F32CS=bool(f32), RELOAD=bool(reload),
                        num_warps=nw)
                name = f"seq{seq} same{same} f32{f32} reload{reload} w{nw}" + (" inplace" if inplace else "")
                try:
                    row[name] = graph_ms(var)
                except Exception as e:
                    row[name] = None
                    print(name, "failed", str(e)[:200])
    best = min((v, n) for n, v in row.items() if n not in ("layout",) and v)
    print(f"{row['layout']:16s} ours {row['ours']*1e3:7.1f} us ({nbytes/row['ours']/1e6:5.0f} GB/s) "
          f"liger {row['liger']*1e3:7.1f} us | best {best[1]} {best[0]*1e3:7.1f} us", flush=True)
    for n, v in sorted(((n, v) for n, v in row.items() if n != "layout" and v), key=lambda x: x[1])[:8]:
        print(f"     {v*1e3:7.1f} us  {n}")
    out.append(row)
    q = k = qo = ko = None   # (not del: the lambdas above still name them)
harness.write_json(os.path.join(os.environ.get("OUT", "."), "rope_lab.json"), out)
