"""Read ms-swift training logs (logging.jsonl) and draw loss / tokens/s / memory per step, one or more runs overlaid.

What the figure promises: integer step axes; memory from 0 GiB (a 0.01 GiB spread is noise, not a difference); one
marker and line style per run, so runs with equal curves stay visible; a summary line per run (median tokens/s and
peak memory, each against the first run) under the panels.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Dict, List, Optional, Sequence

# Memory columns in order of preference: ours on CUDA, ms-swift's cumulative reserved peak, ours on CPU.
MEMORY_KEYS = ("peak_alloc(GiB)", "memory(GiB)", "rss(GiB)")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")


def find_log(path: str) -> str:
    """logging.jsonl for a run: the file itself, a v*-* run dir, or an output_dir holding v*-* dirs (newest)."""
    if os.path.isfile(path):
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such run: {path!r} (give an output_dir, a v*-* run dir or a logging.jsonl)")
    direct = os.path.join(path, "logging.jsonl")
    if os.path.isfile(direct):
        return direct
    candidates = glob.glob(os.path.join(path, "*", "logging.jsonl"))
    if not candidates:
        raise FileNotFoundError(f"no logging.jsonl in {path!r} or its subdirectories (v*-*/logging.jsonl)")
    return max(candidates, key=lambda p: (os.path.getmtime(p), p))


def read_steps(path: str) -> List[Dict]:
    """Per-step training rows (those with a loss and a global step), in step order."""
    rows = []
    with open(find_log(path), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = row.get("global_step/max_steps")
            if "loss" not in row or not isinstance(step, str):
                continue
            row["step"] = int(step.split("/")[0])
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _patched(path: str) -> bool:
    return os.path.exists(os.path.join(os.path.dirname(find_log(path)), "liger_patch.json"))


def run_labels(paths: Sequence[str]) -> List[str]:
    """One distinct label per run: the shortest trailing part of its output dir that tells the runs apart, then
    whether it ran with --use_liger (unless the name already says so)."""
    dirs = []
    for p in paths:
        run_dir = os.path.dirname(os.path.abspath(find_log(p)))
        parts = run_dir.split(os.sep)
        if os.path.basename(run_dir).startswith("v") and "-" in os.path.basename(run_dir) and len(parts) > 1:
            parts = parts[:-1]   # the v0-2026... version dir: the output_dir names the run
        dirs.append([q for q in parts if q])
    distinct = len({tuple(d) for d in dirs})
    depth = 1
    while depth < max(len(d) for d in dirs) and len({"/".join(d[-depth:]) for d in dirs}) < distinct:
        depth += 1
    labels = []
    for i, (p, d) in enumerate(zip(paths, dirs)):
        name = "/".join(d[-depth:]) or f"run {i + 1}"
        patched = _patched(p)
        says = ("liger",) if patched else ("stock", "base", "plain")   # only a name that says the truth drops it
        if not any(word in name.lower() for word in says):
            name += " (use_liger)" if patched else " (stock)"
        labels.append(name)
    counts = {label: labels.count(label) for label in labels}
    seen: Dict[str, int] = {}
    out = []
    for label in labels:   # still equal (the same run twice): number them
        seen[label] = seen.get(label, 0) + 1
        out.append(f"{label} #{seen[label]}" if counts[label] > 1 else label)
    return out


def run_label(path: str) -> str:
    return run_labels([path])[0]


def memory_key(rows: List[Dict]) -> Optional[str]:
    for key in MEMORY_KEYS:
        if any(key in r for r in rows):
            return key
    return None


def _values(rows, key):
    return [(r["step"], r[key]) for r in rows if key and isinstance(r.get(key), (int, float))]


def summary(label: str, rows: List[Dict], first: Optional[Dict] = None) -> Dict:
    """Median tokens/s over the logged steps after the first (its warm-up) and the peak of the memory column."""
    tps = [v for _, v in _values(rows[1:] or rows, "tokens/s")]
    key = memory_key(rows)
    mem = [v for _, v in _values(rows, key)]
    out = {"label": label, "tokens_per_s": statistics.median(tps) if tps else None,
           "memory_key": key, "peak_memory_gib": max(mem) if mem else None,
           "final_loss": rows[-1]["loss"] if rows else None, "steps": len(rows)}
    if first is not None:
        for k in ("tokens_per_s", "peak_memory_gib"):
            a, b = out[k], first[k]
            out[f"{k}_ratio"] = a / b if a is not None and b else None
    return out


def _summary_text(s: Dict, is_first: bool, speed_ratio: bool = True) -> str:
    parts = [s["label"] + ":"]
    if s["tokens_per_s"] is not None:
        ratio = speed_ratio and not is_first and s.get("tokens_per_s_ratio") is not None
        parts.append(f"{s['tokens_per_s']:.0f} tok/s" + (f" ({s['tokens_per_s_ratio']:.2f}x)" if ratio else ""))
    if s["peak_memory_gib"] is not None:
        parts.append(f"peak {s['peak_memory_gib']:.2f} GiB {s['memory_key']}" + (
            "" if is_first or s.get("peak_memory_gib_ratio") is None else f" ({s['peak_memory_gib_ratio']:.2f}x)"))
    if s["final_loss"] is not None:
        parts.append(f"final loss {s['final_loss']:.4f}")
    return "  ".join(parts)


def output_format(out: str) -> str:
    """The file format for `out` from its extension (png without one); ValueError for one matplotlib cannot
    write, naming those it can."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    ext = os.path.splitext(out)[1].lower().lstrip(".")
    if not ext:
        return "png"
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if ext not in supported:
        raise ValueError(f"output {out!r}: matplotlib cannot write .{ext} files; use one of "
                         f"{', '.join('.' + e for e in sorted(supported))} (or no extension for PNG)")
    return ext


