"""`swift-liger ab -- <swift sft args>`: the same training without and with --use_liger, side by side.

    swift-liger ab --out runs/ab -- --model Qwen/Qwen3-8B --tuner_type lora --dataset my.jsonl --max_steps 50
    swift-liger ab --each -- ...               # and once more per fusion, with that fusion switched off
    swift-liger ab --command rlhf -- --rlhf_type dpo ...

Each run is a real `swift <command>` process writing to OUT/<run>; afterwards one table (median tokens/s after
step 1, peak memory, final loss, the largest per-step loss difference from the stock run) and OUT/ab.png.

swift_liger flags and YAML keys among the swift arguments (``--liger_config long_context``, ``liger_rope: false`` in a
config file, ``use_liger: true`` there) apply to the patched runs only: the stock run gets the arguments without them
(a config file is copied to OUT/stock_config.<ext> without its use_liger / liger_* keys), so it is really stock.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import List, Sequence, Tuple

from .fusions import REGISTRY
from .plot import plot_runs, read_steps, summary

# fusion -> the flag value that switches it off: every fusion on by default (from the registry)
FUSIONS = {f.key: str(f.off).lower() for f in REGISTRY if f.default != f.off}
DEFAULT_EACH = tuple(FUSIONS)


def variants(each: bool, fusions: Sequence[str]) -> List[Tuple[str, str, List[str]]]:
    """(directory name, label, extra flags) per run; the stock run first."""
    out = [("stock", "stock", []), ("use_liger", "--use_liger", ["--use_liger"])]
    if each:
        for f in fusions:
            out.append((f"no_{f}", f"--use_liger, {f} off", ["--use_liger", f"--liger_{f}", FUSIONS[f]]))
    return out


def _ours(name: str) -> bool:
    """A swift_liger flag or config key (--use_liger, --liger_*), not ms-swift's own --use_liger_kernel."""
    name = name.lstrip("-").replace("-", "_")
    return name == "use_liger" or name.startswith("liger_")


def without_ours(swift_args: Sequence[str]) -> List[str]:
    """The swift arguments less our flags and their values (``--liger_x v`` or ``--liger_x=v``)."""
    out, skip = [], False
    for i, token in enumerate(swift_args):
        if skip:
            skip = False
            continue
        if token.startswith("--") and _ours(token.split("=", 1)[0]):
            nxt = swift_args[i + 1] if i + 1 < len(swift_args) else None
            skip = "=" not in token and nxt is not None and not nxt.startswith("--")
            continue
        out.append(token)
    return out


def is_config(path: str) -> bool:
    return path.endswith((".yaml", ".yml", ".json"))


