"""`swift-liger` console script.

    swift-liger plot RUN_DIR [RUN_DIR2 ...] -o out.png   loss, tokens/s and memory per step (runs overlaid)
    swift-liger tiny OUTDIR [--arch qwen3|llama|...]      offline tiny random model + toy datasets
    swift-liger info                                      is the ms-swift hook active, versions, backend
    swift-liger flags                                     every --use_liger / --liger_* flag and environment variable
    swift-liger ab [--each] -- <swift sft args>           the same run without and with --use_liger (and each
                                                          fusion off in turn): one table and a plot
"""
from __future__ import annotations

import argparse
import sys

# all torch-free at module level: `swift-liger --help` and `flags` stay cheap
from . import __version__
from .ab import main as ab_main
from .integration import hook
from .integration.arguments import flags_markdown, preset_names
from .plot import output_format, plot_runs, read_steps, run_labels
from .testing import tiny


def _plot(args) -> int:
    try:
        output_format(args.output)
        labels = args.labels or run_labels(args.runs)
        if len(labels) != len(args.runs):
            print(f"swift-liger plot: --labels got {len(labels)} names for {len(args.runs)} runs", file=sys.stderr)
            return 2
        for label, path in zip(labels, args.runs):
            print(f"{label}: {len(read_steps(path))} logged steps ({path})")
        print(plot_runs(args.runs, args.output, title=args.title, labels=labels))
    except (FileNotFoundError, ValueError) as exc:
        print(f"swift-liger plot: {exc}", file=sys.stderr)
        return 2
    return 0


def _tiny_archs() -> tuple:
    return tuple(sorted(tiny.SWIFT_FLAGS))


def _tiny(args) -> int:
    return tiny.main([args.outdir, "--arch", args.arch])


def _info(args) -> int:
    import importlib.metadata as md
    import os
    print(f"swift_liger {__version__}")
    try:
        print(f"ms-swift {md.version('ms-swift')}")
    except md.PackageNotFoundError:
        print("ms-swift not installed")
    state = "disabled by SWIFT_LIGER_DISABLE_HOOK" if hook.disabled() else (
        "active" if hook.installed() else "NOT active (was swift_liger_hook.pth processed? python -S, --target "
                                          "and PYTHONPATH installs skip .pth files)")
    print(f"ms-swift hook: {state}")
    print(f"SWIFT_LIGER_BACKEND={os.environ.get('SWIFT_LIGER_BACKEND', 'auto')} "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    print(f"presets (--liger_config NAME): {', '.join(preset_names())}")
    return 0


def _flags(args) -> int:
    print(flags_markdown())
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ab"]:   # everything after `--` belongs to swift: no argparse of ours over it
        return ab_main(argv[1:])
    ap = argparse.ArgumentParser(prog="swift-liger", description="swift_liger utilities")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plot", help="plot logging.jsonl of one or more ms-swift runs (PNG, PDF, SVG, ...)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output_dir, v*-* run dir or logging.jsonl")
    p.add_argument("-o", "--output", default="swift_liger_plot.png",
                   help="output path, written exactly as given; its extension picks the format (.png, .pdf, .svg, "
                        "...; PNG without one)")
    p.add_argument("--title", default=None)
    p.add_argument("--labels", nargs="+", default=None, metavar="NAME", help="one legend name per run")
    p.set_defaults(func=_plot)

    p = sub.add_parser("tiny", help="build the offline tiny model + datasets used by the demo and tests")
    p.add_argument("outdir")
    p.add_argument("--arch", default="qwen3", choices=_tiny_archs())
    p.set_defaults(func=_tiny)

    p = sub.add_parser("info", help="show whether the ms-swift hook is active, and the presets")
    p.set_defaults(func=_info)

    p = sub.add_parser("flags", help="the table of every flag (default, meaning) and environment variable")
    p.set_defaults(func=_flags)

    sub.add_parser("ab", help="swift-liger ab [--out DIR] [--each] [--fusions a,b] [--command sft|pt|rlhf] -- "
                              "<swift args>: the same training without and with --use_liger, one table and a plot")

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
