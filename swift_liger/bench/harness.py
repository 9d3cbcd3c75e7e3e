"""Side-by-side timing of one op's implementations in one process.

Each case builds fresh random inputs once, then for every implementation ("swift_liger", "eager",
"torch.compile", "liger", "cce") times forward+backward with `triton.testing.do_bench` (median), measures peak
extra memory over the inputs (gradients of the inputs included), checks the result against eager, and reports
GB/s over the op's minimum bytes (or TFLOP/s over its minimum FLOPs).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
from typing import Callable, Dict, List, Optional

import torch

GiB = 1024 ** 3


@dataclasses.dataclass
class Case:
    op: str                      # "rms_norm"
    shape: str                   # human-readable shape, e.g. "16384x4096"
    make_inputs: Callable[[], dict]              # fresh tensors (leaves with requires_grad where trained)
    impls: Dict[str, Callable[[dict], object]]   # name -> fn(inputs) -> output tensor(s) (forward)
    min_bytes: float = 0.0        # forward+backward minimum bytes moved
    min_flops: float = 0.0        # forward+backward minimum FLOPs (matmul-bound ops)
    grad_bytes: float = 0.0       # bytes of the input gradients (reported beside peak memory)
    note: str = ""


@dataclasses.dataclass
class Result:
    op: str
    shape: str
    impl: str
    ms: Optional[float]
    gbps: Optional[float]
    tflops: Optional[float]
    peak_extra_gib: Optional[float]
    grad_gib: Optional[float]
    max_rel_err: Optional[float]
    error: Optional[str] = None
    rel_errs: Optional[list] = None   # per output, then per input gradient
    graphed: Optional[bool] = None    # graphs=True: timed as one CUDA graph replay (False: capture failed, eager)


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "loss") and isinstance(out.loss, torch.Tensor):
        return [out.loss]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _fwd_bwd(fn, inputs, grads_cache, pristine=None):
    outs = _outputs(fn(inputs))
    key = tuple((tuple(o.shape), o.dtype) for o in outs)
    if key not in grads_cache:
        if pristine is not None and key in pristine:
            grads_cache[key] = [g.clone() for g in pristine[key]]
        else:
            grads_cache[key] = [torch.randn_like(o) if o.dim() > 0 else torch.ones_like(o) for o in outs]
            if pristine is not None:
                pristine[key] = [g.clone() for g in grads_cache[key]]
    torch.autograd.backward(outs, grads_cache[key])
    return outs


def _leaves(inputs):
    return [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def describe(exc: BaseException, limit: int = 160) -> str:
    """"Type: first line of the message" (at most ``limit`` characters of it), for a result row."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit]}" if text else type(exc).__name__


class NotCapturable(RuntimeError):
    """An implementation synchronises with the host (``.item()``, ``nonzero``, ...): it cannot be captured."""


