"""What is alive at the peak of a training step: replay PyTorch's CUDA allocator trace and group the live blocks at
the moment of maximum allocated memory by the Python frames that allocated them.

    python tools/mem_peak.py --variant swift_liger --layers 2 [--seq 8192] [--top 25]
    python tools/mem_peak.py --bench long_context --variant long_context --layers 2 --seq 256k [--tuner lora]

--bench e2e (default) runs the end-to-end LoRA loop of swift_liger.bench.e2e (warm-up step + one recorded step);
--bench long_context runs two steps of swift_liger.bench.long_context's point (variants plain / liger /
swift_liger / long_context; a MODELS shape, Llama-3-8B by default; --tuner lora / qlora / full), recorded from
before the model is built, so weights, gradients and the optimizer state (from the second step) are included.
Both record with torch.cuda.memory._record_memory_history, then print the peak and the largest groups of live
blocks. Offloaded checkpoints live in pinned host memory and are not in the trace.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from swift_liger.bench import e2e, long_context  # noqa: E402

MiB = 2 ** 20


def where(frames, depth):
    """The innermost `depth` frames outside torch's own Python (the code that asked for the memory)."""
    keep = []
    for f in frames:
        name = f.get("filename", "")
        if not name.endswith(".py") or ("/torch/" in name and "/torch/utils/checkpoint" not in name):
            continue
        keep.append(f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}")
        if len(keep) == depth:
            break
    return " <- ".join(keep) or "?"


def analyse(snapshot, top: int, depth: int):
    live, total, peak, peak_set, peak_frames = {}, 0, 0, {}, []
    for trace in snapshot["device_traces"]:
        for ev in trace:
            action, addr, size = ev["action"], ev["addr"], ev["size"]
            if action == "alloc":
                live[addr] = (size, ev.get("frames", []))
                total += size
                if total > peak:
                    peak, peak_set, peak_frames = total, dict(live), ev.get("frames", [])
            elif action in ("free_completed",) and addr in live:
                total -= live.pop(addr)[0]
    groups = collections.Counter()
    counts = collections.Counter()
    for size, frames in peak_set.values():
        key = where(frames, depth)
        groups[key] += size
        counts[key] += 1
    print(f"peak of traced allocations: {peak / MiB:.1f} MiB in {len(peak_set)} blocks "
          f"(allocations made before recording started are not included)")
    print(f"  reached by an allocation at: {where(peak_frames, 6)}")
    for key, size in groups.most_common(top):
        print(f"  {size / MiB:9.1f} MiB  x{counts[key]:<4d} {key}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="e2e", choices=("e2e", "long_context"))
    ap.add_argument("--variant", default="swift_liger")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", default="8192", help="tokens: 8192, 16k, 256k, 1m")
    ap.add_argument("--model", default="llama3-8b", help="long_context: a swift_liger.bench.long_context.MODELS key")
    ap.add_argument("--tuner", default="lora", help="long_context: lora, qlora or full")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()
    seq = long_context.parse_seq(args.seq)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    if args.bench == "e2e":
        result = e2e.run_variant(args.variant, args.layers, seq, steps=1, warmup=1)
    else:
        result = long_context.run_point(args.variant, seq, shape=long_context.MODELS[args.model], layers=args.layers,
                                        steps=1, warmup=1, tuner=args.tuner, device="cuda", dtype_name="bf16",
                                        mem_fraction=None, mem_cap_gib=None, tiled_mlp=8192)
        if result["status"] != "ok":
            print(f"{args.variant} {args.seq}: {result['status']} {result.get('error', '')}")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = result.get("peak_allocated_gib")
    print(f"{args.bench} {args.variant}, {args.layers} layers, seq {seq}: peak allocated "
          f"{peak if peak is None else round(peak, 3)} GiB, tokens/s {result.get('tokens_per_s')}")
    analyse(snapshot, args.top, args.depth)


if __name__ == "__main__":
    main()
