"""RMSNorm fwd+bwd at small shapes: per-kernel device time inside one CUDA-graph replay (torch.profiler), ours vs
torch.compile vs Liger, plus backward-grid variants of ours: python3 tools/rms_lab.py (GPU, liger-kernel) ->
$OUT/rms_lab.json. Results and reading: docs/benchmarks/rms_lab_h200.md."""
import collections
import os

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from swift_liger.bench import harness
from swift_liger.ops import rms_norm_kernel as m, _common
from liger_kernel.transformers.functional import liger_rms_norm

BF16 = torch.bfloat16
res = []

def make(n, h):
    x = torch.randn(n, h, device="cuda", dtype=BF16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(h, device="cuda", dtype=BF16)).requires_grad_()
    g = torch.randn(n, h, device="cuda", dtype=BF16)
    return x, w, g

comp = torch.compile(lambda x, w: m.rms_norm_reference(x, w, 1e-6), dynamic=False)
IMPLS = {"ours": lambda x, w: m.rms_norm(x, w, 1e-6), "compile": comp,
         "liger": lambda x, w: liger_rms_norm(x, w, 1e-6, casting_mode="llama", in_place=False)}

def graph(fn, x, w, g):
    def clear():
        x.grad = None; w.grad = None
    return harness.capture_graph(lambda: fn(x, w).backward(g), before=clear)

def kernels(gr, reps=20):
    for _ in range(5): gr.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps): gr.replay()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            agg[e.name[:60]] += e.device_time_total / reps
    return dict(agg)

for n, h in [(1024, 1024), (1024, 1536), (1024, 2048), (4096, 1024), (16384, 1024), (16384, 2048), (16384, 4096)]:
    x, w, g = make(n, h)
    for name, fn in IMPLS.items():
        gr = graph(fn, x, w, g)
        ms = do_bench(gr.replay, warmup=25, rep=150, return_mode="median")
        ks = kernels(gr)
        print(f"{n}x{h} {name:8s} {ms*1e3:7.1f} us  kernels {sum(ks.values()):6.1f} us: " +
              "; ".join(f"{k} {v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1])), flush=True)
        res.append({"shape": f"{n}x{h}", "impl": name, "us": ms * 1e3, "kernels": ks})
        del gr
    # variants of ours: backward grid sizes and warps
    tiles = _common.cdiv(n, min(64, max(1, 4096 // max(16, _common.next_pow2(h))), _common.next_pow2(n)))
    for progs in sorted({max(1, tiles // 8), max(1, tiles // 4), max(1, tiles // 2), tiles}):
        for nw in (4, 8, 16):
            _common.set_launch_override(m, "bwd", programs=progs, num_warps=nw)
            try:
                gr = graph(IMPLS["ours"], x, w, g)
                ms = do_bench(gr.replay, warmup=25, rep=150, return_mode="median")
                print(f"{n}x{h} ours bwd programs={progs} warps={nw}: {ms*1e3:7.1f} us", flush=True)
                res.append({"shape": f"{n}x{h}", "impl": f"ours programs={progs} warps={nw}", "us": ms * 1e3})
                del gr
            except Exception as e:
                print("failed", progs, nw, str(e)[:200])
            finally:
                _common.set_launch_override(m, "bwd")
harness.write_json(os.path.join(os.environ.get("OUT", "."), "rms_lab.json"), res)
