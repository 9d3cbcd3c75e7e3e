"""Sweep launch parameters of our kernels at the benchmark shapes (GPU only). Prints ms and GB/s per setting.

    python3 tools/tune.py [op ...]      ops: swiglu cross_entropy rope qk_norm_rope rms_norm
"""
import importlib
import itertools
import sys

import torch
from triton.testing import do_bench

from swift_liger.ops import _common

BF16 = torch.bfloat16


def bench(fn, leaves, nbytes):
    """(forward+backward ms, GB/s over nbytes, forward-only ms), with fixed random output grads."""
    outs = fn()
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    grads = [torch.randn_like(o) for o in outs]

    def step():
        o = fn()
        torch.autograd.backward([o] if isinstance(o, torch.Tensor) else list(o), grads)
    step()
    ms = do_bench(step, warmup=50, rep=300, grad_to_none=leaves, return_mode="median")
    with torch.no_grad():
        fwd = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms, nbytes / ms / 1e6, fwd


def sweep(name, module, grid, fn, leaves, nbytes, patch_warps=False):
    keys = list(grid)
    saved = {k: getattr(module, k) if not isinstance(getattr(module, "TUNING", None), dict) or k not in module.TUNING
             else module.TUNING[k] for k in keys if k != "warps"}
    orig_warps = _common.num_warps_for
    rows = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(keys, values))
        for k, v in setting.items():
            if k == "warps":
                _common.num_warps_for = (lambda v: (lambda block: v))(v)
            elif isinstance(getattr(module, "TUNING", None), dict) and k in module.TUNING:
                module.TUNING[k] = v
            else:
                setattr(module, k, v)
        if hasattr(module, "_OCCUPANCY"):
            module._OCCUPANCY.clear()
        try:
            ms, gbps, fwd = bench(fn, leaves, nbytes)
            rows.append((ms, gbps, setting))
            print(f"{name:14s} {setting}  {ms:.4f} ms (fwd {fwd:.4f})  {gbps:.0f} GB/s", flush=True)
        except Exception as exc:
            print(f"{name:14s} {setting}  failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    _common.num_warps_for = orig_warps
    for k, v in saved.items():
        if isinstance(getattr(module, "TUNING", None), dict) and k in module.TUNING:
            module.TUNING[k] = v
        else:
            setattr(module, k, v)
    if rows:
        best = min(rows, key=lambda r: r[0])
        print(f"BEST {name}: {best[2]} {best[0]:.4f} ms {best[1]:.0f} GB/s", flush=True)


def rope_inputs(t=16384, hq=32, hkv=8, d=128):
    q = torch.randn(1, t, hq, d, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, t, hkv, d, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    ang = torch.rand(1, t, d, device="cuda") * 6.28
    return q, k, ang.cos().to(BF16), ang.sin().to(BF16)


def main(ops):
    if "swiglu" in ops:
        m = importlib.import_module("swift_liger.ops.swiglu")
        n, i = 16384, 14336
        a = torch.randn(n, i, device="cuda", dtype=BF16, requires_grad=True)
        b = torch.randn(n, i, device="cuda", dtype=BF16, requires_grad=True)
        sweep("swiglu", m, {"FLAT_BLOCK": [1024, 2048, 4096], "FLAT_NUM_WARPS": [4, 8]},
              lambda: m.swiglu(a, b), [a, b], 8 * n * i * 2)
        del a, b
    if "cross_entropy" in ops:
        m = importlib.import_module("swift_liger.ops.cross_entropy")
        n, v = 8192, 128256
        x = torch.randn(n, v, device="cuda", dtype=BF16, requires_grad=True)
        y = torch.randint(0, v, (n,), device="cuda")
        sweep("cross_entropy", m, {"MAX_BLOCK_V": [4096, 8192, 16384], "warps": [4, 8, 16]},
              lambda: m.cross_entropy(x, y, validate_labels=False), [x], 3 * n * v * 2)
        del x
    if "rope" in ops:
        m = importlib.import_module("swift_liger.ops.rope")
        q, k, cos, sin = rope_inputs()
        sweep("rope", m, {"num_warps": [4, 8, 16], "programs_per_sm": [None, 8, 32], "tile_elems": [1024, 2048, 4096]},
              lambda: m.apply_rope(q, k, cos, sin), [q, k], 4 * q.numel() * 2 + 4 * k.numel() * 2)
    if "qk_norm_rope" in ops:
        m = importlib.import_module("swift_liger.ops.qk_norm_rope")
        q, k, cos, sin = rope_inputs()
        wq = torch.randn(128, device="cuda", dtype=BF16, requires_grad=True)
        wk = torch.randn(128, device="cuda", dtype=BF16, requires_grad=True)
        sweep("qk_norm_rope", m, {"fwd_num_warps": [4, 8], "bwd_num_warps": [4, 8, 16],
                                  "bwd_programs_per_sm": [1, 2, 4, 8], "bwd_tile_elems": [1024, 2048, 4096]},
              lambda: m.qk_norm_rope(q, k, wq, wk, cos, sin), [q, k, wq, wk], 5 * (q.numel() + k.numel()) * 2)
    if "flce" in ops:
        m = importlib.import_module("swift_liger.ops.fused_linear_cross_entropy")
        n, h, v = 8192, 4096, 128256
        hid = (torch.randn(n, h, device="cuda", dtype=BF16) * 0.5).requires_grad_()
        w = (torch.randn(v, h, device="cuda", dtype=BF16) * 0.02).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        for strategy in ("recompute", "accumulate"):
            sweep(f"flce {strategy}", m, {"WORKSPACE_BYTES": [128 << 20, 256 << 20, 512 << 20],
                                          "ROW_BLOCK_V": [4096, 8192]},
                  lambda: m.fused_linear_cross_entropy(hid, w, y, dw_strategy=strategy), [hid, w], 0)
        w.requires_grad_(False)
        sweep("flce frozen", m, {"WORKSPACE_BYTES": [128 << 20, 256 << 20, 512 << 20]},
              lambda: m.fused_linear_cross_entropy(hid, w, y), [hid], 0)
        del hid, w
    if "rms_norm" in ops:
        m = importlib.import_module("swift_liger.ops.rms_norm")
        n, h = 16384, 4096
        x = torch.randn(n, h, device="cuda", dtype=BF16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=BF16, requires_grad=True)
        grid = {"FWD_NUM_WARPS": [4, 8, 16], "FWD_PROGRAMS_PER_SM": [None, 4, 16],
                "BWD_NUM_WARPS": [8, 16], "BWD_PROGRAMS_PER_SM": [None, 1, 2, 4]}
        if True:
            sweep("rms_norm", m, grid, lambda: m.rms_norm(x, w, 1e-6), [x, w], 5 * n * h * 2)


if __name__ == "__main__":
    main(sys.argv[1:] or ["swiglu", "cross_entropy", "rope", "qk_norm_rope", "rms_norm"])
