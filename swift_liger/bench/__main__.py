"""python -m swift_liger.bench {kernels,loss_head,logprobs,attention,fp8_linear,all} [--out docs/benchmarks] [--only OP]

Times every op forward+backward beside eager PyTorch, torch.compile and Liger-Kernel / Cut Cross-Entropy when
importable, in one process, and writes JSON + markdown under --out. Needs a CUDA GPU.
"""
import argparse
import sys

import torch

from . import harness
from .kernels import SUITES

TITLES = {"kernels": "Kernel benchmarks: RMSNorm, SwiGLU/GeGLU, RoPE, cross-entropy",
          "loss_head": "Loss head: fused linear cross-entropy (Llama-3-8B head)",
          "logprobs": ("Preference-loss head: per-token log-probs from hidden states (DPO pair, 2 x 4096 tokens); "
                       "GRPO's log-probs + entropies (8 x 2048 completion tokens)"),
          "attention": "Fused QK-RMSNorm + RoPE (Qwen3-8B shapes)",
          "fp8_linear": ("Frozen projections in FP8 (ops.fp8_linear: forward + input gradient) vs bf16, and LoRA "
                         "over either base (Qwen2.5-7B projections at 8192 tokens)")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench", description=__doc__.splitlines()[0])
    ap.add_argument("suite", choices=sorted(SUITES) + ["all"])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--only", default=None, help="run only cases whose op name contains this")
    ap.add_argument("--rep-ms", type=int, default=500)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("swift_liger.bench needs a CUDA GPU")
    suites = sorted(SUITES) if args.suite == "all" else [args.suite]
    for suite in suites:
        results = []
        for make_cases in SUITES[suite]:
            try:
                cases = make_cases()
            except Exception as exc:
                print(f"[{suite}] {make_cases.__name__} unavailable: {exc}", flush=True)
                continue
            for case in cases:
                if args.only and args.only not in case.op:
                    continue
                rs = harness.run_case(case, rep_ms=args.rep_ms)
                for r in rs:
                    print(f"{r.op:16s} {r.shape:34s} {r.impl:14s} "
                          + (f"{r.ms:8.3f} ms  peak {r.peak_extra_gib:6.3f} GiB  errs "
                             + " ".join(f"{e:.1e}" for e in r.rel_errs if e is not None)
                             if r.ms is not None else f"failed: {r.error}"), flush=True)
                results += rs
        stem = suite if not args.only else f"{suite}_{args.only}"
        md = harness.write(args.out, stem, TITLES[suite], results)
        print(md, flush=True)


if __name__ == "__main__":
    main()
