"""Where fused linear + cross-entropy spends its time on one GPU (issue 12's linear+CE targets).

    python3 tools/flce_lab.py [--n 8192 --h 4096 --v 128256] [--out DIR] [--deadline S]

1. cuBLAS alone at the GEMM shapes the op runs per token chunk (C = 512, the default, 2048) and over all N tokens at once
   (what torch.compile's materialised logits run), with the default and the cuBLASLt backend: ms and TFLOP/s.
2. The op end to end (frozen head, trainable "recompute" and "accumulate_lowp") per chunk size and BLAS backend.
3. torch.profiler of the frozen and the accumulate_lowp op at the default chunk: device time per kernel name.
Writes flce_lab.json (and prints every row as it is measured).
"""
import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from swift_liger.bench import harness
from swift_liger.bench.shapes import SHAPES
from swift_liger.ops import fused_linear_cross_entropy_kernel as flce

p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=8192)
p.add_argument("--h", type=int, default=SHAPES["llama3-8b"].hidden)
p.add_argument("--v", type=int, default=SHAPES["llama3-8b"].vocab)
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--deadline", type=float, default=500.0, help="seconds; later sections are skipped after it")
p.add_argument("--sections", default="gemm,op,profile")
p.add_argument("--libs", default="cublas,cublaslt", help="cuBLAS backends (torch.backends.cuda.preferred_blas_library)")
p.add_argument("--chunks", default="512,default,2048", help="token chunk sizes of the op section")
args = p.parse_args()
N, H, V = args.n, args.h, args.v
SECTIONS, LIBS = args.sections.split(","), args.libs.split(",")
T0 = time.time()
BF16 = torch.bfloat16
dev = "cuda"
rows = []


def left():
    return args.deadline - (time.time() - T0)


def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    harness.write_json(os.path.join(args.out, "flce_lab.json"),
                       {"environment": harness.environment(), "n": N, "h": H, "v": V, "rows": rows})


def blas(name):
    try:
        torch.backends.cuda.preferred_blas_library(name)
        return True
    except Exception as exc:  # noqa: BLE001
        emit({"section": "blas", "backend": name, "error": harness.describe(exc)})
        return False


torch.manual_seed(0)
w = torch.randn(V, H, device=dev, dtype=BF16) * 0.02
h_all = torch.randn(N, H, device=dev, dtype=BF16) * 0.5
z_all = torch.randn(N, V, device=dev, dtype=BF16) * 1e-3
acc = torch.zeros(V, H, device=dev, dtype=BF16)
if "gemm" not in SECTIONS:
    del z_all, acc

# 1. GEMMs alone
default_c = flce.default_chunk_size(N, V, 2)
for lib in (LIBS if "gemm" in SECTIONS else ()):
    if not blas(lib):
        continue
    for c in sorted({512, default_c, 2048, N}):
        h, z = h_all[:c], z_all[:c]
        fl = 2.0 * c * H * V
        gemms = {
            "logits h@W^T": lambda: torch.mm(h, w.t(), out=z),
            "dh z@W": lambda: torch.mm(z, w),
            "dW z^T@h (write)": lambda: torch.mm(z.t(), h, out=acc),
            "dW z^T@h (+= bf16)": lambda: acc.addmm_(z.t(), h),
        }
        for name, fn in gemms.items():
            ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
            emit({"section": "gemm", "blas": lib, "C": c, "gemm": name, "ms": ms, "tflops": fl / ms / 1e9})
if "gemm" in SECTIONS:
    del z_all, acc
torch.cuda.empty_cache()
blas("cublas")

# 2. The op end to end
labels = torch.randint(0, V, (N,), device=dev)
labels[::9] = -100


def op_case(train_w, strategy, chunk):
    hid = h_all.clone().requires_grad_()
    ww = w.clone().requires_grad_(train_w)

    def fn():
        hid.grad = None
        ww.grad = None
        loss = flce.fused_linear_cross_entropy(hid, ww, labels, chunk_size=chunk, dw_strategy=strategy)
        loss.backward()
    return fn


variants = [(False, "auto", "frozen"), (True, "accumulate_lowp", "trainable lowp"), (True, "recompute", "trainable")]
chunks = sorted({default_c if c == "default" else int(c) for c in args.chunks.split(",")})
for lib in (LIBS if "op" in SECTIONS else ()):
    if not blas(lib):
        continue
    for c in chunks:
        for train_w, strategy, label in variants:
            if left() < 15:
                break
            fn = op_case(train_w, strategy, c)
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / harness.GiB
            ms = do_bench(fn, warmup=100, rep=600, return_mode="median")
            gemms = 3 if train_w and strategy != "recompute" else (4 if train_w else 2)
            emit({"section": "op", "blas": lib, "C": c, "variant": label, "ms": ms, "peak_extra_gib": peak,
                  "tflops_of_min": (3 if train_w else 2) * 2.0 * N * H * V / ms / 1e9, "gemms_run": gemms})
            del fn
            torch.cuda.empty_cache()
blas("cublas")

# 3. Profiles at the default chunk
for train_w, strategy, label in (variants[:2] if "profile" in SECTIONS else ()):
    if left() < 10:
        break
    fn = op_case(train_w, strategy, default_c)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            t, k = per.get(e.name, (0.0, 0))
            per[e.name] = (t + e.device_time_total / 3 / 1e3, k + 1 / 3)
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:12]
    emit({"section": "profile", "variant": label, "C": default_c,
          "kernels": [{"name": k[:140], "ms_per_call": round(v[0], 4), "launches_per_call": v[1]} for k, v in top]})
    del fn
    torch.cuda.empty_cache()
print(f"done in {time.time() - T0:.0f} s", flush=True)
