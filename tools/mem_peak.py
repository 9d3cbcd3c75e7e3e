"""What is alive at the peak of a training step: replay PyTorch's CUDA allocator trace and group the live blocks at
the moment of maximum allocated memory by the Python frames that allocated them.

    python tools/mem_peak.py --variant swift_liger --layers 2 [--seq 8192] [--top 25]

Runs the end-to-end LoRA loop of swift_liger.bench.e2e (warm-up step + one recorded step) with
torch.cuda.memory._record_memory_history, then prints the peak and the largest groups of live blocks.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
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
    live, total, peak, peak_set = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for ev in trace:
            action, addr, size = ev["action"], ev["addr"], ev["size"]
            if action == "alloc":
                live[addr] = (size, ev.get("frames", []))
                total += size
                if total > peak:
                    peak, peak_set = total, dict(live)
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
    for key, size in groups.most_common(top):
        print(f"  {size / MiB:9.1f} MiB  x{counts[key]:<4d} {key}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="swift_liger")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()
    from swift_liger.bench import e2e
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    result = e2e.run_variant(args.variant, args.layers, args.seq, steps=1, warmup=1)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"{args.variant}, {args.layers} layers, seq {args.seq}: peak allocated "
          f"{result['peak_allocated_gib']:.3f} GiB")
    analyse(snapshot, args.top, args.depth)


if __name__ == "__main__":
    main()
