"""Training attention, forward + backward, on dense causal rows and packed rows of mixed document lengths:
python3 tools/attn_lab.py --out $OUT/attn_lab.json (GPU). Peers: SDPA's flash, cuDNN and memory-efficient
backends (dense causal), SDPA with the block-diagonal boolean mask transformers builds for packed rows,
torch.compile'd flex_attention with a causal / document mask, and ours (swift_liger.ops.varlen_attention_kernel) when
importable. Useful FLOPs count only the (query, key) pairs a causal document mask keeps:
fwd 4·D·pairs per head, fwd+bwd 3.5x that (backward = 2.5 forward's matrix products)."""
import argparse
import importlib
import json
import math
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def doc_lengths(total, seed, lo=64, hi=8192):
    """Long-tailed document lengths (log-uniform between lo and hi) filling exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        u = torch.rand((), generator=g).item()
        n = int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))
        n = max(1, min(n, left))
        out.append(n)
        left -= n
    return out


def pairs_of(lengths, window=None):
    if window is None:
        return sum(n * (n + 1) // 2 for n in lengths)
    return sum(sum(min(i + 1, window) for i in range(n)) for n in lengths)


def run_case(name, fn, q, k, v, go):
    def step():
        for t in (q, k, v):
            t.grad = None
        o = fn(q, k, v)
        o.backward(go if go.shape == o.shape else go.transpose(1, 2).reshape(o.shape))
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = do_bench(step, warmup=50, rep=300)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        fwd = do_bench(lambda: fn(q, k, v), warmup=25, rep=150)
        return {"impl": name, "ms": ms, "fwd_ms": fwd, "peak_gib": peak}
    except Exception as e:  # a backend that refuses the shape is a result too
        return {"impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def kernel_profile(fn, q, k, v, go, steps=5):
    """Device µs per fwd+bwd step by kernel name (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    o = fn(q, k, v)
    g = go if go.shape == o.shape else go.transpose(1, 2).reshape(o.shape)

    def once():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(g)
    once()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            once()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():   # kernels only (their device_type is CUDA); operators would count them twice
        if e.device_type.name == "CUDA":
            per[e.name[:90]] = per.get(e.name[:90], 0.0) + e.time_range.elapsed_us() / steps
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])


def sweep(q, k, v, go, seq_ids, d, useful, spec, layout, kinds=()):
    """Alternative tiles per kernel kind (launch_override), the others at their default; ``kinds``: only these."""
    from swift_liger.ops import varlen_attention_kernel as va
    fn = lambda q, k, v: va.varlen_attention(q, k, v, seq_ids, scale=d ** -0.5)  # noqa: E731
    if d == 256:   # the head-256 candidates and neighbours (the D=128 tiles exceed shared memory there)
        grid = {"dkdv": [(32, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2),
                         (16, 128, 8, 2), (32, 64, 8, 1)],
                "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)]}
        return _sweep(q, k, v, go, fn, grid, useful, spec, layout, kinds)
    grid = {"fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3),
                    (64, 128, 8, 2), (128, 64, 8, 2)],
            "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 3), (16, 128, 8, 3),
                     (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 2)],
            "dq": [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3),
                   (128, 64, 8, 3)]}
    return _sweep(q, k, v, go, fn, grid, useful, spec, layout, kinds)