def _host_sync(fn, inputs, grads_cache, leaves) -> Optional[str]:
    """The first host synchronisation of one fwd+bwd (torch's sync debug mode), or None. Checked before a capture:
    a capture that fails part-way leaves the CUDA RNG in capture mode, and every later ``torch.randn`` on the GPU
    then raises ("Offset increment outside graph capture"), which would fail every following case."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for leaf in leaves:
            leaf.grad = None
        _fwd_bwd(fn, inputs, grads_cache)
        return None
    except RuntimeError as exc:
        return describe(exc)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def _graph_ms(fn, inputs, grads_cache, leaves, warmup_ms: int, rep_ms: int) -> float:
    """Median ms of one forward+backward captured in a CUDA graph: kernel time without the host's share (Python,
    autograd, launches), which at a few hundred microseconds per fwd+bwd can exceed the kernels' own time.
    Raises NotCapturable (before any capture) for an implementation that synchronises with the host."""
    from triton.testing import do_bench
    sync = _host_sync(fn, inputs, grads_cache, leaves)
    if sync is not None:
        raise NotCapturable(sync)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as capture requires
        for _ in range(3):
            for leaf in leaves:
                leaf.grad = None
            _fwd_bwd(fn, inputs, grads_cache)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fwd_bwd(fn, inputs, grads_cache)
    ms = do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms


def run_case(case: Case, *, warmup_ms: int = 100, rep_ms: int = 500, graphs: bool = False) -> List[Result]:
    """graphs=True times each implementation as a CUDA graph replay (falling back to eager timing, marked
    graphed=False, where capture fails)."""
    from triton.testing import do_bench

    results = []
    ref_out = None
    pristine: dict = {}   # output grads shared by all peers; each peer gets its own copy (Liger's RoPE backward
    for name, fn in case.impls.items():   # rotates its incoming grads in place)
        grads_cache: dict = {}
        # Fresh, identical inputs for every implementation: Liger's kernels write into their inputs (RoPE forward,
        # SwiGLU and cross-entropy backward), which would corrupt the next peer's inputs.
        torch.manual_seed(0)
        inputs = case.make_inputs()
        leaves = _leaves(inputs)
        try:
            outs = _fwd_bwd(fn, inputs, grads_cache, pristine)   # warm-up / compile, and correctness sample
            torch.cuda.synchronize()
            got = [o.detach().float().clone() for o in outs] + [l.grad.detach().float().clone() for l in leaves
                                                               if l.grad is not None]
            if ref_out is None:
                ref_out = got
                errs = [0.0] * len(got)
            else:
                errs = [_rel_err(a, b) if a.shape == b.shape else None for a, b in zip(got, ref_out)]
            err = max((e for e in errs if e is not None), default=None)
            del outs, got
            for leaf in leaves:
                leaf.grad = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _fwd_bwd(fn, inputs, grads_cache)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
            graphed, note = None, None
            if graphs:
                try:
                    ms, graphed = _graph_ms(fn, inputs, grads_cache, leaves, warmup_ms, rep_ms), True
                except Exception as exc:   # an implementation that syncs with the host is timed eagerly
                    torch.cuda.synchronize()
                    graphed = False
                    note = f"not graphed: {describe(exc)}"
            if not graphed:
                ms = do_bench(lambda: _fwd_bwd(fn, inputs, grads_cache), warmup=warmup_ms, rep=rep_ms,
                              grad_to_none=leaves, return_mode="median")
            results.append(Result(case.op, case.shape, name, ms,
                                  case.min_bytes / (ms * 1e-3) / 1e9 if case.min_bytes else None,
                                  case.min_flops / (ms * 1e-3) / 1e12 if case.min_flops else None,
                                  peak, case.grad_bytes / GiB if case.grad_bytes else None, err, note,
                                  rel_errs=errs, graphed=graphed))
        except Exception as exc:  # a peer that fails (OOM, missing feature) is reported, not fatal
            results.append(Result(case.op, case.shape, name, None, None, None, None, None, None, describe(exc)))
            torch.cuda.empty_cache()
        del inputs, leaves
        gc.collect()
        torch.cuda.empty_cache()
    del ref_out
    gc.collect()
    torch.cuda.empty_cache()
    return results


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "swift_liger.bench"] + sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for mod in ("triton", "transformers", "liger_kernel", "cut_cross_entropy"):
        try:
            from importlib.metadata import version
            info[mod] = version(mod.replace("_", "-"))
        except Exception:
            try:
                info[mod] = getattr(__import__(mod), "__version__", "present")
            except Exception:
                info[mod] = None
    return info


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def to_markdown(title: str, env: dict, results: List[Result], notes: str = "") -> str:
    lines = [f"# {title}", "",
             f"GPU: {env['gpu']} · torch {env['torch']} (CUDA {env['cuda']}) · triton {env['triton']} · "
             f"transformers {env['transformers']} · liger-kernel {env['liger_kernel']} · "
             f"cut-cross-entropy {env['cut_cross_entropy']} · {env['date']}", "",
             f"Command: `{env['command']}`", "",
             "Forward+backward, `triton.testing.do_bench` median. GB/s is over the op's minimum bytes "
             "(each input read once, each output written once, forward and backward); peak extra memory is "
             "measured over the inputs and includes the input gradients. err = relative L2 error vs eager over "
             "outputs and gradients.", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| op | shape | impl | ms | vs eager | GB/s | TFLOP/s | peak extra GiB | grads GiB | err |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    eager = {(r.op, r.shape): r.ms for r in results if r.impl == "eager" and r.ms}
    for r in results:
        if r.ms is None:
            lines.append(f"| {r.op} | {r.shape} | {r.impl} | failed: {r.error} | | | | | | |")
            continue
        e = eager.get((r.op, r.shape))
        speed = f"{e / r.ms:.2f}×" if e else "—"
        lines.append(f"| {r.op} | {r.shape} | {r.impl} | {r.ms:.3f} | {speed} | {_fmt(r.gbps, '.0f')} | "
                     f"{_fmt(r.tflops, '.0f')} | {_fmt(r.peak_extra_gib, '.3f')} | {_fmt(r.grad_gib, '.3f')} | "
                     f"{_fmt(r.max_rel_err, '.1e')} |")
    return "\n".join(lines) + "\n"


def write(out_dir: str, stem: str, title: str, results: List[Result], notes: str = "") -> str:
    env = environment()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"environment": env, "notes": notes, "results": [dataclasses.asdict(r) for r in results]}, f,
                  indent=1)
    md = to_markdown(title, env, results, notes)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(md)
    return md
