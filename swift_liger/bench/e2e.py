"""End-to-end LoRA training throughput and memory on a random-init Llama-3-8B-shaped model (plain PyTorch loop).

    python -m swift_liger.bench.e2e --variant {plain,swift_liger,liger,compile,swift_liger+compile} [--layers 32]
    python -m swift_liger.bench.e2e --all --out docs/benchmarks       # each variant in its own process

Batch 1 x 8192 tokens, bf16, SDPA attention, gradient checkpointing, LoRA r=16 on every linear, AdamW.
Tokens/s over the measured steps (after warm-up) and peak allocated memory of the whole run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import swift_liger

from .harness import GiB, environment, header, last_json, run_child, tail, write_report
from .shapes import SHAPES, build_model as build, hf_config, train_ready

VARIANTS = ("plain", "liger", "compile", "swift_liger", "swift_liger+compile")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(layers: int, seq: int):
    return build(hf_config(SHAPES["llama3-8b"], layers=layers, max_positions=seq), device="cuda",
                 dtype=torch.bfloat16)


def run_variant(variant: str, layers: int, seq: int, steps: int, warmup: int) -> dict:
    model = build_model(layers, seq)
    if variant.startswith("swift_liger"):
        print(swift_liger.apply(model), flush=True)
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # lazy: optional peer, this variant only
        apply_liger_kernel_to_llama(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    model = train_ready(model, targets=LORA_TARGETS)
    if variant.endswith("compile"):
        # per-layer compile, as the fastest end-to-end peer does: each decoder layer compiled on its own
        for layer in model.base_model.model.model.layers:
            layer.compile(dynamic=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.item())
        print(f"{variant} step {step} loss {losses[-1]:.4f} {times[-1] * 1e3:.0f} ms", flush=True)
    measured = times[warmup:]
    return {"variant": variant, "layers": layers, "seq": seq, "steps": steps,
            "tokens_per_s": seq * len(measured) / sum(measured),
            "step_ms": 1e3 * sum(measured) / len(measured),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
            "losses": losses}


def to_markdown(env, args, results) -> str:
    base = next((r for r in results if r.get("variant") == "plain" and "tokens_per_s" in r), None)
    lines = header("End to end: Llama-3-8B-shaped LoRA, plain PyTorch loop", env, "triton", "transformers",
                   "liger_kernel", cuda=False) + [
             f"Random init, {args.layers} layers, batch 1 × {args.seq} tokens, bf16, SDPA, gradient checkpointing, "
             f"LoRA r=16 on all linears, AdamW; {args.warmup} warm-up + {args.steps} measured steps.", "",
             "| variant | tokens/s | vs plain | step ms | peak allocated GiB | peak reserved GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | failed: {r.get('error', '')[:120]} | | | | |")
            continue
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base else "—"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.0f} | {rel} | {r['step_ms']:.0f} | "
                     f"{r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    if args.variant:
        res = run_variant(args.variant, args.layers, args.seq, args.steps, args.warmup)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results = []
    for v in args.variants.split(","):
        child = run_child([sys.executable, "-m", "swift_liger.bench.e2e", "--variant", v, "--layers", str(args.layers),
                           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)])
        r = last_json(child.stdout, "RESULT ")
        if r is not None:
            results.append(r)
            print(f"{v:22s} {r['tokens_per_s']:8.0f} tok/s  {r['peak_allocated_gib']:6.2f} GiB", flush=True)
        else:
            err = tail(child.stderr or child.stdout, 3)
            results.append({"variant": v, "error": err})
            print(f"{v:22s} failed: {err}", flush=True)
    env = environment("python -m swift_liger.bench.e2e", argv)
    md = write_report(args.out, "e2e_llama3_8b_lora", {"environment": env, "results": results},
                      to_markdown(env, args, results))
    print(md)


if __name__ == "__main__":
    main()
