"""Sweep launch settings through the benchmark harness (fresh inputs per setting, same timing as the benchmarks).

    python3 tools/tune2.py rms_norm rope qk_norm_rope
"""
import importlib
import itertools
import sys

import torch

from swift_liger.bench import harness, kernels


def with_settings(module, settings, fn):
    def run(inputs):
        saved = {}
        for k, v in settings.items():
            if isinstance(getattr(module, "TUNING", None), dict) and k in module.TUNING:
                saved[k] = ("T", module.TUNING[k])
                module.TUNING[k] = v
            else:
                saved[k] = ("A", getattr(module, k))
                setattr(module, k, v)
        if hasattr(module, "_OCCUPANCY"):
            module._OCCUPANCY.clear()
        try:
            return fn(inputs)
        finally:
            for k, (kind, v) in saved.items():
                if kind == "T":
                    module.TUNING[k] = v
                else:
                    setattr(module, k, v)
    return run


def sweep(case, module, grid, ours):
    impls = {"default": case.impls["swift_liger"]}
    for values in itertools.product(*grid.values()):
        s = dict(zip(grid, values))
        impls[" ".join(f"{k}={v}" for k, v in s.items())] = with_settings(module, s, ours)
    case.impls = impls
    rows = harness.run_case(case, warmup_ms=50, rep_ms=200)
    for r in sorted(rows, key=lambda r: r.ms or 1e9):
        print(f"{case.op:14s} {r.ms if r.ms else float('nan'):8.4f} ms {r.gbps or 0:6.0f} GB/s  {r.impl}"
              + (f"  {r.error}" if r.error else ""), flush=True)


def main(ops):
    if "rms_norm" in ops:
        m = importlib.import_module("swift_liger.ops.rms_norm")
        case = kernels.rms_norm_cases()[0]
        sweep(case, m, {"BWD_TILE_ELEMS": [4096, 8192, 16384], "BWD_NUM_WARPS": [16, 32],
                        "BWD_PROGRAMS_PER_SM": [None, 2]},
              lambda i: m.rms_norm(i["x"], i["w"], 1e-6))
    if "rope" in ops:
        m = importlib.import_module("swift_liger.ops.rope")
        case = kernels.rope_cases()[0]
        sweep(case, m, {"num_warps": [2, 4, 8], "programs_per_sm": [None, 16], "tile_elems": [2048, 4096]},
              lambda i: m.apply_rope(i["q"], i["k"], i["cos"], i["sin"]))
    if "qk_norm_rope" in ops:
        m = importlib.import_module("swift_liger.ops.qk_norm_rope")
        case = kernels.qk_norm_rope_cases()[0]
        sweep(case, m, {"fwd_num_warps": [4, 8], "bwd_num_warps": [4, 8, 16], "bwd_programs_per_sm": [2, 4, 8],
                        "bwd_tile_elems": [1024, 4096]},
              lambda i: m.qk_norm_rope(i["q"], i["k"], i["wq"], i["wk"], i["cos"], i["sin"]))


if __name__ == "__main__":
    main(sys.argv[1:] or ["rms_norm", "rope", "qk_norm_rope"])