def plot_runs(paths: List[str], out: str, title: Optional[str] = None,
              labels: Optional[Sequence[str]] = None, speed_ratio: bool = True) -> str:
    """Write the figure to exactly `out`, in the format its extension names (PNG without one); returns `out`.
    ValueError for an extension matplotlib cannot write or a run without a single training step. speed_ratio=False
    leaves the tokens/s ratios out of the summary (runs whose speeds do not compare, e.g. CPU reference code)."""
    fmt = output_format(out)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"labels: {len(labels)} given for {len(paths)} runs")
    names = list(labels) if labels is not None else run_labels(paths)
    runs = [(name, read_steps(p)) for name, p in zip(names, paths)]
    for (name, rows), path in zip(runs, paths):
        if not rows:
            raise ValueError(f"{find_log(path)}: no training steps (lines with loss and global_step/max_steps); "
                             "is it an ms-swift logging.jsonl?")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = (("loss", "loss"), ("tokens/s", "tokens/s (non-padding)"), (None, "memory (GiB)"))
    for ax, (key, ylabel) in zip(axes, panels):
        for i, (label, rows) in enumerate(runs):
            k = key or memory_key(rows)
            pts = _values(rows, k)
            if not pts:
                continue
            xs, ys = zip(*pts)
            suffix = f" [{k}]" if key is None else ""
            # equal curves stay visible: later runs are drawn thinner and with smaller markers of another shape on
            # top of earlier ones, and on long runs each run marks every n-th point from its own offset
            every = max(1, len(xs) // 12)
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=max(3.0, 7.5 - 1.5 * i),
                    linestyle=LINESTYLES[i % 4], linewidth=max(0.8, 2.4 - 0.5 * i), markevery=(i % every, every),
                    alpha=0.9, zorder=2 + i, label=label + suffix)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if key is None and ax.lines:   # from 0: a few MiB of difference is not magnified into a cliff
            ax.set_ylim(bottom=0, top=1.3 * max(max(line.get_ydata()) for line in ax.lines))   # room for the legend
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    stats = []
    for i, (label, rows) in enumerate(runs):
        stats.append(summary(label, rows, stats[0] if stats else None))
    lines = [_summary_text(s, i == 0, speed_ratio) for i, s in enumerate(stats)]
    fig.suptitle(title or " vs ".join(name for name, _ in runs))
    fig.text(0.01, 0.01, "\n".join(lines) + (f"\n(x: against {stats[0]['label']}; tokens/s: median after step 1)"
                                            if len(stats) > 1 else ""),
             fontsize=8, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05 + 0.035 * len(lines), 1, 1))
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(out, dpi=110, format=fmt)   # format given: `-o name` writes `name`, not `name.png`
    plt.close(fig)
    return out
