"""CPU micro-benchmark of per-step decode host overhead: RollingKVCache vs transformers' caches.

Tiny random Llama (fp32, sdpa, 1 thread), so a step is almost all Python/dispatch work. Each cache is prefilled
past the window, then greedy decode steps are timed one by one (median and mean ms/step).

    .venv/bin/python tools/rolling_cache_host.py                    # model(...) loop, attention_mask=None
    .venv/bin/python tools/rolling_cache_host.py --mask             # also pass a 2D all-ones mask (generate-like)
    .venv/bin/python tools/rolling_cache_host.py --profile rolling_streaming   # cProfile of the decode loop
    .venv/bin/python tools/rolling_cache_host.py --torch-profile rolling_absolute
    .venv/bin/python tools/rolling_cache_host.py --count-ops     # torch calls / aten ops per decode step
    # A/B against another checkout: git archive HEAD swift_liger | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old .venv/bin/python tools/rolling_cache_host.py
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("SWIFT_LIGER_BACKEND", "torch")   # CPU: the PyTorch reference ring write

import torch  # noqa: E402

# Appended, so PYTHONPATH can point at another swift_liger checkout (A/B runs). For the same reason this script uses
# nothing of swift_liger.bench (an older checkout may not have it): its model and caches are built here.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig  # noqa: E402

from swift_liger.cache import RollingKVCache  # noqa: E402

KINDS = ("rolling_absolute", "rolling_streaming", "dynamic", "hf_dynamic_sliding")


def build_model(layers):
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, rope_theta=500000.0,
                      max_position_embeddings=1 << 20, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def make_cache(kind, model, window, sinks):
    if kind.startswith("rolling_"):
        return RollingKVCache(model, window=window, sinks=sinks, mode=kind[len("rolling_"):])
    if kind == "dynamic":
        return DynamicCache()
    cfg = copy.deepcopy(model.config)
    cfg.sliding_window = window      # same construction as swift_liger/bench/rolling_cache.py
    return DynamicCache(config=cfg)


@torch.no_grad()
def run(model, kind, args, steps, profiler=None, decode_only=False):
    """Prefill args.prefill tokens, then `steps` greedy decode steps; returns per-step seconds."""
    cache = make_cache(kind, model, args.window, args.sinks)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 256, (args.batch, args.prefill), generator=gen)
    mask = torch.ones_like(ids) if args.mask else None
    kw = {"attention_mask": mask} if args.mask else {}
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw)
    tok = out.logits[:, -1:].argmax(-1)
    if decode_only:
        _OpCount.on = _AtenCount.on = True
    times = []
    gc.collect()   # a full collection inside the timed loop would swamp one step
    if profiler is not None:
        profiler.__enter__()
    for _ in range(steps):
        if args.mask:
            mask = torch.cat((mask, mask.new_ones(args.batch, 1)), 1)
            kw = {"attention_mask": mask}
        t0 = time.perf_counter()
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True, **kw).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    _OpCount.on = _AtenCount.on = False
    return times


class _OpCount(torch.overrides.TorchFunctionMode):
    """Python-level torch calls (functions, methods, tensor attribute reads excluded) while `on`."""
    on = False

    def __init__(self):
        super().__init__()
        self.n, self.names = 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if _OpCount.on and name not in ("__get__", "__set__"):
            self.n += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def top(self, k=8):
        return ", ".join(f"{n}:{c // 10}" for n, c in sorted(self.names.items(), key=lambda x: -x[1])[:k])


class _AtenCount(torch.utils._python_dispatch.TorchDispatchMode):
    on = False

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _AtenCount.on:
            self.n += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=200)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="runs per kind; the best median is reported")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--mask", action="store_true", help="pass a 2D all-ones attention_mask each step")
    ap.add_argument("--profile", default=None, help="cProfile the decode loop of this kind")
    ap.add_argument("--torch-profile", default=None, help="torch.profiler table for this kind")
    ap.add_argument("--count-ops", action="store_true", help="torch API calls and aten ops per decode step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.layers)
    if args.profile or args.torch_profile:
        kind = args.profile or args.torch_profile
        run(model, kind, args, 20)   # warm-up
        if args.profile:
            prof = cProfile.Profile()
            run(model, kind, args, args.steps, prof)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        else:
            prof = profile(activities=[ProfilerActivity.CPU])
            run(model, kind, args, args.steps, prof)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if args.count_ops:
        for k in kinds:
            run(model, k, args, 5)
            fn, at = _OpCount(), _AtenCount()
            with fn, at:
                run(model, k, args, 10, decode_only=True)
            print(f"  {k:20s} {fn.n / 10:6.1f} torch calls/step  {at.n / 10:6.1f} aten ops/step  "
                  f"top: {fn.top()}")
        return
    for k in kinds:
        run(model, k, args, 20)   # warm-up (lazy imports, first-call paths)
    results = {k: [] for k in kinds}
    for _ in range(args.repeats):     # interleaved, so load changes hit every kind alike
        for k in kinds:
            results[k].append(run(model, k, args, args.steps))
    print(f"layers {args.layers}, batch {args.batch}, window {args.window} + {args.sinks} sinks, prefill "
          f"{args.prefill}, {args.steps} decode steps, mask={'ones' if args.mask else 'None'}, "
          f"torch {torch.__version__}, 1 thread")
    base = {}
    for k in kinds:
        med = min(statistics.median(t) for t in results[k]) * 1e3
        mean = min(statistics.fmean(t) for t in results[k]) * 1e3
        base[k] = med
        print(f"  {k:20s} median {med:7.3f} ms/step   mean {mean:7.3f} ms/step")
    if "hf_dynamic_sliding" in base:
        for k in kinds:
            if k.startswith("rolling_"):
                print(f"  {k}: {base['hf_dynamic_sliding'] / base[k]:.2f}x vs hf_dynamic_sliding, "
                      f"{base.get('dynamic', float('nan')) / base[k]:.2f}x vs dynamic")


if __name__ == "__main__":
    main()