def stock_config(path: str, out: str) -> str:
    """A copy of the swift config file without our keys, under `out` (the stock run reads it)."""
    import yaml
    with open(path, encoding="utf-8") as f:
        data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    if not isinstance(data, dict):
        raise SystemExit(f"swift-liger ab: {path} is not a mapping of swift arguments")
    data = {k: v for k, v in data.items() if not _ours(str(k))}
    ext = os.path.splitext(path)[1]
    dest = os.path.join(out, f"stock_config{ext}")
    os.makedirs(out, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as f:
        if ext == ".json":
            json.dump(data, f, indent=1)
        else:
            yaml.safe_dump(data, f, sort_keys=False)
    return dest


def check_swift_args(swift_args: Sequence[str], each_fusions: Sequence[str] = ()) -> None:
    """Refuse what ab sets itself: --use_liger, the flag of a fusion --each switches off, --output_dir."""
    set_by_ab = {"use_liger"} | {f"liger_{f}" for f in each_fusions}
    for token in swift_args:
        name = token.split("=", 1)[0]
        if name.startswith("--") and name[2:].replace("-", "_") in set_by_ab:
            raise SystemExit(f"swift-liger ab: {name} is set by ab itself for each run; leave it out of the swift "
                             "arguments (per-fusion runs: --each / --fusions; other --liger_* flags and presets "
                             "apply to every patched run)")
        if name == "--output_dir":
            raise SystemExit("swift-liger ab: --output_dir is set per run; give the parent directory with --out")
    if not swift_args:
        raise SystemExit("swift-liger ab: no swift arguments; usage: swift-liger ab [--each] -- <swift sft args>")


def commands(command: str, swift_args: Sequence[str], out: str, runs, python: str = sys.executable) -> List[list]:
    """The `swift <command>` argv of each run: the stock run without our flags and config keys."""
    cmds = []
    for name, _, extra in runs:
        args = list(swift_args)
        if not extra:   # stock
            args = without_ours(args)
            if args and is_config(args[0]):
                args[0] = stock_config(args[0], out)
        # ms-swift wants a config file first: it stays first, the run's flags follow everything
        cmds.append([python, "-m", "swift.cli.main", command, *args, *extra, "--output_dir", os.path.join(out, name)])
    return cmds


def run_all(command: str, swift_args: Sequence[str], out: str, runs, python: str = sys.executable) -> List[dict]:
    os.makedirs(out, exist_ok=True)
    results = []
    for (name, label, extra), cmd in zip(runs, commands(command, swift_args, out, runs, python)):
        output_dir = os.path.join(out, name)
        log_path = os.path.join(out, f"{name}.log")
        print(f"[ab] {label}: swift {command} ... {' '.join(extra)}  (log: {log_path})", flush=True)
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        results.append({"name": name, "label": label, "dir": output_dir, "rc": rc,
                        "command": shlex.join(cmd[2:])})
        if rc != 0:
            print(f"[ab] {label}: exit code {rc}; last lines of {log_path}:", flush=True)
            with open(log_path, errors="replace") as f:
                print("".join(f.readlines()[-8:]), flush=True)
    return results


def report(results: List[dict], out: str) -> str:
    rows, stats, done = [], [], []
    base_steps = None
    for r in results:
        try:
            steps = read_steps(r["dir"])
        except FileNotFoundError:
            steps = []
        if not steps:
            rows.append(f"| {r['label']} | failed (exit code {r['rc']}) | | | | |")
            continue
        s = summary(r["label"], steps, stats[0] if stats else None)
        stats.append(s)
        done.append(r)
        if base_steps is None:
            base_steps = {x["step"]: x["loss"] for x in steps}
            diff = "—"
        else:
            common = [x for x in steps if x["step"] in base_steps]
            diff = f"{max(abs(x['loss'] - base_steps[x['step']]) for x in common):.2e}" if common else "—"
        tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] is not None else "—"
        ratio = f"{s['tokens_per_s_ratio']:.2f}×" if s.get("tokens_per_s_ratio") else "1.00×"
        mem = (f"{s['peak_memory_gib']:.2f} ({s['memory_key']})" if s["peak_memory_gib"] is not None else "—")
        rows.append(f"| {r['label']} | {tps} | {ratio} | {mem} | {s['final_loss']:.4f} | {diff} |")
    table = "\n".join(["| run | tokens/s | vs stock | peak memory GiB | final loss | max per-step loss diff |",
                       "|---|---:|---:|---:|---:|---:|", *rows])
    if len(done) >= 1:
        png = plot_runs([r["dir"] for r in done], os.path.join(out, "ab.png"), labels=[r["label"] for r in done])
        table += f"\n\nplot: {png}"
    return table


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="swift-liger ab", usage="swift-liger ab [--out DIR] [--each] [--fusions a,b] "
                                 "[--command sft|pt|rlhf] -- <swift args>",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ab_runs", help="parent directory of the runs (default ab_runs)")
    ap.add_argument("--command", default="sft", choices=("sft", "pt", "rlhf"))
    ap.add_argument("--each", action="store_true", help="also one run per fusion with that fusion off")
    ap.add_argument("--fusions", default=",".join(DEFAULT_EACH),
                    help=f"fusions for --each, comma-separated (from {', '.join(FUSIONS)})")
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            ap.parse_args(["--help"])   # prints the whole help, exits 0
        ap.print_usage(sys.stderr)
        print("swift-liger ab: the swift arguments go after `--`", file=sys.stderr)
        return 2
    split = argv.index("--")
    ours, swift_args = argv[:split], argv[split + 1:]
    args = ap.parse_args(ours)
    fusions = [f.strip() for f in args.fusions.split(",") if f.strip()]
    unknown = [f for f in fusions if f not in FUSIONS]
    if unknown:
        print(f"swift-liger ab: --fusions: unknown {', '.join(unknown)}; known: {', '.join(FUSIONS)}",
              file=sys.stderr)
        return 2
    check_swift_args(swift_args, fusions if args.each else ())
    results = run_all(args.command, swift_args, args.out, variants(args.each, fusions))
    print(report(results, args.out))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
