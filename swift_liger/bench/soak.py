"""A long `swift sft --use_liger` run and a patched-vs-stock parity run, read back from their logging.jsonl.

    python -m swift_liger.bench.soak SOAK_DIR STOCK_DIR LIGER_DIR --out DIR [--window 20] [--name soak]

soak: every logged loss finite, allocated memory at the end of the first logged step at or after step 100 against
the last one (`alloc(GiB)`, our metric: torch.cuda.memory_allocated() at the step end), peak per interval.
parity: per-step losses of the two runs, smoothed with a centred moving average of --window steps; the largest
relative difference of the smoothed curves, and the raw one. Writes <name>.json, <name>_parity.png (both
parity curves) and <name>_long.png (the soak's loss, speed and memory); the markdown is written by hand.
"""
from __future__ import annotations

import argparse
import json
import math
import os

from swift_liger.plot import plot_runs, read_steps

from .harness import write_json


def smooth(values, window):
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def soak_summary(rows) -> dict:
    losses = [r["loss"] for r in rows]
    mem = [(r["step"], r["alloc(GiB)"]) for r in rows if isinstance(r.get("alloc(GiB)"), (int, float))]
    after = [m for m in mem if m[0] >= 100]
    out = {"steps_logged": len(rows), "last_step": rows[-1]["step"] if rows else None,
           "all_losses_finite": all(math.isfinite(x) for x in losses), "first_loss": losses[0] if losses else None,
           "last_loss": losses[-1] if losses else None}
    if after:
        (s0, a0), (s1, a1) = after[0], mem[-1]
        out.update({"alloc_gib_at": {str(s0): a0, str(s1): a1}, "alloc_growth_gib": round(a1 - a0, 6)})
    peaks = [r["peak_alloc(GiB)"] for r in rows if isinstance(r.get("peak_alloc(GiB)"), (int, float))]
    if peaks:
        out["peak_alloc_gib"] = {"min": min(peaks), "max": max(peaks)}
    return out


def parity_summary(stock, liger, window) -> dict:
    common = sorted(set(r["step"] for r in stock) & set(r["step"] for r in liger))
    a = [next(r["loss"] for r in stock if r["step"] == s) for s in common]
    b = [next(r["loss"] for r in liger if r["step"] == s) for s in common]
    sa, sb = smooth(a, window), smooth(b, window)
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(sa, sb)]
    raw = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)]
    return {"steps": len(common), "window": window, "max_rel_diff_smoothed": max(rel) if rel else None,
            "max_rel_diff_raw": max(raw) if raw else None, "within_1_percent": bool(rel) and max(rel) <= 0.01,
            "first_loss": [a[0], b[0]] if a else None, "last_loss": [a[-1], b[-1]] if a else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("soak")
    ap.add_argument("stock")
    ap.add_argument("liger")
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--name", default="soak")
    ap.add_argument("--meta", default="{}", help="JSON merged into the result (GPU, versions, commands)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = {**json.loads(args.meta), "soak": soak_summary(read_steps(args.soak)),
              "parity": parity_summary(read_steps(args.stock), read_steps(args.liger), args.window)}
    png = plot_runs([args.stock, args.liger], os.path.join(args.out, f"{args.name}_parity.png"),
                    title=f"stock vs --use_liger, same seed: {result['parity']['steps']} steps in common",
                    labels=["stock", "--use_liger"])
    soak_png = plot_runs([args.soak], os.path.join(args.out, f"{args.name}_long.png"),
                         title=f"swift sft --use_liger: {result['soak']['last_step']} steps", labels=["--use_liger"])
    result["plots"] = [os.path.basename(png), os.path.basename(soak_png)]
    write_json(os.path.join(args.out, f"{args.name}.json"), result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
