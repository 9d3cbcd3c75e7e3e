"""Where the time of one FP8 projection goes (device diagnostics, not a benchmark report): CUDA kernel times per
op under torch.profiler for fp8_linear forward + input gradient vs F.linear, the quantization kernel alone (GB/s), the
row-wise _scaled_mm alone (TFLOP/s), and host microseconds per call (launch cost, no sync).
    python tools/fp8_profile.py [N K O ...]"""
import sys
import time

import torch
import triton.testing as tt
from torch.profiler import ProfilerActivity, profile

from swift_liger.ops import fp8_quant_kernel as fq, fp8_transpose_kernel as ft
from swift_liger.ops._common import launch_override
from swift_liger.ops.fp8_linear_op import Fp8Weight, _scaled_mm, fp8_linear, quantize_rows

shapes = [tuple(map(int, sys.argv[i:i + 3])) for i in range(1, len(sys.argv), 3)] or [
    (8192, 3584, 3584), (8192, 3584, 18944), (8192, 18944, 3584), (2048, 1536, 1536)]
for n, k, o in shapes:
    torch.manual_seed(0)
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(o, k, device="cuda", dtype=torch.bfloat16) * 0.02
    fw = Fp8Weight.quantize(w)
    dy = torch.randn(n, o, device="cuda", dtype=torch.bfloat16)
    print(f"\n===== N{n} K{k} O{o}")
    for name, fn in (("bf16", lambda: torch.nn.functional.linear(x, w).backward(dy)),
                     ("fp8", lambda: fp8_linear(x, fw).backward(dy))):
        ms = tt.do_bench(fn, rep=200)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        print(f"{name}: {ms:.3f} ms fwd+dx, {4 * n * k * o / ms / 1e9:.0f} TFLOP/s, host {host:.0f} us/call (no sync)")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))
    x2 = x.detach()
    ms = tt.do_bench(lambda: quantize_rows(x2), rep=100)
    print(f"quantize_rows [{n},{k}]: {ms * 1e3:.1f} us, {(n * k * 3 + n * 4) / ms / 1e6:.0f} GB/s (read bf16, write e4m3)")
    for hw in (False, True) if fq.hw_cvt_supported(x2.device) else (False,):
        for rows, warps in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (8, 8)):
            with launch_override(fq, None, rows=rows, num_warps=warps, hw_cvt=hw):
                ms = tt.do_bench(lambda: quantize_rows(x2), rep=100)
            print(f"quantize_rows hw_cvt {hw} rows {rows} warps {warps}: {ms * 1e3:.1f} us, "
                  f"{(n * k * 3 + n * 4) / ms / 1e6:.0f} GB/s")
    xq, sx = quantize_rows(x2)
    ms = tt.do_bench(lambda: _scaled_mm(xq, fw.q.t(), sx, fw.scale.view(1, -1), torch.bfloat16), rep=100)
    print(f"_scaled_mm [{n},{k}]x[{k},{o}]: {ms * 1e3:.1f} us, {2 * n * k * o / ms / 1e9:.0f} TFLOP/s")
    ms = tt.do_bench(lambda: fw.q.t().contiguous(), rep=100)
    print(f"W_q transpose torch [{o},{k}]: {ms * 1e3:.1f} us, {2 * o * k / ms / 1e6:.0f} GB/s")
    for block, warps in ((64, 4), (64, 8), (128, 4), (128, 8), (32, 4)):
        with launch_override(ft, None, block=block, num_warps=warps):
            ms = tt.do_bench(lambda: ft.transpose_kernel(fw.q), rep=100)
        print(f"W_q transpose kernel {block}/{warps} [{o},{k}]: {ms * 1e3:.1f} us, {2 * o * k / ms / 1e6:.0f} GB/s")
    ms = tt.do_bench(lambda: x2 @ w.t(), rep=100)
    print(f"bf16 GEMM: {ms * 1e3:.1f} us, {2 * n * k * o / ms / 1e9:.0f} TFLOP/s")

# The GPU's scales against the torch reference (a test found them unequal on an H200).
from swift_liger.ops.fp8_linear_op import quantize_rows_torch
from swift_liger.ops.fp8_quant_kernel import quantize_rows_kernel
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n, k in ((5, 48), (3, 4100), (7, 33)):
        g = torch.Generator().manual_seed(n * k)
        x = (torch.randn(n, k + 3, generator=g) * torch.logspace(-4, 4, n)[:, None]).to(dtype)[:, :k].to("cuda")
        x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 3.0])
        f = (torch.rand(k, generator=g) + 0.5).to("cuda")
        for fold in (None, f):
            with launch_override(fq, None, hw_cvt=False):   # the division path, which the torch ops compute
                q, s = quantize_rows_kernel(x, fold)
            qr, sr = quantize_rows_torch(x, fold)
            bad = (s != sr).flatten().nonzero().flatten().tolist()
            qbad = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
            print("mismatch", dtype, n, k, fold is not None, "scale rows", bad,
                  [(s[i].item(), sr[i].item(), x[i].abs().max().item()) for i in bad][:3], "codes", qbad)

# Host time of one fp8_linear forward + input gradient: torch ops and Python functions.
import cProfile
import pstats
from torch.profiler import ProfilerActivity, profile
x = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16) * 0.02
fw = Fp8Weight.quantize(w)
dy = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    fp8_linear(x, fw).backward(dy)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        fp8_linear(x, fw).backward(dy)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
pr = cProfile.Profile()
pr.enable()
for _ in range(50):
    fp8_linear(x, fw).backward(dy)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
