"""Which SDPA backend does torch pick for a training layer's attention, and what do the others cost (GPU only).

    python3 tools/sdpa_probe.py [--out sdpa_probe.json] [--quick]

Per shape (B, Hq, Hkv, T, D; causal, no mask, bf16): forward+backward `do_bench` median of each backend
(default = torch's own choice, flash, cuDNN, efficient) with GQA passed as `enable_gqa=True` (what transformers'
sdpa_attention_forward does when there is no mask) and with K/V repeated to Hq heads; the attention kernels the
default choice launched (torch.profiler names). Then accuracy of cuDNN and flash against an fp32 math reference at
odd lengths (causal, no mask; and with an all-True boolean mask, pytorch#196678's NaN case), whether cuDNN's
forward+backward captures into a CUDA graph and replays equal, and the host cost of the `sdpa_kernel` context.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SHAPES = [  # name, B, Hq, Hkv, T, D
    ("qwen2.5-0.5b 8x512", 8, 14, 2, 512, 64),
    ("qwen2.5-0.5b 1x2k", 1, 14, 2, 2048, 64),
    ("qwen2.5-1.5b 1x2k", 1, 12, 2, 2048, 128),
    ("qwen2.5-1.5b 4x2k", 4, 12, 2, 2048, 128),
    ("qwen2.5-3b 1x2k", 1, 16, 2, 2048, 128),
    ("qwen2.5-7b 1x2k", 1, 28, 4, 2048, 128),
    ("qwen2.5-7b 1x8k", 1, 28, 4, 8192, 128),
    ("qwen2.5-7b 1x16k", 1, 28, 4, 16384, 128),
    ("llama3-8b 1x8k", 1, 32, 8, 8192, 128),
    ("qwen2.5-1.5b 1x16k", 1, 12, 2, 16384, 128),
]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def tensors(b, hq, hkv, t, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def step(q, k, v, do, gqa, mask=None):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if gqa == "repeat":
        r = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out, dq, dk, dv


def ctx(name):
    return sdpa_kernel(BACKENDS[name]) if name in BACKENDS else torch.enable_grad()


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name
            if any(s in n.lower() for s in ("flash", "fmha", "cudnn", "attn", "sdpa", "mha")):
                names[n[:90]] = names.get(n[:90], 0) + e.device_time_total
    return {k: round(v, 1) for k, v in sorted(names.items(), key=lambda x: -x[1])[:4]}


def flops(b, hq, t, d):
    return 4 * d * (t * (t + 1) / 2) * hq * b * 3.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa_probe.json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
           "speed": [], "accuracy": [], "graph": [], "host": {}}
    print(res["torch"], res["cudnn"], res["gpu"], flush=True)
    for name, b, hq, hkv, t, d in SHAPES[: 4 if a.quick else None]:
        q, k, v, do = tensors(b, hq, hkv, t, d)
        row = {"shape": name, "B": b, "Hq": hq, "Hkv": hkv, "T": t, "D": d}
        for gqa in ("enable_gqa", "repeat"):
            for be in ("default", "flash", "cudnn", "efficient"):
                key = f"{be}/{gqa}"
                try:
                    with ctx(be):
                        step(q, k, v, do, gqa)
                        ms = do_bench(lambda: step(q, k, v, do, gqa), warmup=25, rep=150)
                        if be == "default":
                            row[f"kernels/{gqa}"] = kernels(lambda: step(q, k, v, do, gqa))
                    row[key] = round(ms, 4)
                except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is a result
                    row[key] = f"error: {type(e).__name__}: {str(e)[:120]}"
        f = flops(b, hq, t, d)
        print(name, {k: (f"{v:.3f} ms {f / v / 1e9:.0f} TF/s" if isinstance(v, float) else v)
                     for k, v in row.items() if "/" in k and not k.startswith("kernels")}, flush=True)
        print("   default kernels:", row.get("kernels/enable_gqa"), flush=True)
        res["speed"].append(row)
        del q, k, v, do
        torch.cuda.empty_cache()
        json.dump(res, open(a.out, "w"), indent=1)

    # accuracy vs fp32 math, causal without a mask, and with an all-True boolean mask
    for t in (64, 192, 333, 704, 1000, 2112):
        for d, hq, hkv in ((128, 4, 2), (64, 4, 1)):
            q, k, v, do = tensors(1, hq, hkv, t, d, seed=t)
            with sdpa_kernel(SDPBackend.MATH):
                ref = step(q.float(), k.float(), v.float(), do.float(), "repeat")
            for mask_kind in ("causal", "bool_mask"):
                mask = (torch.ones(t, t, device="cuda", dtype=torch.bool).tril() if mask_kind == "bool_mask" else None)
                for be in ("flash", "cudnn"):
                    try:
                        with sdpa_kernel(BACKENDS[be]):
                            got = step(q, k, v, do, "repeat", mask=mask)
                        err = [float((g.float() - r).norm() / r.norm()) for g, r in zip(got, ref)]
                        nan = [bool(torch.isnan(g).any()) for g in got]
                        out = {"err": [round(e, 5) for e in err], "nan": nan}
                    except Exception as e:  # noqa: BLE001
                        out = f"error: {type(e).__name__}: {str(e)[:100]}"
                    res["accuracy"].append({"T": t, "D": d, "mask": mask_kind, "backend": be, "result": out})
            print("accuracy T", t, "D", d, [(r["mask"], r["backend"], r["result"]) for r in res["accuracy"][-4:]],
                  flush=True)
    json.dump(res, open(a.out, "w"), indent=1)

    # CUDA graph capture of cuDNN forward+backward
    for t, d in ((512, 64), (2048, 128)):
        q, k, v, do = tensors(2, 8, 2, t, d)
        try:
            with sdpa_kernel(BACKENDS["cudnn"]):
                sq, sk, sv, sdo = (x.clone() for x in (q, k, v, do))
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        step(sq, sk, sv, sdo, "enable_gqa")
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = step(sq, sk, sv, sdo, "enable_gqa")
                q2, k2, v2, do2 = tensors(2, 8, 2, t, d, seed=7)
                for x, y in zip((sq, sk, sv, sdo), (q2, k2, v2, do2)):
                    x.copy_(y)
                graph.replay()
                torch.cuda.synchronize()
                ref = step(q2, k2, v2, do2, "enable_gqa")
                same = [bool(torch.equal(a_, b_)) for a_, b_ in zip(outs, ref)]
                res["graph"].append({"T": t, "D": d, "replay_equal": same})
        except Exception as e:  # noqa: BLE001
            res["graph"].append({"T": t, "D": d, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print("graph", res["graph"][-1], flush=True)

    # host cost: the context manager alone, and a tiny SDPA call per backend (host-bound)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            pass
    res["host"]["sdpa_kernel_ctx_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
    q, k, v, do = tensors(1, 14, 2, 64, 64)
    for be in ("default", "flash", "cudnn"):
        with ctx(be):
            for _ in range(50):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            res["host"][f"sdpa_fwd_call_us/{be}"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            torch.cuda.synchronize()
    print("host", res["host"], flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
