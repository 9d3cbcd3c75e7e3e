"""`make demo`: the real `swift sft` CLI on a tiny offline model, without and with `--use_liger`, side by side.

    python -m swift_liger.demo [--workdir runs/demo] [--steps 10] [--triton] [--arch qwen3|llama]

Builds a deterministic tiny random model + ChatML tokenizer + toy SFT data (no network, seconds), runs two LoRA
fine-tunings with identical settings (fp32), then prints loss, tokens/s and memory per step for both runs, whether
the losses agree, what was patched, and writes a plot (swift-liger plot).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .plot import find_log, memory_key, plot_runs, read_steps
from .testing import tiny

LOSS_TOL = 1e-4  # fp32; the per-step losses of a correct patch agree to ~1e-6 on this model


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def swift_command(info: dict, output_dir: str, steps: int, use_liger: bool, small: bool = False) -> list:
    # small: batch 1 x 64 tokens, for the Triton interpreter (~1 ms per program, one program per token and op)
    batch, max_length = ("1", "64") if small else ("4", "128")
    cmd = [sys.executable, "-m", "swift.cli.main", "sft", *info["swift_flags"], "--dataset", info["sft"],
           "--tuner_type", "lora", "--lora_rank", "8", "--torch_dtype", "float32", "--fp16", "false",
           "--bf16", "false", "--check_model", "false", "--gradient_accumulation_steps", "1",
           "--dataloader_num_workers", "0", "--dataset_num_proc", "1", "--max_steps", str(steps),
           "--logging_steps", "1", "--max_length", max_length, "--per_device_train_batch_size", batch,
           "--learning_rate", "2e-3", "--save_strategy", "no", "--report_to", "tensorboard", "--seed", "42",
           "--output_dir", output_dir]
    if use_liger:
        cmd.append("--use_liger")
    return cmd


def offline_env(triton: bool) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("SWIFT_LIGER_DISABLE_HOOK", None)
    if triton:
        env.update(TRITON_INTERPRET="1", SWIFT_LIGER_BACKEND="triton")
    return env


def run_swift(cmd, env, log_path) -> float:
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"swift sft failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    return time.time() - t0


def _fmt(value, spec):
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def compare_table(stock, liger) -> tuple:
    """Rows of text and the max |loss difference| over the common steps."""
    mem_s, mem_l = memory_key(stock), memory_key(liger)
    by_step = {r["step"]: r for r in liger}
    lines = [f"{'step':>4} | {'loss stock':>11} {'loss liger':>11} {'|diff|':>8} | {'tok/s stock':>11} "
             f"{'tok/s liger':>11} | {'mem stock':>9} {'mem liger':>9}"]
    lines.append("-" * len(lines[0]))
    worst = 0.0
    for r in stock:
        q = by_step.get(r["step"])
        if q is None:
            continue
        diff = abs(r["loss"] - q["loss"])
        worst = max(worst, diff)
        lines.append(f"{r['step']:>4} | {r['loss']:>11.6f} {q['loss']:>11.6f} {diff:>8.1e} | "
                     f"{_fmt(r.get('tokens/s'), '11.1f'):>11} {_fmt(q.get('tokens/s'), '11.1f'):>11} | "
                     f"{_fmt(r.get(mem_s), '9.3f'):>9} {_fmt(q.get(mem_l), '9.3f'):>9}")
    return lines, worst, (mem_s, mem_l)


def patched_fusions(record: dict) -> dict:
    """What liger_patch.json says was patched in the policy model, fusions patched 0 times left out."""
    return {k: v for k, v in (record["models"]["policy"]["report"].get("patched") or {}).items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swift_liger.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "demo"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--arch", default="qwen3", choices=("qwen3", "llama"))
    ap.add_argument("--triton", action="store_true",
                    help="on CPU, run the real Triton kernels in Triton's interpreter instead of the PyTorch "
                         "reference implementations (minutes: batch 1 x 64 tokens, several seconds per step)")
    args = ap.parse_args(argv)

    workdir = os.path.abspath(args.workdir)
    cuda = _cuda_available()
    if cuda:
        backend = "CUDA: the patched run uses the compiled Triton kernels."
    elif args.triton:
        backend = ("CPU with --triton: TRITON_INTERPRET=1 SWIFT_LIGER_BACKEND=triton, so the patched run executes "
                   "the real Triton kernels in Triton's interpreter (correctness, not speed: several seconds per "
                   "step, so both runs use batch 1 x 64 tokens).")
    else:
        backend = ("CPU: the patched run uses each kernel's PyTorch reference implementation (SWIFT_LIGER_BACKEND "
                   "auto), which keeps the demo fast; the patching, flags, fused-linear loss path and metrics are "
                   "the real ones. `--triton` runs the Triton kernels in the interpreter instead (what the "
                   "integration tests do). CPU tokens/s compare the reference code, not the kernels.")
    print(f"swift_liger demo: {backend}")

    t0 = time.time()
    info = tiny.build(os.path.join(workdir, f"tiny-{args.arch}"), args.arch)
    print(f"tiny {args.arch} model + data ready in {time.time() - t0:.1f}s: {info['model']}")

    env = offline_env(args.triton and not cuda)
    runs = {}
    for name, use_liger in (("stock", False), ("liger", True)):
        out = os.path.join(workdir, name)
        cmd = swift_command(info, out, args.steps, use_liger, small=args.triton and not cuda)
        print(f"\n$ swift sft ... --max_steps {args.steps}{' --use_liger' if use_liger else ''}   "
              f"(log: {out}.log)", flush=True)
        seconds = run_swift(cmd, env, out + ".log")
        runs[name] = out
        print(f"  done in {seconds:.1f}s (incl. ~8s ms-swift start-up)")

    stock, liger = read_steps(runs["stock"]), read_steps(runs["liger"])
    lines, worst, (mem_s, mem_l) = compare_table(stock, liger)
    print(f"\nper step (memory columns: stock {mem_s or 'n/a'}, liger {mem_l or 'n/a'}; on CPU rss = process "
          "resident memory, not a CUDA peak):")
    print("\n".join(lines))
    agree = len(stock) == len(liger) == args.steps and worst <= LOSS_TOL
    print(f"\nlosses {'AGREE' if agree else 'DIFFER'}: max |diff| = {worst:.2e} over {len(stock)} steps "
          f"(tolerance {LOSS_TOL:g})")

    patch_file = os.path.join(os.path.dirname(find_log(runs["liger"])), "liger_patch.json")
    if os.path.exists(patch_file):
        with open(patch_file) as f:
            record = json.load(f)
        patched = patched_fusions(record)
        print(f"patched ({patch_file}): {patched}")
        print("note: cross_entropy=fused_linear returns no logits in training; token_acc comes from the fused head's "
              "arg max")
    with open(runs["liger"] + ".log", errors="replace") as f:   # what ran, counted (integration/runtime.py)
        for line in (ln.split("swift_liger: ", 1)[1].strip() for ln in f
                     if "swift_liger: " in ln and "in the first step" in ln):
            print(line)
    try:
        # on CPU the patched run executes reference code or the interpreter: its tokens/s ratio is not a speed-up
        png = plot_runs([runs["stock"], runs["liger"]], os.path.join(workdir, "demo.png"), speed_ratio=cuda)
        print(f"plot: {png}   (swift-liger plot {runs['stock']} {runs['liger']} -o out.png)")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"total {time.time() - t0:.1f}s")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
