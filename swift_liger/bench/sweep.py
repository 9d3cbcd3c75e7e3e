"""The per-op sweep of issue 12: every op at every shape of its grid, ours beside every peer, fwd+bwd, bf16.

    python -m swift_liger.bench.sweep run --out DIR [--ops rms_norm,swiglu,...] [--deadline 500] [--rep-ms 40]
                                          [--skip EARLIER/sweep.jsonl]
    python -m swift_liger.bench.sweep report DIR/sweep.jsonl [MORE.jsonl ...] --out docs/benchmarks [--name NAME]

`run` (CUDA) takes the grid of swift_liger.bench.kernels.sweep_groups (RMSNorm with and without the fused residual
over tokens x hidden, SwiGLU/GeGLU over intermediate, RoPE and QK-norm+RoPE over head layouts and head dims,
cross-entropy and linear+CE over the loss heads of Llama-3, Qwen2.5, Gemma-2 and Mistral), round-robin over the ops
so that a deadline cuts every op's tail rather than whole ops, and appends one JSON line per (shape, peer) to
DIR/sweep.jsonl as it goes (a cut run keeps what it measured). torch.compile's caches are reset before every case,
so every shape gets its own static compile (dynamo's recompile limit would otherwise fall back to eager).
--graphs times each fwd+bwd as one CUDA graph replay: kernel time without the host's share, which at these sizes
can exceed the kernels' (an implementation that cannot be captured is timed eagerly, marked "(eager)").
--skip leaves out the cases an earlier run's JSONL already holds, so a grid longer than one device call is measured
over several calls; `report` merges their files (a case measured twice keeps the later file's rows).
`report` (no GPU needed) writes <name>.json, <name>.md and <name>.png: per op and shape our time over the fastest
peer's, achieved GB/s or TFLOP/s, and peak extra memory beside Liger-Kernel's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from . import harness, kernels
from .harness import fmt, header, write_report

OURS = "swift_liger"
OPS = ("rms_norm", "rms_norm_residual", "swiglu", "geglu", "rope", "qk_norm_rope", "cross_entropy",
       "fused_linear_ce")
SLOW_OPS = {"fused_linear_ce": 45.0, "cross_entropy": 15.0}   # seconds one case may take (compile + eager peer)
DEFAULT_CASE_S = 8.0
TIE = 1.05   # ours within 5% of the fastest peer: inside this GPU's run-to-run spread (orange in the plot)


def order(groups: Dict[str, list], ops) -> List[tuple]:
    """(op, key, factory) round-robin over ops, each op's own order kept (its target shape first)."""
    queues = [[(op, key, f) for key, f in groups[op]] for op in ops]
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def run(args) -> int:
    ops = args.ops.split(",") if args.ops else list(OPS)
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        sys.exit(f"--ops: unknown {unknown}; known: {', '.join(OPS)}")
    missing = [p for p in args.skip if not os.path.isfile(p)]
    if missing:
        sys.exit(f"--skip: no such file {', '.join(missing)} (expected an earlier run's sweep.jsonl)")
    if not torch.cuda.is_available():
        sys.exit("swift_liger.bench.sweep run needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sweep.jsonl")
    t0 = time.time()
    env = harness.environment("python -m swift_liger.bench.sweep")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"environment": env}) + "\n")
    todo, measured = remaining(order(kernels.sweep_groups(), ops), args.skip)
    done = skipped = 0
    for op, key, factory in todo:
        left = args.deadline - (time.time() - t0) if args.deadline else float("inf")
        if left < SLOW_OPS.get(op, DEFAULT_CASE_S):
            skipped += 1
            continue
        torch._dynamo.reset()
        rep = max(args.rep_ms, 150) if op == "fused_linear_ce" else args.rep_ms
        try:
            case = factory()
            results = harness.run_case(case, warmup_ms=max(10, rep // 4), rep_ms=rep, graphs=args.graphs)
        except Exception as exc:   # a case that cannot be built is reported, not fatal
            results = [harness.Result(op, key, OURS, None, None, None, None, None, None, harness.describe(exc))]
        with open(path, "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({**dataclasses.asdict(r), "op": op, "shape": key}) + "\n")
        done += 1
        best = _ratio([dataclasses.asdict(r) for r in results])
        print(f"{op:18s} {key:44s} " + "  ".join(f"{r.impl} {r.ms:.3f}" if r.ms is not None else f"{r.impl} failed"
                                                 for r in results)
              + (f"  ours/best peer {best[0]:.2f} ({best[1]})" if best else ""), flush=True)
    print(f"sweep: {done} cases measured, {skipped} skipped by the deadline, {measured} measured earlier "
          f"(--skip), {time.time() - t0:.0f} s", flush=True)
    return 0


def remaining(todo: List[tuple], skip_paths) -> tuple:
    """(the (op, key, factory) items of todo that no file in skip_paths measured, how many were measured there)."""
    measured = set()
    for path in skip_paths or ():
        measured |= set(cases(load(path)[1]))
    left = [t for t in todo if (t[0], t[1]) not in measured]
    return left, len(todo) - len(left)


def _ratio(rows) -> Optional[tuple]:
    """(our ms / the fastest peer's ms, that peer) over the rows of one case; None when either is missing."""
    ours = [r for r in rows if r["impl"] == OURS and r["ms"] is not None]
    peers = [r for r in rows if not r["impl"].startswith(OURS) and r["impl"] != "eager" and r["ms"] is not None]
    if not ours or not peers:
        return None
    best = min(peers, key=lambda r: r["ms"])
    return ours[0]["ms"] / best["ms"], best["impl"]


def load(path: str):
    env, rows = None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "environment" in rec:
                env = env or rec["environment"]
            else:
                rows.append(rec)
    return env, rows


def cases(rows) -> Dict[tuple, list]:
    by: Dict[tuple, list] = {}
    for r in rows:
        by.setdefault((r["op"], r["shape"]), []).append(r)
    return by


def _ms(row) -> str:
    """A row's median ms; ' (eager)' where a --graphs run could not capture it in a CUDA graph."""
    return fmt(row.get("ms"), ".3f") + (" (eager)" if row.get("graphed") is False else "")


def to_markdown(env, rows, command: str, png: Optional[str], notes: str = "") -> str:
    by = cases(rows)
    lines = header("Per-op sweep: ours against every peer at every shape", env, "triton", "liger_kernel", cuda=False,
                   command=command) + [
             "bf16, forward+backward, `triton.testing.do_bench` median, every peer in one process on fresh identical "
             "inputs; torch.compile of the eager code, compiled per shape (static). `ours/best` = our median over "
             "the fastest peer's (eager excluded; < 1 means ours is faster). GB/s is over the op's minimum bytes "
             "(each input read once, each output written once, forward and backward); TFLOP/s over the minimum GEMM "
             "FLOPs. Peak extra = memory above the inputs during one fwd+bwd, input gradients included (Liger writes "
             "some gradients into its inputs).", ""]
    if png:
        lines += [f"![ours over the fastest peer]({png})", ""]
    summary = []
    for op in OPS:
        keys = [k for k in by if k[0] == op]
        if not keys:
            continue
        ratios = [(_ratio(by[k]), k[1]) for k in keys]
        ratios = [(r, s) for r, s in ratios if r]
        if ratios:
            worst = max(ratios, key=lambda x: x[0][0])
            wins = sum(1 for r, _ in ratios if r[0] <= 1.0)
            ties = sum(1 for r, _ in ratios if 1.0 < r[0] <= TIE)
            summary.append(f"| {op} | {len(keys)} | {wins} | {ties} | {worst[0][0]:.2f} ({worst[0][1]}, {worst[1]}) |")
        impls = []
        for k in keys:
            for r in by[k]:
                if r["impl"] not in impls:
                    impls.append(r["impl"])
        lines += [f"## {op}", "", "| shape | " + " | ".join(f"{i} ms" for i in impls)
                  + " | ours/best | ours GB/s or TFLOP/s | peak extra GiB: ours (in-place) / liger |",
                  "|---|" + "---:|" * (len(impls) + 3)]
        for k in keys:
            got = {r["impl"]: r for r in by[k]}
            ratio = _ratio(by[k])
            ours = got.get(OURS, {})
            peak = fmt(ours.get("peak_extra_gib"), ".3f")
            if f"{OURS} inplace" in got:
                peak += f" ({fmt(got[f'{OURS} inplace'].get('peak_extra_gib'), '.3f')})"
            rate = (f"{ours['gbps']:.0f} GB/s" if ours.get("gbps") else
                    f"{ours['tflops']:.0f} TFLOP/s" if ours.get("tflops") else "—")
            lines.append(f"| {k[1]} | " + " | ".join(_ms(got.get(i, {})) for i in impls)
                         + f" | {fmt(ratio[0] if ratio else None, '.2f')} | {rate} | "
                         f"{peak} / {fmt(got.get('liger', {}).get('peak_extra_gib'), '.3f')} |")
        lines.append("")
    head = ["## Summary", "",
            "| op | shapes measured | ours ≤ fastest peer | within 5% | worst ours/best (peer, shape) |",
            "|---|---:|---:|---:|---|", *summary, ""] + ([notes.strip(), ""] if notes.strip() else [])
    at = lines.index(f"![ours over the fastest peer]({png})") + 2 if png else 10
    return "\n".join(lines[:at] + head + lines[at:]) + "\n"


def plot(path: str, rows) -> bool:
    try:
        import matplotlib  # lazy: optional (no plot without it), a second to import, `report` only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")
    except ImportError:
        return False
    by = cases(rows)
    ops = [op for op in OPS if any(k[0] == op and _ratio(v) for k, v in by.items())]
    if not ops:
        return False
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 2.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        keys = [k for k in by if k[0] == op and _ratio(by[k])]
        vals = [_ratio(by[k])[0] for k in keys]
        ax.bar(range(len(keys)), vals, color=["tab:green" if v <= 1 else "tab:orange" if v <= TIE else "tab:red"
                                              for v in vals])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("ours / fastest")
        ax.set_title(op, fontsize=9)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([k[1].split(" (")[0] for k in keys], rotation=60, ha="right", fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def merge(paths) -> tuple:
    """(first file's environment, rows) over several runs' JSONL; a case in a later file replaces earlier rows."""
    env, by = None, {}
    for path in paths:
        e, rows = load(path)
        if e is None:
            sys.exit(f"{path}: no environment line (not written by `sweep run`?)")
        env = env or e
        for key, got in cases(rows).items():
            by[key] = got
    return env, [r for got in by.values() for r in got]


def report(args) -> int:
    env, rows = merge(args.jsonl)
    os.makedirs(args.out, exist_ok=True)
    png = f"{args.name}.png" if plot(os.path.join(args.out, f"{args.name}.png"), rows) else None
    command = args.command or env.get("command", "python -m swift_liger.bench.sweep run")
    notes = ""
    if args.notes:
        with open(args.notes, encoding="utf-8") as f:
            notes = f.read()
    print(write_report(args.out, args.name, {"environment": env, "command": command, "results": rows},
                       to_markdown(env, rows, command, png, notes)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.sweep", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(OPS)}")
    r.add_argument("--deadline", type=float, default=None, help="seconds; no new case starts after")
    r.add_argument("--rep-ms", type=int, default=40)
    r.add_argument("--graphs", action="store_true",
                   help="time every fwd+bwd as a CUDA graph replay (kernel time, without the host's share)")
    r.add_argument("--skip", action="append", default=[], metavar="JSONL",
                   help="an earlier run's sweep.jsonl: its cases are not measured again (repeatable)")
    p = sub.add_parser("report")
    p.add_argument("jsonl", nargs="+", help="one or more runs' sweep.jsonl, merged in order")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="kernel_sweep")
    p.add_argument("--command", default=None, help="the command line to print (default: from the JSONL)")
    p.add_argument("--notes", default=None, help="a markdown file put after the summary (how to read this run)")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
