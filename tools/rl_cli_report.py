"""Merge `swift rlhf` CLI reports of `tools/gpu_swift_cli.sh` (TASKS=grpo / gkd: swift_liger.bench.swift_cli's
<name>.json, one per point) into one JSON, a markdown table and a PNG: peak allocated memory and tokens/s per point for
plain, --use_liger_kernel and --use_liger (a run that ran out of memory is marked OOM). One run's own JSON (swift_cli
`run`'s file, e.g. the longest completion length) is a point of its variant alone.

    python3 tools/rl_cli_report.py docs/benchmarks/swift_cli_qwen2_5_1_5b_grpo_lora.json ... \
        --out docs/benchmarks/rl_cli_h200
"""
import argparse
import json
import os

ORDER = ("plain", "liger_kernel", "swift_liger")
LABEL = {"plain": "plain", "liger_kernel": "--use_liger_kernel", "swift_liger": "--use_liger"}


def _flag(command: str, flag: str):
    parts = command.split()
    vals = [parts[i + 1] for i, a in enumerate(parts[:-1]) if a == flag]
    return vals[-1] if vals else None


def _run_entry(r: dict) -> dict:
    s = r["summary"]
    oom = "OutOfMemoryError" in (r.get("error") or "")
    return {"tokens_per_s": s.get("tokens_per_s"), "step_time_s": s.get("step_time_s"),
            "peak_allocated_gib": s.get("peak_allocated_gib"), "peak_reserved_gib": s.get("peak_reserved_gib"),
            "steps_measured": s.get("steps_measured"), "tokens_per_step": s.get("tokens_per_step"),
            "final_loss": s.get("final_loss"), "oom": oom, "error": r.get("error"), "command": r["command"]}


def _point(results: list, shape: str, source: str) -> dict:
    first = results[0]
    task = first["task"]
    if task == "grpo":
        what = (f"{_flag(first['command'], '--num_generations')} x {_flag(first['command'], '--max_completion_length')}"
                " completion tokens")
    else:
        teacher = os.path.basename(os.path.dirname(_flag(first["command"], "--teacher_model") or "?/?"))
        what = f"1 x {first['seq']} tokens, teacher {teacher.split('_')[1] if '_' in teacher else teacher}"
        if _flag(first["command"], "--gkd_logits_topk"):
            what += f", top-{_flag(first['command'], '--gkd_logits_topk')}"
    return {"task": task, "shape": shape, "batch": what, "source": source,
            "runs": {r["variant"]: _run_entry(r) for r in results}}


def load(paths: list) -> list:
    """Points in the order given: a report (several variants) or one run's own JSON (swift_cli `run`)."""
    points = []
    for p in paths:
        rep = json.load(open(p))
        if "results" in rep:
            shape = (rep.get("build") or {}).get("config", {}).get("shape", "?")
            points.append(_point(rep["results"], shape, os.path.basename(p)))
            points[-1]["environment"] = rep["environment"]
        else:
            model = _flag(rep["command"], "--model") or "?"
            shape = os.path.basename(os.path.dirname(model)).split("_")[1] if "model_" in model else "?"
            points.append(_point([rep], shape, os.path.basename(p)))
    return points


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "—"


