"""Offline portability check (issue 12, item 3): every Triton kernel, at every launch configuration its launcher
can select, compiles for sm_75 (T4), sm_80 (A100), sm_86 (A10), sm_89 (L4) and sm_90 (H100/H200) and fits each
architecture's per-block limits (shared memory, 255 registers/thread, 64 Ki registers/block). No GPU needed:
Triton compiles for a target offline; registers come from the cubin via the cuobjdump bundled with Triton.

How the configurations are enumerated: every kernel module's ``launch_config`` (the function its launchers call;
the fused-linear-CE slice width from default_chunk_size / _slice_width, decode attention's splits from _plan),
given a ``_common.Target`` per architecture (SM count and shared memory: decode attention, qk_norm_rope's backward
grid; sm_90 for the modules whose choice depends on the device type only); lora_linear and logprobs launch no
kernels of their own (dropout_mask_kernel and the fused-linear-CE kernels). They are called over a grid of realistic
shapes (hidden 1024..8192, intermediate 4864..28672, heads 8/8..64/8 and a few GQA layouts with D 64/128/256 and
full or half rotary, vocab 32000 / 128256 / 151936 / 256000, 1..131072 token rows), and the results deduplicated to
distinct (kernel, constexprs, num_warps, num_stages) tuples.

Deduplication to keep CI time small (2 cores):
* Boolean feature flags (HAS_W, HAS_RES, HAS_SOFTCAP, ...) are compiled "all on" and "all off" for every shape
  configuration, the non-boolean modes (CASTING, ACT, ...) each; mixed flag subsets are not compiled separately
  (they only add or drop loads / arithmetic between those two extremes).
* Dtypes: sm_90 compiles every configuration in fp32 and bf16 (fp16 lowers like bf16 there); the other targets
  compile every configuration once, in fp32 (the most registers: fp32 tiles are twice as wide). sm_75 also
  compiles one configuration per kernel in fp16 and bf16 (T4 has no bf16 hardware: Triton 3.7 emulates bf16
  conversions with integer ops, so bf16 elementwise/reduction kernels compile there; UNSUPPORTED lists the
  kernels that still cannot be built for it). The decode-attention split kernel (tl.dot) has no fp32 variant
  without IEEE, so it compiles IEEE=True in fp32 and IEEE=False in bf16 (and fp16 on sm_75 / sm_90).
Cost with SWIFT_LIGER_PORTABILITY=full: 354 distinct configurations, about 1600 compiles; about 20 minutes on 2 cores
with a cold Triton cache (the decode-attention split kernel and qk_norm_rope backward are most of it), about 10 s
with a warm one. Without it (make test) only the heaviest configuration per kernel, target and dtype compiles.
Run with -s for a kernel x target summary (configurations ok / max registers / max shared memory).
The compiles run in one subprocess with TRITON_INTERPRET unset (tests/conftest.py sets it for this process).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

ARCH_NAMES = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
# make test compiles, per kernel, target and dtype, the heaviest configuration (biggest tiles, most warps): a few
# minutes on 2 cores. SWIFT_LIGER_PORTABILITY=full compiles every distinct configuration (~20 min with a cold cache).
FULL = os.environ.get("SWIFT_LIGER_PORTABILITY") == "full"
DTYPES = ("fp32", "fp16", "bf16")

# (kernel, arch, dtype) -> reason: combinations that are expected NOT to compile (asserted to fail, exactly).
UNSUPPORTED: dict = {}

# (kernel, arch, dtype, D) -> what: configurations a launcher selects today that exceed the architecture's shared
# memory (they would raise OutOfResources at launch). Asserted exactly, so a fix shows up as a failure to update.
# Decode attention picks its tiles and pipeline depth per device (decode_attention_kernel.split_config). Packed-row
# attention's dK/dV kernel in fp32 at head dim 256 on sm_75 needs 66560 B at its smallest tiles (16 x 16, 1 stage)
# against T4's 65536: fp32 training of a head-256 model (Gemma) on a T4 would fail at launch.
KNOWN_OVER_LIMIT: set = {("_varlen_dkdv_kernel", "sm_75", "fp32", 256)}

HIDDEN = (1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)
INTERMEDIATE = (4864, 8960, 11008, 13824, 14336, 18944, 22016, 28672)
HEADS = ((8, 8), (32, 8), (64, 8), (16, 2), (32, 32))
HEAD_DIMS = (64, 128, 256)
VOCABS = (32000, 128256, 151936, 256000)
ROWS = (1, 2, 7, 64, 4096, 16384, 131072)
SM_COUNTS = {"sm_75": 40, "sm_80": 108, "sm_86": 84, "sm_89": 58, "sm_90": 132}  # T4, A100, A10/3090, L4, H100

FLOAT_ARGS = {"eps", "offset", "inv_h", "scale", "softcap", "z_loss", "cap", "inv_temp"}
RMS_PTRS = {"X", "R", "W", "Y", "S", "RSTD", "DY", "DS", "DX", "DW_PART"}
# Pointers that are not the activation dtype, per kernel argument name.
FIXED_PTRS = {
    "RSTD": "*fp32", "DW_PART": "*fp32", "labels_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32",
    "grad_ptr": "*fp32", "sum_ptr": "*fp32", "scale_ptr": "*fp32", "part_ptr": "*fp32", "pos_ptr": "*i64",
    "end_ptr": "*i64", "start_ptr": "*i64", "mask_ptr": "*u8", "bits_ptr": "*u8",
    "delta_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32",
}
KERNEL_FIXED_PTRS = {  # per kernel overrides
    "_fp8_quant_rows_kernel": {"q_ptr": "*u8", "fold_ptr": "*fp32"},
    "_fp8_transpose_kernel": {"src_ptr": "*u8", "dst_ptr": "*u8"},
    "_decode_split_kernel": {"o_ptr": "*fp32"},
    "_decode_merge_kernel": {"o_ptr": "*fp32"},
    "_kv_sink_refresh_kernel": {"cos_ptr": "*fp32", "sin_ptr": "*fp32"},
    "_kv_sink_rotate_kernel": {"cos_ptr": "*fp32", "sin_ptr": "*fp32"},
}


# Constexprs that only set loop trip counts / head masks once the BLOCK_* tile sizes are fixed (head counts, GQA
# group size): configurations differing only in these are compiled once, with the first value seen.
# Per kernel; rope / qk_norm_rope: head counts, HALF and D only bound loops and masks of the BLOCK_* tiles;
# decode split: G only masks G_PAD rows, S_PAD only scales the partial-output offset.
TRIP_COUNT_ONLY = {
    "_rope_kernel": {"HQ", "HK", "HALF", "D"},
    "_qk_norm_rope_fwd_kernel": {"HQ", "HK", "HALF", "D"},
    "_qk_norm_rope_bwd_kernel": {"HQ", "HK", "HALF", "D"},
    "_decode_split_kernel": {"G", "S_PAD"},
    "_varlen_fwd_kernel": {"G", "D"},
    "_varlen_dkdv_kernel": {"G", "HPP", "D"},
    "_varlen_dq_kernel": {"G", "D"},
    "_varlen_delta_kernel": {"D"},
}
# Boolean feature flags: a configuration with all of its flags off (the lightest variant) compiles for sm_90 only.
FEATURE_FLAGS = {"HAS_W", "HAS_RES", "STORE_RSTD", "HAS_DS", "COMPUTE_DX", "COMPUTE_DW", "BACKWARD", "INTERLEAVED",
                 "GEMMA", "ROUND_Y", "HAS_SMOOTHING", "HAS_SOFTCAP", "HAS_Z_LOSS", "HAS_CAP", "HAS_EPS", "HAS_ZLOSS",
                 "HAS_TEMP", "UNIFORM", "SPLIT_SINKS", "SOFTCAP", "WINDOW", "HAS_FOLD"}


def _both(flags, **modes):
    """Flag dicts: every combination of the mode values, each with all boolean ``flags`` on and all off."""
    keys = list(modes)
    out = []
    for values in itertools.product(*(modes[k] for k in keys)) if keys else [()]:
        for on in (True, False):
            d = dict(zip(keys, values))
            d.update({f: on for f in flags})
            out.append(d)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Worker (runs in the clean subprocess): enumerate, compile, report JSON
# ---------------------------------------------------------------------------------------------------------------

def _enumerate():
    """{(module, kernel, constexprs-json, num_warps, num_stages)} over the shape grid, per arch when it matters."""
    from swift_liger.ops import (_common, _reduce as red, _scale as sc, cross_entropy_kernel as ce,
                                 decode_attention_kernel as da,
                                 dropout_mask_kernel as dm, fp8_quant_kernel as fq,
                                 fp8_transpose_kernel as ft,
                                 fused_linear_cross_entropy_kernel as fl, kv_ring_write_kernel as kv,
                                 qk_norm_rope_kernel as qk, rms_norm_kernel as rn, rope_kernel as rope,
                                 swiglu_kernel as sw, varlen_attention_kernel as va)
    from swift_liger.ops import _targets
    # Per architecture: its SM count and shared memory (decode attention, qk_norm_rope's backward grid); the other
    # modules' choices depend on the device type only, so they are enumerated once for sm_90.
    targets = {arch: _common.Target("cuda", _targets.ARCHS[arch].cc, sms, _targets.ARCHS[arch].max_shared)
               for arch, sms in SM_COUNTS.items()}
    cuda = targets["sm_90"]
    jobs = {}   # key -> set of archs ("*" = all)

    seen = {}   # structural key -> the key of its first (representative) configuration

    def add(mod, fn, consts, warps, stages=None, archs=("*",)):
        skip = TRIP_COUNT_ONLY.get(fn, ())
        struct = {k: v for k, v in consts.items() if k not in skip}
        flags = [v for k, v in consts.items() if k in FEATURE_FLAGS]
        if flags and not any(flags):
            archs = ("sm_90",)
        skey = (mod, fn, json.dumps(struct, sort_keys=True), int(warps), stages)
        key = seen.setdefault(skey, (mod, fn, json.dumps(consts, sort_keys=True), int(warps), stages))
        jobs.setdefault(key, set()).update(archs)

    # rms_norm: forward / backward.
    for H, n in itertools.product(HIDDEN, (1, 2, 4096)):   # n_rows only caps BLOCK_M at next_pow2(n_rows) <= 4
        cfg = rn.launch_config("fwd", n, H, cuda)
        for f in _both(["HAS_W", "HAS_RES", "STORE_RSTD"], CASTING=[0, 1, 2]):
            add("rms_norm_kernel", "_rms_norm_fwd_kernel",
                dict(f, PREFETCH=cfg.prefetch, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h), cfg.num_warps)
        cfg = rn.launch_config("bwd", n, H, cuda)
        for f in _both(["HAS_W", "HAS_DS", "COMPUTE_DX", "COMPUTE_DW"], CASTING=[0, 1, 2]):
            add("rms_norm_kernel", "_rms_norm_bwd_kernel",
                dict(f, PREFETCH=cfg.prefetch, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h), cfg.num_warps)

    def blocks(c):
        return dict(BLOCK_HQ=c.block_hq, BLOCK_HK=c.block_hk, BLOCK_HALF=c.block_half, BLOCK_PASS=c.block_pass)

    # rope / qk_norm_rope: head layouts x head dims x (full, half) rotary.
    for (HQ, HK), D, part in [(h, d, p) for h in HEADS for d in HEAD_DIMS for p in (1, 2) if p == 1 or d == 128]:
        half = D // 2 // part
        base = dict(HQ=HQ, HK=HK, HALF=half, D=D)
        c = rope.launch_config(HQ, HK, D, half, cuda)
        for bwd, il in ((False, False), (True, True)):
            add("rope_kernel", "_rope_kernel", dict(base, **blocks(c), BACKWARD=bwd, INTERLEAVED=il), c.num_warps)
        c = qk.launch_config("fwd", 1, HQ, HK, D, half, cuda)
        for gemma, round_y in ((False, False), (True, True)):
            add("qk_norm_rope_kernel", "_qk_norm_rope_fwd_kernel", dict(base, **blocks(c), GEMMA=gemma,
                                                                       ROUND_Y=round_y), c.num_warps)
        c = qk.launch_config("bwd", 1, HQ, HK, D, half, cuda)
        for gemma, dw in ((False, False), (True, True)):
            add("qk_norm_rope_kernel", "_qk_norm_rope_bwd_kernel", dict(base, **blocks(c), GEMMA=gemma,
                                                                       COMPUTE_DW=dw), c.num_warps)
        for arch, t in targets.items():
            for n_tok in ROWS:
                P = qk.launch_config("bwd", n_tok, HQ, HK, D, half, t).programs
                c = red.launch_config(P, D, cuda)
                add("_reduce", "_column_sum_kernel", dict(BLOCK_P=c.block_p, BLOCK_N=c.block_n), c.num_warps,
                    archs=(arch,))

    # swiglu / geglu: flat (contiguous) and row-strided paths over the intermediate sizes.
    for I in INTERMEDIATE:
        for act in (sw.SILU, sw.GELU_TANH):
            for contiguous in (True, False):
                c = sw.launch_config(I, contiguous, cuda)
                add("swiglu_kernel", "_glu_fwd_kernel", dict(ACT=act, FLAT=c.flat, BLOCK=c.block), c.num_warps)
                for inplace in (False, True):
                    add("swiglu_kernel", "_glu_bwd_kernel", dict(ACT=act, FLAT=c.flat, INPLACE=inplace,
                                                                 BLOCK=c.block), c.num_warps)

    # the gradient scaling of the loss ops (fused linear CE's dW / dh)
    c = sc.launch_config(1 << 20, cuda)
    for per_row in (False, True):
        add("_scale", "_scale_kernel", dict(PER_ROW=per_row, BLOCK=c.block), c.num_warps)

    # cross_entropy and the fused linear CE (also what fused_linear_logprobs launches).
    for V in VOCABS:
        c = ce.launch_config(V, cuda)
        for f in _both(["HAS_SMOOTHING", "HAS_SOFTCAP", "HAS_Z_LOSS"], ALL_LSE=[False, True]):
            add("cross_entropy_kernel", "_ce_fwd_kernel", dict(f, BLOCK_V=c.block_v), c.num_warps)
        for f in _both(["HAS_SMOOTHING", "HAS_SOFTCAP", "HAS_Z_LOSS"]):
            add("cross_entropy_kernel", "_ce_bwd_kernel", dict(f, BLOCK_V=c.block_v), c.num_warps)
        c = fl.launch_config("rows", V, cuda)
        for f in _both(["HAS_CAP", "HAS_EPS", "HAS_ZLOSS", "HAS_TEMP", "WRITE_ENT", "WRITE_ARGMAX"],
                       WRITE_GRAD=[False, True], WRITE_SUM=[False, True]):
            add("fused_linear_cross_entropy_kernel", "_flce_rows_kernel", dict(f, BLOCK_V=c.block_v), c.num_warps)
        for n, elt in itertools.product(ROWS, (2, 4)):
            chunk = fl.default_chunk_size(n, V, elt)
            c = fl.launch_config("slice", fl._slice_width(n, V, min(chunk, n) * V), cuda)
            for f in _both(["HAS_CAP", "HAS_EPS", "HAS_ZLOSS", "HAS_TEMP"]):
                add("fused_linear_cross_entropy_kernel", "_flce_slice_kernel", dict(f, BLOCK_V=c.block_v),
                    c.num_warps)

    # decode attention: S_PAD depends on the SM count of the target, the tiles and stages on its shared memory.
    for arch, t in targets.items():
        for (HQ, HKV), D, B, C in itertools.product(HEADS, HEAD_DIMS, (1, 8, 64), (1, 64, 4096, 131072)):
            block_d = max(16, _common.next_pow2(D))
            G = HQ // HKV
            for ieee in (False, True):   # IEEE = fp32 inputs: only compiled with fp32 pointers (see _dtypes_for)
                # WRITE (the ring write fused into eager decode) at the decode shape of a full 4096-slot ring
                for write in ((False, True) if (B, C) == (1, 4096) else (False,)):
                    cfg = da.launch_config(block_d, 4 if ieee else 2, t, write)
                    _, splits = da._plan(B, HKV, C, t, cfg.block_n)
                    s_pad = max(2, _common.next_pow2(splits))
                    add("decode_attention_kernel", "_decode_split_kernel",
                        dict(G=G, G_PAD=max(16, _common.next_pow2(G)), D=D, BLOCK_D=block_d, S_PAD=s_pad,
                             BLOCK_N=cfg.block_n, UPCAST=False, IEEE=ieee, WRITE=write), cfg.num_warps,
                        cfg.num_stages, archs=(arch,))
                    add("decode_attention_kernel", "_decode_merge_kernel", dict(D=D, BLOCK_D=block_d, S_PAD=s_pad),
                        4, archs=(arch,))

    # packed-row attention: tiles per device (shared memory), head dim and dtype (G and D: trip counts and masks).
    for arch, t in targets.items():
        for (HQ, HKV), D in itertools.product(HEADS, HEAD_DIMS):
            block_d = max(16, _common.next_pow2(D))
            for ieee in (False, True):
                elt = 4 if ieee else 2
                for kind, fn in (("fwd", "_varlen_fwd_kernel"), ("dkdv", "_varlen_dkdv_kernel"),
                                 ("dq", "_varlen_dq_kernel")):
                    cfg = va.launch_config(kind, block_d, elt, t)
                    for f in _both(["SOFTCAP", "WINDOW"]):
                        extra = dict(HPP=1) if kind == "dkdv" else {}
                        add("varlen_attention_kernel", fn,
                            dict(f, **extra, G=HQ // HKV, D=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m,
                                 BLOCK_N=cfg.block_n, UPCAST=False, IEEE=ieee),
                            cfg.num_warps, cfg.num_stages, archs=(arch,))
            add("varlen_attention_kernel", "_varlen_delta_kernel",
                dict(D=D, BLOCK_D=block_d, BLOCK_M=64, UPCAST=False), 4)

    # kv ring write (+ sink refresh / rotate).
    for D, n_rows in itertools.product(HEAD_DIMS, (1, 2, 8, 16, 32, 64, 512, 4096)):
        c = kv.launch_config("write", n_rows, D, cuda)
        for uniform, split in ((False, False), (True, True)):
            add("kv_ring_write_kernel", "_kv_ring_write_kernel",
                dict(D=D, UNIFORM=uniform, SPLIT_SINKS=split, ROWS=c.rows, BLOCK_D=c.block_d), c.num_warps)
        c = kv.launch_config("refresh", n_rows, D, cuda)
        for limit in (1, 2):
            add("kv_ring_write_kernel", "_kv_sink_refresh_kernel",
                dict(LIMIT=limit, HALF=D // 2, ROWS=c.rows, BLOCK_HALF=c.block_half), c.num_warps)
        c = kv.launch_config("rotate", n_rows, D, cuda)
        add("kv_ring_write_kernel", "_kv_sink_rotate_kernel", dict(HALF=D // 2, ROWS=c.rows, BLOCK_HALF=c.block_half),
            c.num_warps)

    # dropout mask (the LoRA linear's only kernels).
    c = dm.launch_config("pack", 1 << 20, cuda)
    add("dropout_mask_kernel", "_pack_kernel", dict(BLOCK=c.block), c.num_warps)
    c = dm.launch_config("scale", 1 << 20, cuda)
    add("dropout_mask_kernel", "_masked_scale_kernel", dict(BLOCK=c.block), c.num_warps)

    # FP8 row quantization (fp8_linear's only kernel): launched on sm_89+ only (FP8 tensor cores).
    for K in (1536, 3584, 18944):
        c = fq.launch_config(K, cuda)
        for fold, hw_cvt in itertools.product((True, False), (False, True)):   # hw_cvt: sm_89+'s default
            add("fp8_quant_kernel", "_fp8_quant_rows_kernel",
                dict(HAS_FOLD=fold, BLOCK=c.block, ONE_PASS=K <= c.block, ROWS=c.rows if K <= c.block else 1,
                     HW_CVT=hw_cvt),
                c.num_warps,
                archs=("sm_89", "sm_90"))
    c = ft.launch_config(cuda)   # the FP8 weight's transpose (fp8_linear's input gradient)
    add("fp8_transpose_kernel", "_fp8_transpose_kernel", dict(BLOCK=c.block), c.num_warps, archs=("sm_89", "sm_90"))
    return jobs


def _dtypes_for(fn_name, consts, arch, first=False):
    if fn_name in ("_pack_kernel", "_fp8_transpose_kernel"):
        return ("u8",)
    if fn_name in ("_decode_split_kernel", "_varlen_fwd_kernel", "_varlen_dkdv_kernel",
                   "_varlen_dq_kernel"):   # IEEE is True exactly for fp32 inputs
        if consts["IEEE"]:
            return ("fp32",)
        return ("fp16", "bf16") if arch in ("sm_75", "sm_90") else ("bf16",)
    if arch == "sm_90":
        return ("fp32", "bf16")
    if arch == "sm_75" and first:
        return ("fp32", "fp16", "bf16")
    return ("fp32",)


def _signature(fn, consts, dtype):
    sig = {}
    fixed = dict(FIXED_PTRS, **KERNEL_FIXED_PTRS.get(fn.__name__, {}))
    for name, p in zip(fn.arg_names, fn.params):
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr") or (name in RMS_PTRS and fn.__name__.startswith("_rms")):
            sig[name] = fixed.get(name, "*" + dtype)
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _compile_one(job):
    import importlib
    from swift_liger.ops import _targets
    mod, fn_name, consts_json, warps, stages, arch, dtype = job
    fn = getattr(importlib.import_module("swift_liger.ops." + mod), fn_name)
    consts = json.loads(consts_json)
    t0 = time.time()
    res = dict(mod=mod, kernel=fn_name, consts=consts, num_warps=warps, num_stages=stages, arch=arch, dtype=dtype)
    try:
        k = _targets.compile_for(fn, _signature(fn, consts, dtype), consts, arch, warps, stages)
        ru = _targets.resource_usage(k.asm["cubin"])
        shared = int(k.metadata.shared)
        res.update(ok=True, regs=ru["regs"], stack=ru["stack"], shared=shared,
                   violations=_targets.check_limits(arch, ru["regs"], shared, warps))
    except Exception as e:  # noqa: BLE001 (reported, the test decides)
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    res["seconds"] = round(time.time() - t0, 3)
    return res


def worker_main(procs: int = 2):
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiles need TRITON_INTERPRET unset"
    from multiprocessing import get_context
    jobs = _enumerate()
    flat, probed = [], set()
    for (mod, fn_name, cj, warps, stages), archs in sorted(jobs.items(), key=lambda kv: str(kv[0])):
        consts = json.loads(cj)
        first = fn_name not in probed
        probed.add(fn_name)
        for arch in (ARCH_NAMES if "*" in archs else sorted(archs)):
            for dt in _dtypes_for(fn_name, consts, arch, first):
                flat.append((mod, fn_name, cj, warps, stages, arch, dt))
    if not FULL:   # per kernel, target and dtype: the configuration with the biggest tiles and the most warps
        heaviest = {}
        for job in flat:
            mod, fn_name, cj, warps, stages, arch, dt = job
            consts = json.loads(cj)
            # ties broken by the feature flags that are on: the all-off variant (sm_90 only) does no work
            weight = (sum(v for v in consts.values() if isinstance(v, int) and not isinstance(v, bool)), warps,
                      sum(1 for v in consts.values() if v is True))
            key = (fn_name, arch, dt)
            if key not in heaviest or weight > heaviest[key][0]:
                heaviest[key] = (weight, job)
        flat = [job for _, job in heaviest.values()]
    t0 = time.time()
    with get_context("fork").Pool(procs) as pool:
        results = []
        for i, r in enumerate(pool.imap(_compile_one, flat, chunksize=2)):
            results.append(r)
            if i % 100 == 0:
                print(f"{i}/{len(flat)} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    print(json.dumps(dict(distinct_configs=len(jobs), compiles=len(flat), wall_s=round(time.time() - t0, 1),
                          results=results)))


# ---------------------------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------------------------

def _run_worker():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"compile worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(report):
    rows = {}
    for r in report["results"]:
        cell = rows.setdefault(r["kernel"], {}).setdefault(r["arch"], dict(n=0, ok=0, regs=0, shared=0, spill=0))
        cell["n"] += 1
        if r["ok"]:
            cell["ok"] += 1
            cell["regs"] = max(cell["regs"], r["regs"])
            cell["shared"] = max(cell["shared"], r["shared"])
            cell["spill"] += r["stack"] > 0
    lines = [f"portability: {report['distinct_configs']} distinct configs, {report['compiles']} compiles, "
             f"{report['wall_s']} s wall (cells: ok/compiled, max regs, max shared bytes, +spilling configs)",
             f"{'kernel':32s}" + "".join(f"{a:>26s}" for a in ARCH_NAMES)]
    for kernel in sorted(rows):
        cells = []
        for a in ARCH_NAMES:
            c = rows[kernel].get(a)
            if c is None:
                cells.append(f"{'-':>26s}")
                continue
            s = f"{c['ok']}/{c['n']} r{c['regs']} s{c['shared']}" + (f" sp{c['spill']}" if c["spill"] else "")
            cells.append(f"{s:>26s}")
        lines.append(f"{kernel:32s}" + "".join(cells))
    return "\n".join(lines)


def test_kernels_compile_within_limits_on_all_targets():
    import pytest
    try:
        import triton  # noqa: F401
        from swift_liger.ops import _targets
    except ImportError:
        pytest.skip("triton not installed")
    if not os.path.exists(_targets.cuobjdump_path()):
        pytest.skip("Triton's bundled cuobjdump is missing")
    report = _run_worker()
    print()
    print(_summary(report))
    failures, limit_errors, unexpected_ok, spills, seen_known = [], [], [], [], set()
    for r in report["results"]:
        tag = f"{r['kernel']} {r['arch']} {r['dtype']} warps={r['num_warps']} {r['consts']}"
        gap = UNSUPPORTED.get((r["kernel"], r["arch"], r["dtype"]))
        if gap is not None:
            if r["ok"]:
                unexpected_ok.append(tag)
            continue
        if not r["ok"]:
            failures.append(f"{tag}: {r['error']}")
            continue
        if r["violations"]:
            known = (r["kernel"], r["arch"], r["dtype"], r["consts"].get("D"))
            if known in KNOWN_OVER_LIMIT:
                seen_known.add(known)
                print(f"KNOWN over limit: {tag}: {'; '.join(r['violations'])}")
            else:
                limit_errors.append(f"{tag}: {'; '.join(r['violations'])}")
        if r["stack"] > 0:
            spills.append(f"{tag}: regs={r['regs']} stack={r['stack']}")
    if spills:
        print(f"WARNING: {len(spills)} configs spill registers to local memory (slower, still correct):")
        for s in spills[:40]:
            print("  " + s)
    assert not failures, f"{len(failures)} compile failures:\n" + "\n".join(failures[:30])
    assert not limit_errors, f"{len(limit_errors)} configs over an architecture limit:\n" + "\n".join(limit_errors[:30])
    if FULL:
        assert seen_known == KNOWN_OVER_LIMIT, \
            f"KNOWN_OVER_LIMIT entries now within limits: {KNOWN_OVER_LIMIT - seen_known}"
    assert not unexpected_ok, "UNSUPPORTED entries that now compile (remove them):\n" + "\n".join(unexpected_ok)


if __name__ == "__main__" and "--worker" in sys.argv:
    worker_main()
