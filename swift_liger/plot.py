"""Read ms-swift training logs (logging.jsonl) and draw loss / tokens/s / memory per step, one or more runs overlaid."""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

# Memory columns in order of preference: ours on CUDA, ms-swift's cumulative reserved peak, ours on CPU.
MEMORY_KEYS = ("peak_alloc(GiB)", "memory(GiB)", "rss(GiB)")


def find_log(path: str) -> str:
    """logging.jsonl for a run: the file itself, a v*-* run dir, or an output_dir holding v*-* dirs (newest)."""
    if os.path.isfile(path):
        return path
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


def run_label(path: str) -> str:
    log = find_log(path)
    run_dir = os.path.dirname(log)
    name = os.path.basename(os.path.dirname(run_dir)) or os.path.basename(run_dir)
    liger = os.path.exists(os.path.join(run_dir, "liger_patch.json"))
    return f"{name} ({'use_liger' if liger else 'stock'})"


def memory_key(rows: List[Dict]) -> Optional[str]:
    for key in MEMORY_KEYS:
        if any(key in r for r in rows):
            return key
    return None


def plot_runs(paths: List[str], out: str, title: Optional[str] = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(run_label(p), read_steps(p)) for p in paths]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("loss", "loss"), ("tokens/s", "tokens/s (non-padding)"), (None, "memory (GiB)"))
    for ax, (key, ylabel) in zip(axes, panels):
        for label, rows in runs:
            k = key or memory_key(rows)
            pts = [(r["step"], r[k]) for r in rows if k and isinstance(r.get(k), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                suffix = f" [{k}]" if key is None else ""
                ax.plot(xs, ys, marker="o", markersize=3, label=label + suffix)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title or " vs ".join(label for label, _ in runs))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
