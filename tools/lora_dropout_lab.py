"""Launch configurations of the LoRA-dropout kernels (ops/lora_dropout_kernel.py), measured per shape on one GPU.

    python3 tools/lora_dropout_lab.py [--out DIR] [--deadline S] [--kinds down,igrad,wgrad] [--defaults]
    python3 tools/lora_dropout_lab.py report SWEEP.json DEFAULTS.json > NAME.md   (the tables of a sweep and a later
    --defaults run: the old default, launch_config's new choice, the best point found, cuBLAS without dropout)

For each (rows N, input features, rank r) of the projections Qwen2.5 0.5B-7B and Llama-3-8B train, and each of the
three kernels: the default configuration, then a coordinate descent over the config's fields (two passes: each field
tried at every value with the others at their best so far). Each point is timed as a CUDA-graph replay
(triton.testing.do_bench_cudagraph, median: kernel time, no host), with the kernel's minimum bytes as GB/s. Beside
them, the same shape without dropout through cuBLAS (x @ a^T, du @ a, du^T @ x): what reading or writing [N, in]
costs without the draws. Every row is printed as it is measured and lora_dropout_lab.json rewritten.
"""
import argparse
import json
import os
import sys
import time

import torch
from triton.testing import do_bench_cudagraph

from swift_liger.bench import harness
from swift_liger.ops import _common
from swift_liger.ops import lora_dropout_kernel as K

SHAPES = [  # (rows, in, r): the down-projection inputs of a step's tokens
    (8192, 3584, 16), (8192, 18944, 16),        # Qwen2.5-7B, 8k tokens: hidden, intermediate
    (4096, 896, 16), (4096, 4864, 16),          # Qwen2.5-0.5B, 8 x 512
    (2048, 1536, 16), (2048, 8960, 16),         # Qwen2.5-1.5B, 1 x 2k
    (8192, 1536, 16), (4096, 2048, 16), (4096, 11008, 16),   # 1.5B 4 x 2k; 3B 2 x 2k
    (16384, 4096, 16), (16384, 14336, 16),      # Llama-3-8B, 16k
    (8192, 3584, 64),                           # rank 64
]
AXES = {
    "down": {"block_n": [16, 32, 64, 128], "block_k": [32, 64, 128, 256], "num_warps": [2, 4, 8],
             "splits": [1, 2, 4, 8, 16], "num_stages": [2, 3, 4]},
    "igrad": {"block_n": [32, 64, 128], "block_k": [32, 64, 128, 256], "num_warps": [2, 4, 8],
              "num_stages": [1, 2, 3]},
    "wgrad": {"block_n": [32, 64, 128], "block_k": [64, 128, 256], "num_warps": [2, 4, 8],
              "splits": [4, 8, 16, 32, 64, 128], "num_stages": [2, 3, 4]},
}

def report(sweep_path, defaults_path):
    sweep, new = json.load(open(sweep_path)), json.load(open(defaults_path))
    key = lambda r: (r["kind"], r["n"], r["in"], r["r"])   # noqa: E731
    best = {key(r): r for r in sweep["rows"] if "best" in r}
    now = {key(r): r["default_ms"] for r in new["rows"] if "best" in r}
    cub = {key(r): r["ms"] for r in new["rows"] if r.get("impl") == "cublas_no_dropout"}
    gb = {key(r): r["gbps"] for r in new["rows"] if "config" in r and not r["forced"]}
    cfg = {key(r): r["config"] for r in new["rows"] if "config" in r and not r["forced"]}
    print("| kernel | rows | in | r | before (us) | now (us) | now vs before | best of sweep (us) | cuBLAS, no dropout"
          " (us) | now / cuBLAS | now GB/s | now: block_n x block_k, splits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, b in best.items():
        if k not in now:
            continue
        c = cfg[k]
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {b['default_ms'] * 1e3:.1f} | {now[k] * 1e3:.1f} | "
              f"{b['default_ms'] / now[k]:.2f}x | {b['best_ms'] * 1e3:.1f} | {cub[k] * 1e3:.1f} | "
              f"{now[k] / cub[k]:.2f} | {gb[k]:.0f} | {c['block_n']} x {c['block_k']}, {c['splits']} |")


if len(sys.argv) > 1 and sys.argv[1] == "report":
    report(*sys.argv[2:4])
    sys.exit(0)

p = argparse.ArgumentParser()
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--deadline", type=float, default=400.0, help="seconds; remaining shapes are skipped after it")
p.add_argument("--kinds", default="down,igrad,wgrad")
p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
p.add_argument("--defaults", action="store_true", help="time launch_config's choice only (no sweep)")
p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, two tiny shapes, one field value")
args = p.parse_args()
DEV = "cpu" if args.smoke else "cuda"
if args.smoke:
    SHAPES = [(40, 64, 16), (16, 128, 8)]
    AXES = {kind: {f: v[:2] for f, v in axes.items()} for kind, axes in AXES.items()}
