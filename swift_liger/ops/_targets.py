"""GPU targets the kernels are checked against offline (tests/ops/test_portability.py), and the helpers to check them.

Triton compiles for any CUDA architecture without a GPU: ``compile_for`` builds one kernel specialisation for one
target, ``resource_usage`` reads the registers / stack of the resulting cubin (cuobjdump bundled with Triton),
and ``check_limits`` compares them with the architecture's per-block limits. Pure module: imports triton only
when a function is called (never transformers); must run with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Dict, NamedTuple, Optional


class Arch(NamedTuple):
    cc: int                 # compute capability, e.g. 90
    gpus: str
    max_shared: int         # max (static + dynamic) shared memory per block, bytes (opt-in limit)
    bf16_native: bool       # hardware bf16 conversions / MMA (sm_80+); Triton emulates bf16 casts below that


KiB = 1024
# Register limits are the same on all five: 255 per thread, 64 Ki 32-bit registers per block (and per SM).
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 65536
ARCHS: Dict[str, Arch] = {
    "sm_75": Arch(75, "T4", 64 * KiB, False),
    "sm_80": Arch(80, "A100", 163 * KiB, True),
    "sm_86": Arch(86, "A10", 99 * KiB, True),
    "sm_89": Arch(89, "L4", 99 * KiB, True),
    "sm_90": Arch(90, "H100/H200", 227 * KiB, True),
}


def divisibility_hints(fn, signature: dict) -> dict:
    """ASTSource attrs marking every pointer and integer argument divisible by 16, as a launch marks them when the
    values are (16-byte aligned tensors, hidden sizes and strides that are multiples of 16). Without these hints
    Triton's pipeliner declines 16-bit loads (narrower than cp.async's 4 bytes), so an offline compile would
    under-report shared memory: decode attention's split kernel, D=256 bf16 on sm_90, 43 KB without, 141 KB with."""
    attrs = {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if not param.is_constexpr and (signature[name].startswith("*") or signature[name] in ("i32", "i64")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_for(fn, signature: dict, constexprs: dict, arch: str, num_warps: int = 4, num_stages: Optional[int] = None):
    """triton.compile one specialisation of the @triton.jit ``fn`` for ``arch`` (e.g. "sm_80"), with the
    divisibility hints of an aligned launch (``divisibility_hints``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {"num_warps": int(num_warps)}
    if num_stages is not None:
        options["num_stages"] = int(num_stages)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisibility_hints(fn, signature))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch].cc, 32), options=options)


def cuobjdump_path() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict:
    """{"regs", "stack", "shared"} of the (single) kernel in ``cubin``, from cuobjdump --dump-resource-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot parse cuobjdump output: {out!r}")
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "static_shared": int(m.group(3))}


def check_limits(arch: str, regs: int, shared: int, num_warps: int) -> list:
    """Violated per-block limits of ``arch`` (empty when the kernel can launch)."""
    a = ARCHS[arch]
    bad = []
    if shared > a.max_shared:
        bad.append(f"shared {shared} B > {a.max_shared} B")
    if regs > MAX_REGS_PER_THREAD:
        bad.append(f"regs {regs} > {MAX_REGS_PER_THREAD}")
    if regs * 32 * num_warps > MAX_REGS_PER_BLOCK:
        bad.append(f"regs*threads {regs * 32 * num_warps} > {MAX_REGS_PER_BLOCK}")
    return bad
