"""Sweep launch configurations through the benchmark harness (fresh inputs per setting, same timing as the benchmarks).

    python3 tools/tune.py rms_norm cross_entropy rope qk_norm_rope glu   # [--eager]: host-inclusive timing
    (also: rms_fp32, qk_loop: the fp32 RMSNorm rows at <= 2048 columns, the QK-norm+RoPE head-loop layouts)

A point forces fields of a kernel module's launch configurations (``swift_liger.ops._common.set_launch_override``,
per launch kind); AUTO leaves a field to the module's ``launch_config``. The override stays set through the
backward, which the harness runs after the timed function returns. Each point's fwd+bwd is timed as one CUDA graph
replay (kernel time: eager timings of sub-millisecond ops measure the host on the lent H200).
"""
import itertools
import sys

import torch

from swift_liger.bench import harness, kernels
from swift_liger.ops import _common, cross_entropy_kernel, qk_norm_rope_kernel, rms_norm_kernel, swiglu_kernel
from swift_liger.ops import rope_kernel as rope

AUTO = "auto"   # grid value: keep launch_config's choice for this field

_ACTIVE = {}  # (module name, kind) -> fields applied last


def with_settings(module, settings, fn):
    """fn run with ``settings`` ({kind: {field: value}}) forced. The override stays set after fn returns: the
    harness runs the backward outside fn (torch.autograd.backward on its outputs), and the backward launchers read
    it then. Each implementation is benchmarked to the end before the next one runs, so the next wrapper's call
    sets its own fields. Occupancy caches are cleared only when the settings change (not in the timed loop)."""
    def run(inputs):
        for kind, fields in settings.items():
            key = (module.__name__, kind)
            if _ACTIVE.get(key) != fields:
                _common.set_launch_override(module, kind, **fields)
                if hasattr(module, "_OCCUPANCY"):
                    module._OCCUPANCY.clear()
                _ACTIVE[key] = fields
        return fn(inputs)
    return run


GRAPHS = "--eager" not in sys.argv


def sweep(case, module, grid, ours):
    """grid: {kind: {field: [values]}} (all combinations) or a list of such dicts (their combinations, one after
    another). kind is a key of ``module.LAUNCH_CONFIGS`` (None for single-kernel modules)."""
    grids = grid if isinstance(grid, list) else [grid]
    kinds = {kind for g in grids for kind in g}
    impls = {"default": with_settings(module, {kind: {} for kind in kinds}, ours)}
    for g in grids:
        axes = [(kind, field, values) for kind, fields in g.items() for field, values in fields.items()]
        for point in itertools.product(*(values for _, _, values in axes)):
            settings = {kind: {} for kind in kinds}
            for (kind, field, _), v in zip(axes, point):
                if v != AUTO:
                    settings[kind][field] = v
            label = " ".join(f"{kind + '.' if kind else ''}{field}={v}" for (kind, field, _), v in zip(axes, point))
            impls[label] = with_settings(module, settings, ours)
    case.impls = impls
    try:
        rows = harness.run_case(case, warmup_ms=50, rep_ms=200, graphs=GRAPHS)
    finally:
        for kind in kinds:
            _common.set_launch_override(module, kind)
            _ACTIVE.pop((module.__name__, kind), None)
    for r in sorted(rows, key=lambda r: r.ms or 1e9):
        print(f"{case.op:14s} {r.ms if r.ms else float('nan'):8.4f} ms {r.gbps or 0:6.0f} GB/s  {r.impl}"
              + (f"  {r.error}" if r.error else ""), flush=True)


def _qk_norm_rope(i):
    m = qk_norm_rope_kernel
    return m.qk_norm_rope(i["q"], i["k"], i["wq"], i["wk"], i["cos"], i["sin"])


def qk_head_loop():
    """QK-norm+RoPE's forward at the layouts that loop over head blocks (40 / 64 query heads at D=256): warps."""
    m = qk_norm_rope_kernel
    for hq in (40, 64):
        sweep(kernels.qk_norm_rope_case(1, 16384, hq, 8, 256), m, {"fwd": {"num_warps": [2, 4, 8]}}, _qk_norm_rope)


def main(ops):
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if "rms_norm" in ops:
        # Backward: register prefetch (one tile ahead) and warps; grid from the launcher's rule (occupancy, ~4 tiles
        # per program). tools/rms_lab.py varies the grid itself.
        m = rms_norm_kernel
        for n, h, res in [(16384, 4096, False), (16384, 8192, False), (16384, 2048, False), (65536, 1024, False),
                          (1024, 1024, False), (4096, 1024, False), (16384, 4096, True)]:
            case = kernels.rms_norm_case(n, h, res)
            ours = ((lambda i: m.rms_norm(i["x"], i["w"], 1e-6, residual=i["r"])) if res else
                    (lambda i: m.rms_norm(i["x"], i["w"], 1e-6)))
            sweep(case, m, {"bwd": {"prefetch": [True, False], "num_warps": [4, 8, 16, 32]}}, ours)
    if "rms_fp32" in ops:
        # fp32 inputs at <= 1024 columns: the bf16 rule (4 warps, prefetch) takes 255 registers here.
        m = rms_norm_kernel
        for n, h in [(1024, 1024), (16384, 1024), (65536, 1024), (16384, 2048)]:
            case = kernels.rms_norm_case(n, h, dtype=torch.float32)
            sweep(case, m, {"bwd": {"prefetch": [True, False], "num_warps": [4, 8]}},
                  lambda i: m.rms_norm(i["x"], i["w"], 1e-6))
    if "qk_loop" in ops and "qk_norm_rope" not in ops:
        qk_head_loop()
    if "cross_entropy" in ops:
        # Vocabulary loop: block and warps (forward and backward share the config).
        m = cross_entropy_kernel
        for v in (32768, 128256):
            case = kernels.cross_entropy_case(8192, v)
            sweep(case, m, {None: {"block_v": [4096, 8192], "num_warps": [4, 8, 16]}},
                  lambda i: m.cross_entropy(i["logits"], i["labels"]))
    if "rope" in ops:
        m = rope
        for layout in [(32, 8, 128), (8, 8, 128), (16, 8, 64)]:
            case = kernels.rope_case(1, 16384, *layout)
            sweep(case, m, {None: {"num_warps": [1, 2, 4, 8]}},
                  lambda i: m.apply_rope(i["q"], i["k"], i["cos"], i["sin"]))
    if "qk_norm_rope" in ops:
        m = qk_norm_rope_kernel
        sweep(kernels.qk_norm_rope_cases()[0], m,
              {"fwd": {"num_warps": [4, 8]},
               "bwd": {"num_warps": [4, 8, 16], "programs": [2 * sms, 4 * sms, 8 * sms], "block_hq": [AUTO, 8]}},
              _qk_norm_rope)
        qk_head_loop()
    if "glu" in ops:
        m = swiglu_kernel
        for op, i_ in [("geglu", 4864), ("swiglu", 4864), ("geglu", 14336)]:
            case = kernels.glu_case(op, 16384, i_)
            fn = getattr(m, op)
            sweep(case, m, {None: {"block": [1024, 2048, 4096, 8192], "num_warps": [4, 8, 16]}},
                  lambda i, fn=fn: fn(i["a"], i["b"]))


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--")] or ["rms_norm", "cross_entropy", "rope", "glu"])