T0 = time.time()
rows = []
SEED = torch.tensor([12345], dtype=torch.int64, device=DEV)
P = 0.05


def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    harness.write_json(os.path.join(args.out, "lora_dropout_lab.json"),
                       {"environment": harness.environment(), "p": P, "rows": rows})


def min_bytes(kind, n, n_in, r, splits=1):
    if kind == "cublas":    # a product without dropout: the [N, in] side once, the rest small
        return 2 * n * n_in + 2 * n * r + 2 * r * n_in
    if kind == "down":      # read x, a; write u (fp32 partials when split)
        return 2 * n * n_in + 2 * r * n_in + (2 if splits == 1 else 8 * splits + 2) * n * r
    if kind == "igrad":     # read du, a; write dx_lora
        return 2 * n * n_in + 2 * n * r + 2 * r * n_in
    return 2 * n * n_in + 2 * n * r + (4 * splits * 2 + 2) * r * n_in   # wgrad: x, du; partials; dA


def op(kind, t):
    if kind == "down":
        return lambda: K.lora_down(t["x"], t["a"], SEED, P)
    if kind == "igrad":
        return lambda: K.lora_down_input_grad(t["du"], t["a"], SEED, P, torch.bfloat16)
    return lambda: K.lora_down_weight_grad(t["x"], t["du"], SEED, P)


def cublas(kind, t):
    if kind == "down":
        return lambda: t["x"] @ t["a"].t()
    if kind == "igrad":
        return lambda: t["du"] @ t["a"]
    return lambda: t["du"].t() @ t["x"]


def timed(fn):
    if args.smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3, None
    try:
        return do_bench_cudagraph(fn, rep=25, return_mode="median"), None
    except Exception as exc:  # noqa: BLE001 (a config the compiler or the GPU refuses is a row, not a crash)
        torch.cuda.synchronize()
        return None, harness.describe(exc)


def point(kind, shape, t, fields, ref):
    _common.set_launch_override(K, kind, **fields)
    try:
        cfg = K.launch_config(kind, shape[0], shape[1], t["x"].device)
        ms, err = timed(op(kind, t))
        if ms is not None:
            got = op(kind, t)().float()
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()):
                err, ms = f"wrong result: max err {(got - ref).abs().max().item():.3g}", None
    finally:
        _common.set_launch_override(K, kind)
    b = min_bytes(kind, *shape, splits=cfg.splits)
    emit({"kind": kind, "n": shape[0], "in": shape[1], "r": shape[2], "config": cfg.__dict__, "forced": fields,
          "ms": ms, "gbps": b / ms / 1e6 if ms else None, "error": err})
    return ms


def tune(kind, shape, t):
    ref = op(kind, t)().float()
    best, best_ms = {}, point(kind, shape, t, {}, ref)
    default_ms = best_ms
    seen = {(): best_ms}
    for _ in range(0 if args.defaults else 2):
        for field, values in AXES[kind].items():
            for v in values:
                trial = {**best, field: v}
                key = tuple(sorted(trial.items()))
                if key in seen:
                    continue
                ms = seen[key] = point(kind, shape, t, trial, ref)
                if ms is not None and (best_ms is None or ms < best_ms):
                    best, best_ms = trial, ms
    emit({"kind": kind, "n": shape[0], "in": shape[1], "r": shape[2], "best": best, "best_ms": best_ms,
          "default_ms": default_ms, "speedup": default_ms / best_ms if default_ms and best_ms else None})


def main():
    if not args.smoke:
        props = torch.cuda.get_device_properties(0)
        emit({"device": props.name, "sms": props.multi_processor_count})
    for shape in SHAPES[:args.shapes]:
        n, n_in, r = shape
        g = torch.Generator(device=DEV).manual_seed(n + n_in + r)
        t = {"x": torch.randn(n, n_in, device=DEV, generator=g).bfloat16(),
             "a": (torch.randn(r, n_in, device=DEV, generator=g) / n_in ** 0.5).bfloat16(),
             "du": torch.randn(n, r, device=DEV, generator=g).bfloat16()}
        for kind in args.kinds.split(","):
            if time.time() - T0 > args.deadline:
                emit({"skipped": [kind, *shape], "reason": "deadline"})
                continue
            ms, err = timed(cublas(kind, t))
            emit({"kind": kind, "n": n, "in": n_in, "r": r, "impl": "cublas_no_dropout", "ms": ms,
                  "gbps": min_bytes("cublas", *shape) / ms / 1e6 if ms else None, "error": err})
            tune(kind, shape, t)
        t.clear()
    # a copy of x's size: the card's achievable streaming rate in this process
    x = torch.empty(*((64, 64) if args.smoke else (8192, 18944)), device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms, _ = timed(lambda: y.copy_(x))
    emit({"impl": "copy", "bytes": 2 * x.numel() * 2, "ms": ms, "gbps": 4 * x.numel() / ms / 1e6 if ms else None})


if __name__ == "__main__":
    main()
