"""Where a training step's time goes (issue 27): host vs device, launches, host time per layer pass, per variant.

    python3 tools/train_lab.py --shape qwen2.5-1.5b --tokens 1x2048,4x2048 [--layers N] [--rounds 5] [--steps 4]
    python3 tools/train_lab.py --tiny          # CPU logic check: a 2-layer model, every variant, one round
    python3 tools/train_lab.py report A/train_lab.json B/train_lab.json > out.md

The loop is the one ms-swift's Trainer runs for `swift sft --tuner_type lora` (its defaults): a bf16 model under bf16
autocast, PEFT LoRA r16/alpha32/dropout 0.05 on every linear (fp32 adapters, PEFT's default), gradient checkpointing
(reentrant, as ms-swift sets it on one GPU; --reentrant 0 for the other), AdamW (foreach) on the adapters, labels = input ids. Random init at the shape's widths; --layers
shortens the stack (per-layer numbers do not change; the head stays). Variants, in one process:

- stock: transformers + PEFT as they are;
- ours: ``swift_liger.apply`` (every default fusion: graph_layers replays the decoder layers as CUDA graphs), then PEFT;
- ours_eager: the same with graph_layers off;
- ours_mask_bits: the same with LoRA dropout drawn by torch.native_dropout and kept as bits (the path before
  ops/lora_dropout_kernel.py's seeded products);
- ours_no_base_epilogue / ours_base_epilogue: the same with ops.lora_linear_op.BASE_EPILOGUE off / on (on, the
  default: the LoRA output first, the base GEMM adding into it in its epilogue);
- ours_no_lora: the same with lora_fusion off;
- ours_compiled: compile_layers on (first step reported apart);
- ours_compiled_aot, ours_compiled_dynamo: compile_layers through torch.compile's "aot_eager" backend (dynamo and
  AOTAutograd trace one graph per layer pass, run eagerly: no inductor code generation) or "eager" (dynamo only);
- ours_compiled_grad: the same as ours_compiled, but each layer's autograd-off forward (a reentrant checkpoint's first pass) runs
  eager, so one graph per layer class compiles instead of two (lab only);
- liger: Liger-Kernel's instance patch (what `--use_liger_kernel` runs), measured last beside ``ours`` again,
  because it also replaces module-level functions of transformers that the stock model would then use.

Rounds interleave the variants (ABC ABC ...) so that the shared host's slow stretches hit all of them: per step
the wall time (synchronized), the host time to issue forward and backward+optimizer (no synchronization), and the
peak allocation above what is resident before the steps (all variants' models and optimizer states; in the JSON
of runs before this change, peak_alloc_gib is the whole allocation); medians over rounds of each round's median step, with min-max. One profiled step per variant counts
kernel launches and sums device kernel time (torch.profiler); a cProfile of one step lists the top Python functions
by own time. Per decoder layer: launches and host µs of forward, backward and recompute are measured on the first
layer alone (hooks mark its start and end). Writes train_lab.json (+ .md) under --out.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import swift_liger  # noqa: E402
from swift_liger.bench.harness import GiB, command, environment, sync, write_json  # noqa: E402
from swift_liger.bench.shapes import SHAPES, build_model, hf_config, train_ready  # noqa: E402
from swift_liger.integration import compile_watch  # noqa: E402
from swift_liger.ops import lora_dropout_kernel, lora_linear_op  # noqa: E402
from swift_liger.integration.compile_watch import CompileWatch  # noqa: E402

PHASE1 = ("stock", "ours", "ours_no_lora")


def build(shape: str, layers: int, device, dtype):
    return build_model(hf_config(SHAPES[shape], layers=layers or None, max_positions=32768), device=device,
                       dtype=dtype)


COMPILE_BACKENDS = {"ours_compiled_aot": "aot_eager", "ours_compiled_dynamo": "eager"}
REENTRANT = True   # ms-swift's choice on one GPU (trainers/mixin.py _fix_gradient_checkpointing); --reentrant 0
DROPOUT = 0.05     # ms-swift's default lora_dropout; --dropout


def make_variant(base, name: str):
    model = copy.deepcopy(base)
    if name.startswith("ours"):
        kw = {}
        if name == "ours_no_lora":
            kw["lora_fusion"] = False
        if name == "ours_eager":
            kw["graph_layers"] = False
        if name.startswith("ours_compiled"):
            kw["compile_layers"] = True
        swift_liger.apply(model, **kw)
    elif name == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance  # lazy: optional peer, liger only
        _apply_liger_kernel_to_instance(model=model)
    model = train_ready(model, dropout=DROPOUT, reentrant=REENTRANT, seed=1)   # the same adapters for every variant
    if name in COMPILE_BACKENDS:   # the same layers through another torch.compile backend
        for layer in model.modules():
            if layer.__dict__.get("_compiled_call_impl") is not None:
                layer.__dict__["_compiled_call_impl"] = torch.compile(layer._call_impl,
                                                                      backend=COMPILE_BACKENDS[name])
    if name == "ours_compiled_grad":   # a reentrant checkpoint's first pass (autograd off) runs eager: one graph
        for layer in model.modules():  # to compile (recompute + backward) instead of two
            compiled = layer.__dict__.get("_compiled_call_impl")
            if compiled is not None:
                layer.__dict__["_compiled_call_impl"] = (
                    lambda *a, _c=compiled, _e=layer._call_impl, **k: _c(*a, **k) if torch.is_grad_enabled()
                    else _e(*a, **k))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    return model, opt


DEFAULT_BASE_EPILOGUE = lora_linear_op.BASE_EPILOGUE   # the module's (its env var's) choice


class Runner:
    def __init__(self, model, opt, batches, dev, seeded_dropout=True, base_epilogue=DEFAULT_BASE_EPILOGUE):
        self.model, self.opt, self.batches, self.dev = model, opt, batches, dev
        self.losses = []
        self.seeded_dropout = seeded_dropout   # False: LoRA dropout masks kept as bits (ours_mask_bits)
        self.base_epilogue = base_epilogue     # lora_linear_op.BASE_EPILOGUE during this runner's steps

    def step(self, i: int):
        lora_dropout_kernel.ENABLED = self.seeded_dropout
        lora_linear_op.BASE_EPILOGUE = self.base_epilogue
        try:
            return self._step(i)
        finally:
            lora_dropout_kernel.ENABLED = True
            lora_linear_op.BASE_EPILOGUE = DEFAULT_BASE_EPILOGUE

    def _step(self, i: int):
        ids = self.batches[i % len(self.batches)]
        sync(self.dev)
        t0 = time.perf_counter()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16):
            out = self.model(input_ids=ids, labels=ids)
        t1 = time.perf_counter()
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        sync(self.dev)
        t3 = time.perf_counter()
        self.losses.append(out.loss.detach())
        return {"wall_ms": (t3 - t0) * 1e3, "fwd_host_ms": (t1 - t0) * 1e3, "bwd_host_ms": (t2 - t1) * 1e3}


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def profile_step(runner: Runner, i: int) -> dict:
    """Kernel launches and device kernel time of one step (torch.profiler), and the same for the first decoder layer's
    forward, backward and recompute (marked by hooks on that layer)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.dev.type == "cuda" else [])
    layer = _first_layer(runner.model)
    marks = []

    def pre(mod, args):
        marks.append(record_function("lab::layer0_fwd" if torch.is_grad_enabled() else "lab::layer0_nograd"))
        marks[-1].__enter__()

    def post(mod, args, out):
        if marks:
            marks.pop().__exit__(None, None, None)
    h1, h2 = layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)
    try:
        with profile(activities=acts) as prof:
            runner.step(i)
    finally:
        h1.remove(), h2.remove()
    events = prof.events()
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                "cuLaunchKernelEx", "cudaGraphLaunch")]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("lab::")]   # our record_function ranges get a GPU-side row too
    layer_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("lab::layer0")]
    in_layer = sum(1 for e in launches if any(a <= e.time_range.start <= b for a, b in layer_ranges))
    by_name = {}
    for e in kernels:
        n, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, us + e.time_range.elapsed_us())
    groups = {}
    for name, (n, us) in by_name.items():
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + us / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {"launches_per_step": len(launches), "device_kernel_ms": sum(e.time_range.elapsed_us() for e in kernels)
            / 1e3, "layer0_forward_launches_incl_recompute": in_layer, "layer0_passes_marked": len(layer_ranges),
            "kernel_groups_ms": {g: round(v, 3) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"kernel": k[:160], "calls": n, "ms": round(us / 1e3, 3)} for k, (n, us) in top]}


