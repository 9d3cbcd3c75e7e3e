"""Merge the CLI results of `tools/gpu_call_graphs.sh` calls (each call's calls.tgz unpacked into a directory) into
one JSON, and plot --use_liger's speed-up over plain and over --use_liger_kernel per point (rows measured in the same
call only); --tables prints the report's markdown tables.
    python3 tools/graph_calls_report.py --call DIR COMMIT "CMD" [--call ...] --out docs/benchmarks/NAME [--tables]
--after docs/benchmarks/NAME.json keeps an earlier report's calls (and their numbers) first and numbers the new
calls after them, so a grid measured over several leases stays one report."""
import argparse
import glob
import json
import os
import re


def load(call_dir: str) -> dict:
    points = {}
    for f in sorted(glob.glob(os.path.join(call_dir, "c", "*", "swift_cli_*.json"))):
        point = os.path.basename(os.path.dirname(f))
        rep = json.load(open(f))
        runs = {}
        for r in rep["results"]:
            s = r["summary"]
            runs[r["variant"]] = {k: s.get(k) for k in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
                                                        "tokens_per_s_total",
                                                        "tokens_per_step", "step_time_s", "peak_allocated_gib",
                                                        "peak_reserved_gib", "final_loss")}
            runs[r["variant"]].update(tuner=r["tuner"], wall_s=r["wall_s"], first_step_s=r["rows"][0]["step_time(s)"]
                                      if r["rows"] else None, command=r["command"])
            timed = [(x["step_time(s)"], x["tokens/s"] * x["step_time(s)"]) for x in r["rows"]
                     if x.get("step_time(s)") and x.get("tokens/s") is not None]
            if timed:   # every logged step, the first ones (captures, Triton compiles) included
                runs[r["variant"]].update(all_steps=len(timed), all_steps_s=sum(t for t, _ in timed),
                                          tokens_per_s_all_steps=sum(n for _, n in timed) / sum(t for t, _ in timed))
        for log in glob.glob(os.path.join(call_dir, "c", point, "swift_cli_runs.tar.gz")):
            import tarfile
            with tarfile.open(log) as tar:
                for m in tar.getmembers():
                    if m.name.endswith(".liger_patch.json"):   # graph_layers' counters over the whole run
                        v = os.path.basename(m.name)[:-len(".liger_patch.json")]
                        total = json.load(tar.extractfile(m)).get("runtime", {}).get("total", {})
                        g = total.get("policy", {}).get("graph_layers")
                        if g and v in runs:
                            runs[v]["graph_layers_total"] = {k: g.get(k) for k in (
                                "captures", "capture_s", "replays", "inferred", "keys_replayed", "static_mib",
                                "device_outside_torch_mib")} | {"timed": len(g.get("measured") or []),
                                                                 "eager_keys": len(g.get("eager") or {})}
                    if m.name.endswith(".log"):
                        text = tar.extractfile(m).read().decode(errors="replace")
                        hit = re.search(r"swift_liger: (graph_layers in the first step: .*)", text)
                        v = os.path.basename(m.name)[:-4]
                        v = v.split("_", 2)[2] if v.startswith("sft_full_") else v
                        if hit and v in runs:
                            runs[v]["graph_layers"] = hit.group(1).strip()
        points[point] = {"environment": rep["environment"], "runs": runs}
    return points


def _label(point: str) -> str:
    """qwen2.5-0.5b_512_8[_full][_longtail][_r2] -> "Qwen2.5-0.5B, 8 x 512[ (full)][, varying lengths][, run 2]"
    (rows x row length; varying: rows of log-uniform 64..length-64 tokens; _rN: the call's Nth visit of the point)."""
    m = re.match(r"(.+?)_(\d+)_(\d+)(_full)?(_longtail)?(?:_r(\d+))?$", point)
    if not m:
        return point
    name = {"llama3-8b": "Llama-3-8B"}.get(m.group(1), m.group(1).replace("qwen", "Qwen").replace("b", "B"))
    return (f"{name}, {m.group(3)} x {m.group(2)}{' (full)' if m.group(4) else ''}"
            f"{', varying lengths' if m.group(5) else ''}{f', run {m.group(6)}' if m.group(6) else ''}")


def _longtail(point: str) -> bool:
    """Rows of varying length (a repeat's _rN suffix aside)."""
    return re.sub(r"_r\d+$", "", point).endswith("_longtail")


def rate(point: str, run: dict):
    """A run's tokens/s: the median step's, or where rows vary in length (a longtail point) all measured tokens
    over all measured seconds (steps differ by shape, and a new shape's first calls count)."""
    return run.get("tokens_per_s_total" if _longtail(point) else "tokens_per_s")


