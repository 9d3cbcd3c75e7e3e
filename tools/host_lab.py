"""Host time per call of decode-sized ops on the GPU (issue 15: eager decode is host-bound).

    python3 tools/host_lab.py [--iters 3000] [--out DIR]

Each op runs `iters` times back to back under torch.no_grad at batch-1 decode shapes (Llama-3-8B: H 4096, 32/8
heads of 128, intermediate 14336); the GPU work per call is a few µs, so wall time / iters is the host's cost of one
call (Python, checks, dispatch, launch). Rows: the Hugging Face eager sequence, our op, and our Triton kernel
launched directly (no wrapper), plus torch.add and an empty Triton kernel (kernel[grid] and FastLaunch) as the floors;
then our ops again with swift_liger.ops._launch off (every launch through kernel[grid]). Writes host_lab.json.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import triton

from swift_liger.bench import harness
from swift_liger.bench.shapes import SHAPES
from swift_liger.ops import _launch, decode_attention_kernel, kv_ring_write_kernel, rms_norm_kernel, swiglu_kernel
from swift_liger.ops import rope_kernel as rope

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=3000)
p.add_argument("--out", default=os.environ.get("OUT", "."))
args = p.parse_args()
dev, BF16 = "cuda", torch.bfloat16
L = SHAPES["llama3-8b"]
H, HQ, HKV, D, INTER = L.hidden, L.heads, L.kv_heads, L.head_dim, L.intermediate


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def host_us(fn):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.iters):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / args.iters * 1e6, (time.perf_counter() - t) / args.iters * 1e6


x = torch.randn(1, 1, H, device=dev, dtype=BF16)
w = torch.ones(H, device=dev, dtype=BF16)
q = torch.randn(1, 1, HQ, D, device=dev, dtype=BF16).transpose(1, 2)
k = torch.randn(1, 1, HKV, D, device=dev, dtype=BF16).transpose(1, 2)
cos = torch.randn(1, 1, D, device=dev, dtype=BF16)
sin = torch.randn(1, 1, D, device=dev, dtype=BF16)
kc = torch.randn(1, HKV, 4100, D, device=dev, dtype=BF16)   # a ring of 4096 + 4 sinks
vc = torch.randn(1, HKV, 4100, D, device=dev, dtype=BF16)
qd = torch.randn(1, HQ, 1, D, device=dev, dtype=BF16)
kn = torch.randn(1, HKV, 1, D, device=dev, dtype=BF16)
g = torch.randn(1, 1, INTER, device=dev, dtype=BF16)
u = torch.randn(1, 1, INTER, device=dev, dtype=BF16)


def hf_rms():
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + 1e-6)).to(BF16)


def rotate_half(t):
    return torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)


def hf_rope():
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


_EMPTY = _launch.FastLaunch(_empty_kernel)
rows = []
cases = {
    "torch.add (one aten op)": lambda: torch.add(x, x),
    "empty Triton kernel": lambda: _empty_kernel[(1,)](x, 1),
    "empty Triton kernel, FastLaunch": lambda: _EMPTY.launch((1,), x, 1),
    "RMSNorm HF eager (7 ops)": hf_rms,
    "RMSNorm ours": lambda: rms_norm_kernel.rms_norm(x, w, 1e-6),
    "RoPE HF eager (q and k)": hf_rope,
    "RoPE ours": lambda: rope.apply_rope(q, k, cos, sin),
    "SwiGLU HF eager": lambda: torch.nn.functional.silu(g) * u,
    "SwiGLU ours": lambda: swiglu_kernel.swiglu(g, u),
    "decode attention ours (2 launches)": lambda: decode_attention_kernel.decode_attention_unchecked(qd, kc, vc, 0.088),
    "ring write ours": lambda: kv_ring_write_kernel.kv_ring_write_unchecked(kc, vc, kn, kn, 5000, None, 4, 4096),
    "ring write + decode attention ours, fused (2 launches)":
        lambda: decode_attention_kernel.decode_attention_write_unchecked(qd, kc, vc, 0.088, kn, kn, 908),
}
OURS = [name for name in cases if "ours" in name]
with torch.no_grad():
    for name, fn in cases.items():
        host, wall = host_us(fn)
        rows.append({"op": name, "host_us_per_call": round(host, 2), "wall_us_per_call": round(wall, 2)})
        print(json.dumps(rows[-1]), flush=True)
    with _launch.plain_launches():   # the same ops with every launch through kernel[grid]
        for name in OURS:
            host, wall = host_us(cases[name])
            rows.append({"op": name + ", kernel[grid] launches", "host_us_per_call": round(host, 2),
                         "wall_us_per_call": round(wall, 2)})
            print(json.dumps(rows[-1]), flush=True)
    # where our wrapper's time goes: cProfile of 500 calls each
    for name in ("RMSNorm ours", "RoPE ours", "SwiGLU ours"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            cases[name]()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        rows.append({"op": name, "cprofile_top": s.getvalue()[-3500:]})
        print(name, s.getvalue()[-3500:], flush=True)
harness.write_json(os.path.join(args.out, "host_lab.json"),
                   {"environment": harness.environment(), "iters": args.iters, "rows": rows})