def _sweep(q, k, v, go, fn, grid, useful, spec, layout, kinds=()):
    """Time `fn` under each (kind: [(block_m, block_n, warps, stages)]) tile of `grid`, one kind at a time (only the
    ``kinds`` given, when any)."""
    from swift_liger.ops import varlen_attention_kernel as va
    from swift_liger.ops._common import launch_override
    out = []
    for kind, cfgs in grid.items():
        if kinds and kind not in kinds:
            continue
        for bm, bn, w, st in cfgs:
            with launch_override(va, kind, block_m=bm, block_n=bn, num_warps=w, num_stages=st):
                r = run_case(f"swift_liger[{kind}={bm}x{bn}w{w}s{st}]", fn, q, k, v, go)
            r.update(heads=spec, layout=layout, tokens=q.shape[2], sweep=kind)
            if "ms" in r:
                r["tflops"] = useful / r["ms"] / 1e9
                r["fwd_tflops"] = useful / 3.5 / r["fwd_ms"] / 1e9
            print(json.dumps(r), flush=True)
            out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_lab.json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", default="28/4/128,14/2/64,16/8/256")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tiles of ours (first head spec, "
                                                          "the --sweep_layout layout)")
    ap.add_argument("--sweep_layout", default="packed", help="dense, or packed (the first packed layout)")
    ap.add_argument("--compare", default="", help="also time MODULE.varlen_attention (e.g. a previous version of the "
                                                  "kernel module copied into swift_liger/ops)")
    ap.add_argument("--sweep_kinds", default="", help="comma-separated kernel kinds to sweep (fwd, dkdv, dq); default "
                                                      "all")
    ap.add_argument("--profile", action="store_true", help="device time by kernel of each case (torch.profiler)")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        from swift_liger.ops.varlen_attention_kernel import varlen_attention
    except Exception as e:  # noqa: BLE001
        print("ours not importable:", e)
        varlen_attention = None
    T = args.tokens
    dev = "cuda"
    results = []
    for spec in args.heads.split(","):
        hq, hkv, d = map(int, spec.split("/"))
        torch.manual_seed(0)
        q = torch.randn(1, hq, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, hkv, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, hkv, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(1, hq, T, d, device=dev, dtype=torch.bfloat16)
        rep = hq // hkv

        def sdpa(backend, mask=None):
            def fn(q, k, v):
                with sdpa_kernel([backend]):
                    if mask is None:
                        try:
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        except RuntimeError:
                            pass
                        return F.scaled_dot_product_attention(
                            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
                    return F.scaled_dot_product_attention(
                        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
            return fn

        layouts = [("dense", [T])] + [(f"packed{s}", doc_lengths(T, int(s))) for s in args.seeds.split(",")]
        for layout, lengths in layouts:
            seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)
            useful = 3.5 * 4 * d * hq * pairs_of(lengths)
            cases = []
            if layout == "dense":
                cases += [("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                          ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
                          ("sdpa_efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION))]
            else:
                idx = torch.arange(T, device=dev)
                bool_mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
                cases += [("sdpa_efficient_mask", sdpa(SDPBackend.EFFICIENT_ATTENTION, bool_mask[None, None]))]

            def doc_causal(b, h, qi, ki):
                return (seg[qi] == seg[ki]) & (ki <= qi)
            bm = create_block_mask(doc_causal, None, None, T, T, device=dev)
            cases.append(("flex", lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True)))
            if varlen_attention is not None:
                seq_ids = seg[None].to(torch.int32)
                cases.append(("swift_liger", lambda q, k, v: varlen_attention(q, k, v, seq_ids,
                                                                              scale=d ** -0.5)))
                if args.compare:
                    other = importlib.import_module(args.compare).varlen_attention
                    cases.append((args.compare.rsplit(".", 1)[-1],
                                  lambda q, k, v: other(q, k, v, seq_ids, scale=d ** -0.5)))
            for name, fn in cases:
                r = run_case(name, fn, q, k, v, go)
                r.update(heads=spec, layout=layout, docs=len(lengths), tokens=T, useful_tflop=useful / 1e12)
                if args.profile and "ms" in r:
                    r["kernels_us"] = kernel_profile(fn, q, k, v, go)
                if "ms" in r:
                    r["tflops"] = useful / r["ms"] / 1e9
                    r["fwd_tflops"] = useful / 3.5 / r["fwd_ms"] / 1e9
                print(json.dumps(r), flush=True)
                results.append(r)
            if (args.sweep and varlen_attention is not None and spec == args.heads.split(",")[0]
                    and layout.startswith(args.sweep_layout)):
                results += sweep(q, k, v, go, seg[None].to(torch.int32), d, useful, spec, layout,
                                 [kd for kd in args.sweep_kinds.split(",") if kd])
                args.sweep = False
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