def tables(calls) -> str:
    """Markdown tables of every point of every call: tok/s and ratios, memory, first step (runs of one call)."""
    def f(x, fmt="{:.0f}"):
        return "" if x is None else fmt.format(x)
    speed = ["| point | call | plain | `--use_liger` | vs plain | `--use_liger_kernel` | vs Liger | others |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    mem = ["| point | call | plain | `--use_liger` | `--use_liger_kernel` |", "|---|---:|---|---|---|"]
    first = ["| point | call | plain | `--use_liger` | `--use_liger_kernel` |", "|---|---:|---:|---:|---:|"]
    for c in calls:
        for point, p in c["points"].items():
            runs = p["runs"]
            get = lambda v, k: runs.get(v, {}).get(k)   # noqa: E731
            ours, plain, liger = (rate(point, runs.get(v, {})) for v in ("swift_liger", "plain", "liger_kernel"))
            others = ", ".join(f"{v} {rate(point, r):.0f}" for v, r in runs.items()
                               if v not in ("swift_liger", "plain", "liger_kernel") and rate(point, r))
            speed.append(f"| {_label(point)} | {c['call']} | {f(plain)} | {f(ours)} | "
                         f"{f(ours / plain if ours and plain else None, '{:.2f}x')} | {f(liger)} | "
                         f"{f(ours / liger if ours and liger else None, '{:.2f}x')} | {others} |")
            gib = lambda v: (f"{get(v, 'peak_allocated_gib'):.2f} / {get(v, 'peak_reserved_gib'):.2f}"   # noqa: E731
                             if get(v, "peak_allocated_gib") is not None else "")
            mem.append(f"| {_label(point)} | {c['call']} | {gib('plain')} | {gib('swift_liger')} | "
                       f"{gib('liger_kernel')} |")
            first.append(f"| {_label(point)} | {c['call']} | " + " | ".join(
                f(get(v, "first_step_s"), "{:.2f}") for v in ("plain", "swift_liger", "liger_kernel")) + " |")
    varying = ["| point | call | plain | `--use_liger` | vs plain | ours, graphs off | `--use_liger_kernel` | "
               "vs Liger | keys: replayed / timed / inferred / eager | captures (s) | outside torch MiB |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in calls:
        for point, p in c["points"].items():
            if not _longtail(point):
                continue
            runs = p["runs"]
            a = {v: runs.get(v, {}).get("tokens_per_s_all_steps") for v in
                 ("plain", "swift_liger", "swift_liger_eager", "liger_kernel")}
            g = runs.get("swift_liger", {}).get("graph_layers_total") or {}
            ratio = lambda a, b: f(a / b if a and b else None, "{:.2f}x")   # noqa: E731
            ours = a["swift_liger"]
            varying.append(
                f"| {_label(point)} | {c['call']} | {f(a['plain'])} | {f(ours)} | {ratio(ours, a['plain'])} | "
                f"{f(a['swift_liger_eager'])} | {f(a['liger_kernel'])} | {ratio(ours, a['liger_kernel'])}"
                f" | {g.get('keys_replayed', '')} / {g.get('timed', '')} / {g.get('inferred', '')} / "
                f"{g.get('eager_keys', '')} | {g.get('captures', '')} ({f(g.get('capture_s'), '{:.1f}')}) | "
                f"{f(g.get('device_outside_torch_mib'))} |")
    extra = ["Varying lengths, every step counted (captures and compiles included): tokens/s; graph_layers' keys "
             "over the run:", "", *varying, ""] if len(varying) > 2 else []
    return "\n".join(["Tokens/s (median of the measured steps; at varying lengths all measured tokens / seconds):", "",
                      *speed, "",
                      "Peak allocated / reserved GiB:", "", *mem, "", "First step, s:", "", *first, "", *extra])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--call", nargs=3, action="append", metavar=("DIR", "COMMIT", "COMMAND"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tables", action="store_true", help="also print the markdown tables (speed, memory, first "
                    "step) of every point, for the report's .md")
    ap.add_argument("--after", help="an earlier report's JSON whose calls come first")
    args = ap.parse_args()
    calls = json.load(open(args.after))["calls"] if args.after else []
    calls += [{"call": len(calls) + i + 1, "commit": c, "command": cmd, "points": load(d)}
              for i, (d, c, cmd) in enumerate(args.call)]
    with open(args.out + ".json", "w") as f:
        json.dump({"calls": calls}, f, indent=1)
    if args.tables:
        print(tables(calls))
    bars = []   # (label, vs plain, vs liger)
    for c in calls:
        for point, p in c["points"].items():
            runs = p["runs"]
            ours, plain, liger = (rate(point, runs.get(v, {})) for v in ("swift_liger", "plain", "liger_kernel"))
            if ours and plain:
                label = point.replace("qwen2.5-", "").replace("llama3-", "L").replace("_full", " full").replace(
                    "_longtail", " varying")
                label = re.sub(r"_r(\d+)$", r" run \1", label)   # a repeat within the call
                label = re.sub(r"_(\d+)_(\d+)", r" \2x\1", label)   # 0.5b_512_8 -> 0.5b 8x512 (rows x row length)
                bars.append((f"{label} ({c['call']})", ours / plain, ours / liger if liger else None))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(bars) + 2), 4.4))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="--use_liger / plain")
    ax.bar([i + 0.2 for i in x], [b[2] or 0 for b in bars], 0.4, label="--use_liger / --use_liger_kernel")
    for i, b in enumerate(bars):
        ax.text(i - 0.2, b[1], f"{b[1]:.2f}", ha="center", va="bottom", fontsize=8)
        if b[2]:
            ax.text(i + 0.2, b[2], f"{b[2]:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=8, rotation=35, ha="right")
    ax.set_ylabel("tokens/s ratio (same call)")
    gpus = sorted({p["environment"].get("gpu", "?") for c in calls for p in c["points"].values()})
    ax.set_title(f"swift sft on {', '.join(gpus)} (LoRA r16 unless 'full'; (n) = call): --use_liger speed-up",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print(json.dumps(bars))


if __name__ == "__main__":
    main()