def kernel_group(name: str) -> str:
    """A device kernel's kind, from its name: attention (cuDNN, flash, efficient), GEMMs (cuBLAS / CUTLASS / nvjet),
    Triton kernels (ours and Liger-Kernel's: names starting with "_" or "triton"), copies and casts, reductions,
    other aten kernels."""
    n = name.lower()
    if any(k in n for k in ("fmha", "flash", "cudnn", "attention", "attn", "sdpa")):   # before gemm: cuDNN's names
        return "attention"                                                            # carry sm90 too
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")):
        return "gemm"
    if n.startswith("_") or n.startswith("triton"):
        return "triton"
    if any(k in n for k in ("copy", "cast", "cat", "fill")):
        return "copy/fill"
    if "reduce" in n or "norm" in n:
        return "reduction"
    return "other aten"


def _first_layer(model):
    m = model
    for name in ("base_model", "model", "model", "layers"):
        m = getattr(m, name, m)
    return m[0]


def layer_host_us(runner: Runner, reps: int) -> dict:
    """Host µs of one decoder layer: forward with grad (training forward), no-grad forward and its recompute, and
    backward, on the first layer alone with the hidden states a real step gives it. Device work overlaps only where the
    host is faster; on small shapes this is the host cost."""
    model, dev = runner.model, runner.dev
    layer = _first_layer(model)
    inner = model.base_model.model.model
    ids = runner.batches[0]
    with torch.autocast(dev.type, dtype=torch.bfloat16), torch.no_grad():
        h = inner.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=dev)[None].expand(ids.shape[0], -1)
        pe = inner.rotary_emb(h, pos)
    h = h.detach().requires_grad_(True)
    g = torch.randn_like(h)
    res = {"fwd": [], "bwd": []}
    for _ in range(reps):
        sync(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            t0 = time.perf_counter()
            out = layer(h, position_embeddings=pe, position_ids=pos)
            t1 = time.perf_counter()
        out = out[0] if isinstance(out, tuple) else out
        sync(dev)
        t2 = time.perf_counter()
        out.backward(g)
        t3 = time.perf_counter()
        sync(dev)
        res["fwd"].append((t1 - t0) * 1e6)
        res["bwd"].append((t3 - t2) * 1e6)
        h.grad = None
        for p in layer.parameters():
            p.grad = None
    return {k: med(v) for k, v in res.items()}


def sync_calls(runner: Runner, i: int) -> dict:
    """Synchronizing CUDA calls during one step (torch.cuda.set_sync_debug_mode), counted per source line."""
    if runner.dev.type != "cuda":
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            runner.step(i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            k = f"{os.path.relpath(w.filename) if 'swift_liger' in w.filename else os.path.basename(w.filename)}:{w.lineno}"
            where[k] = where.get(k, 0) + 1
    return where


def cprofile_top(runner: Runner, i: int, top: int) -> list:
    pr = cProfile.Profile()
    pr.enable()
    runner.step(i)
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((tt, nc, f"{os.path.basename(fn)}:{line}({name})"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return [{"own_ms": round(tt * 1e3, 3), "calls": nc, "function": f} for tt, nc, f in rows[:top]] + \
        [{"own_ms": round(total * 1e3, 3), "calls": 0, "function": "TOTAL (under cProfile)"}]


def run_shape(shape, tokens, args, dev):
    b, s = tokens
    base = build(shape, args.layers, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    vocab = base.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [s, s - args.vary] if args.vary else [s, s]   # --vary: two row lengths, as real SFT batches differ
    batches = [torch.randint(0, vocab, (b, n), generator=g).to(dev) for n in lengths]
    variants = [v for v in args.variants.split(",") if v]
    rows = {}
    phase1 = [v for v in variants if v != "liger"]
    runners = {}
    for v in phase1:
        runners[v] = Runner(*make_variant(base, v), batches, dev, seeded_dropout=v != "ours_mask_bits",
                            base_epilogue={"ours_base_epilogue": True, "ours_no_base_epilogue": False}.get(
                                v, DEFAULT_BASE_EPILOGUE))
    res = _measure(runners, args, dev, rows, "phase1")
    if "liger" in variants:
        for v in list(runners):
            if v != "ours":
                del runners[v]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        try:
            runners = {"liger": Runner(*make_variant(base, "liger"), batches, dev), "ours": runners["ours"]}
            _measure(runners, args, dev, rows, "phase2")
        except Exception as exc:   # no liger-kernel installed, or it refuses the model
            rows["liger"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    del base
    return res, rows


def parity(shape, tokens, args, dev):
    """--parity N: the same weights, the same non-zero adapters (lora_B drawn from one seed, so the LoRA branch counts
    from the first step) and the same batches for every variant, N optimizer steps each: per step the loss and the
    adapters' gradient norm, and the first step's gradients against the first variant's (relative L2)."""
    b, s = tokens
    base = build(shape, args.layers, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [s, s - args.vary] if args.vary else [s]
    batches = [torch.randint(0, base.config.vocab_size, (b, n), generator=g).to(dev) for n in lengths]
    rows, ref = {}, None
    for v in [v for v in args.variants.split(",") if v]:
        model, opt = make_variant(base, v)
        gen = torch.Generator(device="cpu").manual_seed(7)
        trainable = [(n, p) for n, p in sorted(model.named_parameters()) if p.requires_grad]
        with torch.no_grad():
            for n, p in trainable:
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        losses, norms, t_ms = [], [], []
        for i in range(args.parity):
            torch.manual_seed(1000 + i)
            ids = batches[i % len(batches)]
            sync(dev)
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            sync(dev)
            t_ms.append((time.perf_counter() - t0) * 1e3)
            if i == 0:
                grads = torch.cat([p.grad.detach().float().flatten().cpu() for _, p in trainable])
                if ref is None:
                    ref, rel = grads, 0.0
                else:
                    rel = float((grads - ref).norm() / ref.norm())
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in trainable], 1e9)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
        rows[v] = {"loss": losses, "grad_norm": norms, "step_ms": t_ms, "first_grads_rel_l2": rel}
        counts = swift_liger.call_counts(model) or {}
        if counts.get("graph_layers"):
            rows[v]["graph_layers"] = counts["graph_layers"]
        print(f"{v:22s} first-step grads rel {rel:.2e}  loss " + " ".join(f"{x:.5f}" for x in losses)
              + "  grad_norm " + " ".join(f"{x:.4f}" for x in norms)
              + "  step ms " + " ".join(f"{x:.0f}" for x in t_ms) + f"  {rows[v].get('graph_layers', '')}",
              flush=True)
        del model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(runners, args, dev, rows, phase):
    first, warm = {}, {}
    for v, r in runners.items():     # first steps (compile, autotune, allocator growth), reported apart
        swift_liger.call_counts(r.model, reset=True)   # phase 2 steps a runner of phase 1 again: count this step
        watch = CompileWatch()
        watch.start()
        t0 = time.perf_counter()
        try:
            r.step(0)
            sync(dev)
        finally:
            watch.stop()
        first[v] = (time.perf_counter() - t0) * 1e3
        compiles = watch.summary()
        if compiles:   # Triton kernels built (cold cache) or loaded (warm) in the first step
            rows.setdefault("_triton_first_step", {})[v] = compiles
            print(f"{v}: {compile_watch.describe(compiles)}", flush=True)
        gl = (swift_liger.call_counts(r.model) or {}).get("graph_layers")
        if gl:   # the first step's graph_layers work: captures, their host seconds by part, the timings
            rows.setdefault("_graph_layers_first_step", {})[v] = gl
            print(f"{v}: first step {first[v]:.0f} ms; graph_layers {gl['captures']} captures {gl['capture_s']:.2f} s "
                  f"{gl.get('capture_parts_s')} measured {gl['measured']}", flush=True)
        warm[v] = [r.step(i + 1)["wall_ms"] for i in range(args.warmup)]   # --vary: step 1 is the 2nd length's 1st
    per = {v: {"wall": [], "fwd_host": [], "bwd_host": [], "peak": []} for v in runners}
    for rnd in range(args.rounds):
        order = list(runners)
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        for v in order:
            r = runners[v]
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()   # every variant's model and optimizer state
            steps = [r.step(i) for i in range(args.steps)]
            per[v]["wall"].append(med([x["wall_ms"] for x in steps]))
            per[v]["fwd_host"].append(med([x["fwd_host_ms"] for x in steps]))
            per[v]["bwd_host"].append(med([x["bwd_host_ms"] for x in steps]))
            if dev.type == "cuda":
                per[v]["peak"].append((torch.cuda.max_memory_allocated() - resident) / GiB)
    for v, r in runners.items():
        d = per[v]
        row = {"phase": phase, "first_step_ms": first[v], "warmup_ms": warm[v], "wall_ms": med(d["wall"]),
               "wall_ms_min": min(d["wall"]), "wall_ms_max": max(d["wall"]),
               "fwd_host_ms": med(d["fwd_host"]), "bwd_opt_host_ms": med(d["bwd_host"]),
               "step_peak_gib": max(d["peak"]) if d["peak"] else None,
               "loss_first": float(r.losses[0])}
        if not args.no_profile:
            row.update(profile_step(r, 0))
            row["layer0_host_us"] = layer_host_us(r, 5)
            row["sync_calls"] = sync_calls(r, 0)
            row["cprofile_top"] = cprofile_top(r, 0, args.top)
        key = v if phase == "phase1" or v == "liger" else f"{v} (beside liger)"
        rows[key] = row
        line = (f"{key:22s} wall {row['wall_ms']:8.2f} ms [{row['wall_ms_min']:.2f}-{row['wall_ms_max']:.2f}]  "
                f"host fwd {row['fwd_host_ms']:7.2f} bwd+opt {row['bwd_opt_host_ms']:7.2f}  first {first[v]:8.0f} ms  "
                f"warm-up {' '.join(f'{x:.0f}' for x in warm[v])} ms")
        if "launches_per_step" in row:
            line += (f"  launches {row['launches_per_step']}  device {row['device_kernel_ms']:.2f} ms  layer0 fwd "
                     f"{row['layer0_host_us']['fwd']:.0f} us bwd {row['layer0_host_us']['bwd']:.0f} us  syncs {sum(row['sync_calls'].values())}")
        print(line, flush=True)
    return rows


def report(paths, title: str) -> str:
    """Markdown tables from train_lab.json files (one section per file and case)."""
    lines = [f"# {title}", ""]
    for path in paths:
        d = json.load(open(path))
        env = d["environment"]
        lines += [f"`{d['command']}` · {env.get('gpu')} · torch {env.get('torch')} · triton {env.get('triton')} · "
                  f"transformers {env.get('transformers')} · {env.get('date')}", ""]
        for case in d["cases"]:
            rows = case["rows"]
            tok = case["batch"] * case["seq"]
            lines += [f"**{case['shape']}**, {case['layers']} layers, batch {case['batch']} x {case['seq']}", "",
                      "| variant | step ms (min-max of rounds) | tok/s | vs stock | host fwd ms | host bwd+opt ms | "
                      "device kernels ms | launches/step | syncs/step | step peak GiB |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            stock = rows.get("stock", {}).get("wall_ms")
            for name, r in rows.items():
                if name.startswith("_"):   # not a variant: e.g. the first step's graph_layers counters
                    continue
                if "wall_ms" not in r:
                    lines.append(f"| {name} | {r.get('error', '')[:100]} | | | | | | | | |")
                    continue
                vs = f"{stock / r['wall_ms']:.2f}" if stock else ""
                dev = f"{r['device_kernel_ms']:.1f}" if "device_kernel_ms" in r else ""
                syncs = sum(r.get("sync_calls", {}).values()) if "sync_calls" in r else ""
                peak = r.get("step_peak_gib", r.get("peak_alloc_gib"))
                peak = f"{peak:.2f}" if peak is not None else ""
                lines.append(f"| {name} | {r['wall_ms']:.1f} ({r['wall_ms_min']:.1f}-{r['wall_ms_max']:.1f}) | "
                             f"{tok / r['wall_ms'] * 1e3:.0f} | {vs} | {r['fwd_host_ms']:.1f} | "
                             f"{r['bwd_opt_host_ms']:.1f} | {dev} | {r.get('launches_per_step', '')} | {syncs} | {peak} |")
            lines.append("")
            kinds = [k for k in ("gemm", "attention", "triton", "copy/fill", "reduction", "other aten")
                     if any(k in r.get("kernel_groups_ms", {}) for r in rows.values())]
            if kinds:
                lines += ["Device kernel ms per step by kind (one profiled step):", "",
                          "| variant | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
                for name, r in rows.items():
                    g = None if name.startswith("_") else r.get("kernel_groups_ms")
                    if g:
                        lines.append(f"| {name} | " + " | ".join(f"{g.get(k, 0):.1f}" for k in kinds) + " |")
                lines.append("")
    return "\n".join(lines)


def main():
    if sys.argv[1:2] == ["report"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        ap.add_argument("json", nargs="+")
        ap.add_argument("--title", default="Training step: host and device time per variant")
        a = ap.parse_args()
        print(report(a.json, a.title))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-1.5b", help=", ".join(SHAPES) + " (comma-separated for several)")
    p.add_argument("--tokens", default="1x2048", help="BxS per micro-batch, comma-separated")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    p.add_argument("--variants", default="stock,ours,ours_no_lora,liger")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU logic check")
    p.add_argument("--vary", type=int, default=0, help="odd batches are this many tokens shorter per row (0: all "
                   "the same length)")
    p.add_argument("--reentrant", type=int, default=1, help="gradient checkpointing's use_reentrant (1: ms-swift's)")
    p.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (0.05: ms-swift's default)")
    p.add_argument("--parity", type=int, default=0, help="instead of timing: N steps per variant on the same weights "
                   "and non-zero adapters, losses, gradient norms and first-step gradients compared")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dev = torch.device("cpu" if args.tiny else "cuda")
    global REENTRANT, DROPOUT
    REENTRANT, DROPOUT = bool(args.reentrant), args.dropout
    if args.tiny:
        args.shape, args.tokens, args.rounds, args.steps, args.warmup = "tiny", "2x16", 1, 1, 0
        args.variants = ",".join(v for v in args.variants.split(",") if v != "liger")
    shortest = min(int(tok.split("x")[1]) for tok in args.tokens.split(","))
    if not 0 <= args.vary < shortest:
        p.error(f"--vary must be in [0, {shortest}) (the shortest row of --tokens), got {args.vary}")
    prog = "python3 tools/train_lab.py"
    out = {"environment": environment(prog), "command": command(prog), "cases": []}
    for shape in args.shape.split(","):
        for tok in args.tokens.split(","):
            b, s = (int(x) for x in tok.split("x"))
            print(f"== {shape} {b}x{s} layers={args.layers or SHAPES[shape].layers}", flush=True)
            try:
                rows = parity(shape, (b, s), args, dev) if args.parity else run_shape(shape, (b, s), args, dev)[1]
            except torch.cuda.OutOfMemoryError as exc:
                rows = {"error": f"OOM: {exc}"[:200]}
                print(rows, flush=True)
            out["cases"].append({"shape": shape, "batch": b, "seq": s, "layers": args.layers or SHAPES[shape].layers,
                                 "rows": rows})
            write_json(os.path.join(args.out, "train_lab.json"), out)
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
