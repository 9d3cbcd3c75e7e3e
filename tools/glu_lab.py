"""Is SwiGLU's bimodal time at 16384x28672 (1.74 / 1.93 ms out of place) a property of the run or of the memory?

    python3 tools/glu_lab.py [--reps 5]

The same case is timed `reps` times in one process (CUDA-graph replay, fresh inputs each time), alternately with
the caching allocator emptied first and with a 3 GiB block held in front of it, so the inputs and outputs land at
other addresses. Prints one line per implementation and repetition; writes glu_lab.json.
"""
import argparse
import json
import os

import torch

from swift_liger.bench import harness, kernels

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=5)
p.add_argument("--out", default=os.environ.get("OUT", "."))
args = p.parse_args()
rows = []
hold = None
for rep in range(args.reps):
    shifted = rep % 2 == 1
    torch.cuda.empty_cache()
    hold = torch.empty(3 << 30, dtype=torch.uint8, device="cuda") if shifted else None
    case = kernels.glu_case("swiglu", 16384, 28672)
    case.impls = {k: v for k, v in case.impls.items() if k != "eager"}
    for r in harness.run_case(case, warmup_ms=50, rep_ms=300, graphs=True):
        row = {"rep": rep, "held_3GiB": shifted, "impl": r.impl, "ms": r.ms, "gbps": r.gbps, "error": r.error}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del hold
harness.write_json(os.path.join(args.out, "glu_lab.json"), {"environment": harness.environment(), "rows": rows})
