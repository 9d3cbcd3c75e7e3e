"""Eager decode host time per layer, variant by variant (issue 15: eager decode is host-bound).

    python3 tools/step_lab.py [--layers 4] [--steps 100] [--rounds 5] [--context 4352] [--batch 1]

A Llama-3-8B-shaped model with --layers layers (bf16, sdpa, random init) decodes greedily past a window of 4096 (+4
sinks for the rings). Variants: the stock model with transformers' dynamic sliding cache; with our kernels
(swift_liger.apply, loss head off); with our kernels and fused projections; and RollingKVCache with our kernels and
fused projections, the last also with every Triton launch through kernel[grid] (swift_liger.ops._launch off). At
--layers 4 the GPU work per step is ~0.6 ms and the step is the host's, so ms/step over
layers is each variant's host cost per layer. Rounds interleave the variants (ABCD ABCD ...) so that a slow
stretch of the shared host hits all of them; the median step of each round and the best round are reported.
A cProfile of each variant's steps (top functions by own time) follows. Writes step_lab.json.
"""
import argparse
import contextlib
import cProfile
import copy
import gc
import io
import json
import os
import pstats
import statistics
import time

import torch

import swift_liger
from swift_liger.bench import harness
from swift_liger.ops import _launch
from swift_liger.bench.rolling_cache import build_model, make_cache, model_config

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=4)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--context", type=int, default=4352)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--tiny", action="store_true", help="tiny model on CPU, window 64 (a logic check)")
args = p.parse_args()
cfg_args = argparse.Namespace(tiny=args.tiny, layers=args.layers, window=64 if args.tiny else 4096, sinks=4)
dev = torch.device("cpu" if args.tiny else "cuda")

VARIANTS = {   # name -> (patch kwargs or None, cache kind, launches through kernel[grid] instead of FastLaunch)
    "stock + hf_dynamic_sliding": (None, "hf_dynamic_sliding", False),
    "ours + hf_dynamic_sliding": (dict(fused_projections=False), "hf_dynamic_sliding", False),
    "ours+fused + hf_dynamic_sliding": (dict(fused_projections=True), "hf_dynamic_sliding", False),
    "ours+fused + rolling_absolute": (dict(fused_projections=True), "rolling_absolute", False),
    "ours+fused + rolling_absolute, kernel[grid] launches": (dict(fused_projections=True), "rolling_absolute", True),
}
base = build_model(model_config(cfg_args), dev, torch.float32 if args.tiny else torch.bfloat16)
models, states = {}, {}


def model_for(patch):
    key = None if patch is None else tuple(sorted(patch.items()))
    if key not in models:
        m = base if patch is None else copy.deepcopy(base)
        if patch is not None:
            swift_liger.apply(m, cross_entropy="off", **patch)
        models[key] = m
    return models[key]


@torch.no_grad()
def prefill(name):
    patch, kind, _ = VARIANTS[name]
    m = model_for(patch)
    cache = make_cache(kind, m, cfg_args)
    ids = torch.randint(2, 200, (args.batch, args.context), device=dev)
    for s in range(0, args.context, cfg_args.window):
        out = m(input_ids=ids[:, s:s + cfg_args.window], past_key_values=cache, use_cache=True, logits_to_keep=1)
    states[name] = [m, cache, out.logits[:, -1:].argmax(-1)]


@torch.no_grad()
def steps(name, n, prof=None):
    with _launch.plain_launches() if VARIANTS[name][2] else contextlib.nullcontext():
        return _steps(name, n, prof)


def _steps(name, n, prof=None):
    m, cache, tok = states[name]
    times = []
    gc.collect()
    if prof is not None:
        prof.enable()
    for _ in range(n):
        t0 = time.perf_counter()
        tok = m(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.disable()
    states[name][2] = tok
    return statistics.median(times) * 1e3


for name in VARIANTS:
    prefill(name)
    steps(name, 10)
rounds = {name: [] for name in VARIANTS}
for _ in range(args.rounds):
    for name in VARIANTS:
        rounds[name].append(steps(name, args.steps))
rows = []
stock = min(rounds["stock + hf_dynamic_sliding"])
for name, ms in rounds.items():
    best = min(ms)
    rows.append({"variant": name, "ms_per_step_rounds": [round(x, 3) for x in ms], "best_ms_per_step": round(best, 3),
                 "ms_per_layer": round(best / args.layers, 4), "speedup_vs_stock": round(stock / best, 3)})
    print(json.dumps(rows[-1]), flush=True)
profiles = {}
for name in VARIANTS:
    pr = cProfile.Profile()
    steps(name, 30, pr)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    profiles[name] = s.getvalue()[-4500:]
    print(name, profiles[name], flush=True)
harness.write_json(os.path.join(args.out, "step_lab.json"),
                   {"environment": harness.environment(), "settings": vars(args), "rows": rows, "profiles": profiles})