def markdown(points: list, note: str = "") -> str:
    env = next(p["environment"] for p in points if "environment" in p)
    head = (f"GPU: {env.get('gpu')} · torch {env.get('torch')} · triton {env.get('triton')} · transformers "
            f"{env.get('transformers')} · ms-swift {env.get('ms-swift')} · peft {env.get('peft')} · liger-kernel "
            f"{env.get('liger-kernel')} · {env.get('date')}")
    lines = ["# `swift rlhf` GRPO and GKD: memory and speed, plain vs Liger-Kernel vs swift_liger", "", head, "",
             "Merged by `tools/rl_cli_report.py` from the per-point reports named in the last column (each has its "
             "commands, the build and every step). LoRA r16 on all linears, bf16, SDPA, gradient checkpointing, random-"
             "init Qwen2.5-shaped models. GRPO: one prompt x 8 completions per micro-batch from an instant rollout of "
             "random tokens (`swift_liger/bench/grpo_plugin.py`), so a step is ms-swift's training phase at full "
             "length (reference log-probs, policy forward and backward, optimizer). GKD: off-policy, 7B-shaped "
             "teacher, 1.5B-shaped student. tokens/s: median after warm-up; memory: max over steps of "
             "`torch.cuda.max_memory_allocated`.", "",
             "| task | model | per micro-batch | plain tok/s | Liger tok/s | ours tok/s | ours vs plain |"
             " ours vs Liger | plain GiB | Liger GiB | ours GiB | ours vs plain memory | report |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in points:
        r = p["runs"]

        def tps(v):
            e = r.get(v)
            return "OOM" if e and e["oom"] else (f"{e['tokens_per_s']:.0f}" if e and e["tokens_per_s"] else "—")

        def mem(v):
            e = r.get(v)
            return "OOM" if e and e["oom"] else (f"{e['peak_allocated_gib']:.1f}" if e and e["peak_allocated_gib"]
                                                 else "—")

        t = {v: (r.get(v) or {}).get("tokens_per_s") for v in ORDER}
        m = {v: (r.get(v) or {}).get("peak_allocated_gib") for v in ORDER}
        less = f"-{100 * (1 - m['swift_liger'] / m['plain']):.0f}%" if m["plain"] and m["swift_liger"] else "—"
        lines.append(f"| {p['task']} | {p['shape']} | {p['batch']} | {tps('plain')} | {tps('liger_kernel')} | "
                     f"{tps('swift_liger')} | {_ratio(t['swift_liger'], t['plain'])} | "
                     f"{_ratio(t['swift_liger'], t['liger_kernel'])} | {mem('plain')} | {mem('liger_kernel')} | "
                     f"{mem('swift_liger')} | {less} | {p['source']} |")
    return "\n".join(lines + ([""] + [note] if note else [])) + "\n"


def plot(points: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    def short(p):   # "GRPO 1.5B\n8 x 2048"
        size = p["shape"].split("-")[-1].upper()
        batch = p["batch"].replace(" completion tokens", "").replace(" tokens, teacher ", "\nteacher ")
        batch = batch.replace(", top-", "\ntop-")
        return f"{p['task'].upper()} {size}\n{batch.replace('qwen2.5-', '')}"
    names = [short(p) for p in points]
    width = 0.27
    colors = {"plain": "#999999", "liger_kernel": "#4c72b0", "swift_liger": "#dd8452"}
    for ax, key, title in ((axes[0], "peak_allocated_gib", "peak allocated GiB (lower is better)"),
                           (axes[1], "tokens_per_s", "tokens/s (higher is better)")):
        for i, v in enumerate(ORDER):
            xs, ys, ooms = [], [], []
            for j, p in enumerate(points):
                e = p["runs"].get(v)
                x = j + (i - 1) * width
                if e and e["oom"]:
                    ooms.append(x)
                elif e and e.get(key):
                    xs.append(x)
                    ys.append(e[key])
            ax.bar(xs, ys, width, label=LABEL[v], color=colors[v])
            for x in ooms:
                ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8, color=colors[v])
        ax.set_xticks(range(len(points)))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("swift rlhf on one H200, LoRA: GRPO (8 completions per prompt) and GKD", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", required=True, help="path stem: writes .json, .md, .png")
    ap.add_argument("--note", default="", help="a paragraph under the table")
    args = ap.parse_args()
    points = load(args.reports)
    with open(args.out + ".json", "w") as f:
        command = "python3 tools/rl_cli_report.py " + " ".join(args.reports) + f" --out {args.out}"
        json.dump({"command": command, "note": args.note, "points": points}, f, indent=1)
    md = markdown(points, args.note)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    plot(points, args.out + ".png")
    print(md)


if __name__ == "__main__":
    main()
