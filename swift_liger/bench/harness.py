"""The benchmark harness: what every bench module and tools/ lab shares.

* environment capture (`environment`: GPU, versions, date, command) and `GiB`, `DTYPES`, `fmt`, `describe`;
* child processes (`run_child`: one command in a session of its own, timed out and ended with all it started);
* reports (`write_report`: JSON + markdown, `header` / `versions_line` for the markdown's first lines);
* side-by-side timing of one op's implementations (`Case`, `run_case`, `write`): each case builds fresh random
  inputs once, then for every implementation ("swift_liger", "eager", "torch.compile", "liger", "cce") times
  forward+backward with `triton.testing.do_bench` (median), measures peak extra memory over the inputs (gradients of
  the inputs included), checks the result against eager, and reports GB/s over the op's minimum bytes (or TFLOP/s
  over its minimum FLOPs).

Model shapes and builders are in `swift_liger.bench.shapes`.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
from triton.testing import do_bench

GiB = 1024 ** 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Versions every environment records (distribution names; the keys have "_" for "-").
PACKAGES = ("triton", "transformers", "peft", "ms-swift", "liger-kernel", "cut-cross-entropy")


def fmt(v, spec: str) -> str:
    """`format(v, spec)`, or "—" for a missing value."""
    return "—" if v is None else format(v, spec)


def describe(exc: BaseException, limit: int = 160) -> str:
    """"Type: first line of the message" (at most ``limit`` characters of it), for a result row."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit]}" if text else type(exc).__name__


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free(device) -> None:
    """Collect garbage and, on CUDA, hand the allocator's cached blocks back (so the next peak is its own)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def counted(model) -> Optional[Dict[str, Any]]:
    """swift_liger's call counters of a patched model, JSON-safe (None when empty, an error entry if they fail:
    a diagnostic, never a reason to lose a row)."""
    from ..patcher import call_counts  # lazy: the patcher imports torch and the fusions; only a run needs it

    try:
        counts = call_counts(model)
        return json.loads(json.dumps(counts, default=str)) if counts else None
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------------------------------------------ environment

def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def package_version(dist: str) -> Optional[str]:
    """An installed distribution's version; "<__version__> (source tree)" for a module importable without
    distribution metadata (a checkout on the path); None when neither."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        try:
            module = importlib.import_module(dist.replace("-", "_"))
        except Exception:
            return None
        return f"{getattr(module, '__version__', '?')} (source tree)"


def versions(dists: Iterable[str]) -> Dict[str, Optional[str]]:
    return {d: package_version(d) for d in dists}


def gpu_name(device=None) -> Optional[str]:
    """The CUDA device's name (None without CUDA, or when `device` is not a CUDA device)."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def command(prog: Optional[str] = None, argv: Optional[Sequence[str]] = None) -> str:
    """`prog` and the arguments (sys.argv[1:] by default), shell-quoted: how to run it again. prog defaults to
    "python3 <script>", as the tools/ labs run."""
    prog = prog or f"python3 {os.path.relpath(sys.argv[0])}"
    return " ".join([prog, shlex.join(list(sys.argv[1:] if argv is None else argv))]).rstrip()


def environment(prog: Optional[str] = None, argv: Optional[Sequence[str]] = None, *, device=None,
                packages: Sequence[str] = ()) -> Dict[str, Any]:
    """What a result was measured with: date (UTC), command, python, torch (CUDA), GPU, the versions of PACKAGES and
    `packages` (keys with "_"), SWIFT_LIGER_BACKEND, and the device when one is given."""
    env: Dict[str, Any] = {
        "date": utc_now(), "command": command(prog, argv), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu_name(device)}
    env.update({d.replace("-", "_"): v for d, v in versions(PACKAGES + tuple(packages)).items()})
    env["swift_liger_backend"] = os.environ.get("SWIFT_LIGER_BACKEND", "auto")
    if device is not None:
        env["device"] = str(device)
    return env


# -------------------------------------------------------------------------------------------------- child processes

@dataclasses.dataclass
class Child:
    returncode: Optional[int]   # negative: killed by that signal
    stdout: str                 # "" when written to a log file
    stderr: str
    timed_out: bool
    seconds: float


_RUNNING: List[subprocess.Popen] = []   # the children in flight


def _kill(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """End a child and what it started (its own session): SIGTERM and `grace` seconds to exit first, then SIGKILL."""
    try:
        if grace > 0:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _on_signal(signum, frame):
    # an outer `timeout` signals our process group; the children run in sessions of their own, so end them here
    for proc in list(_RUNNING):
        _kill(proc)
    raise SystemExit(128 + signum)


def run_child(cmd: Sequence[str], *, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
              log_path: Optional[str] = None, grace: float = 0.0) -> Child:
    """`cmd` in a process of its own session, its output captured (text) or, with `log_path`, written there (stdout
    and stderr together). Past `timeout` seconds, or when this process is interrupted or gets SIGTERM / SIGHUP, the
    child and all it started are ended (see _kill). Always returns."""
    previous = {}
    try:   # signal handlers only exist in the main thread
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _on_signal)
    except ValueError:
        pass
    log = open(log_path, "w") if log_path else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(list(cmd), stdout=log or subprocess.PIPE,
                                stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        _RUNNING.append(proc)
        timed_out = False
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc, grace)
                out, err = proc.communicate()
        finally:
            if proc.poll() is None:   # interrupted (KeyboardInterrupt, SystemExit): never leave it running
                _kill(proc)
                proc.wait()
            _RUNNING.remove(proc)
    finally:
        if log:
            log.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return Child(proc.returncode, out or "", err or "", timed_out, time.perf_counter() - t0)


def last_json(text: str, prefix: str = "") -> Optional[dict]:
    """The JSON object on the last line of `text` that is `prefix` + "{...}" and parses; None if there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(prefix) and line[len(prefix):].startswith("{"):
            try:
                return json.loads(line[len(prefix):])
            except ValueError:
                continue
    return None


def tail(text: str, n: int = 4, limit: int = 600, skip: Optional[str] = None,
         prefer: Optional[Callable[[str], bool]] = None) -> str:
    """The last `n` non-blank lines of `text` (of those `prefer` picks, when it picks any; never those starting with
    `skip`), joined with " | ", at most `limit` characters (the end)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not (skip and ln.startswith(skip))]
    picked = [ln for ln in lines if prefer(ln)] if prefer else []
    return " | ".join((picked or lines)[-n:])[-limit:]


# ---------------------------------------------------------------------------------------------------------- reports

def write_json(path: str, data, indent: int = 1) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=indent, default=str)
    return path


def write_report(out_dir: str, stem: str, data, markdown: Optional[str] = None) -> Optional[str]:
    """`out_dir`/`stem`.json and, given, `stem`.md; returns the markdown."""
    write_json(os.path.join(out_dir, f"{stem}.json"), data)
    if markdown is not None:
        with open(os.path.join(out_dir, f"{stem}.md"), "w", encoding="utf-8") as f:
            f.write(markdown)
    return markdown


def versions_line(env: Dict[str, Any], *names: str, cuda: bool = True) -> str:
    """"GPU: … · torch … (CUDA …) · <name> <version> · … · date"; names: keys of `env`, "_" shown as "-"."""
    return " · ".join([f"GPU: {env.get('gpu')}", f"torch {env.get('torch')}"
                       + (f" (CUDA {env.get('cuda')})" if cuda else "")]
                      + [f"{n.replace('_', '-')} {env.get(n)}" for n in names] + [str(env.get("date"))])


def header(title: str, env: Dict[str, Any], *names: str, cuda: bool = True, command: Optional[str] = None) -> list:
    """A report's first markdown lines: the title, the versions line, the command."""
    return [f"# {title}", "", versions_line(env, *names, cuda=cuda), "",
            f"Command: `{command or env['command']}`", ""]


# ------------------------------------------------------------------------------------------------------- op timing

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
    pairs = [(o, g) for o, g in zip(outs, grads_cache[key]) if o.requires_grad]   # e.g. an entropy: compared only
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outs


def _leaves(inputs):
    return [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


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


def capture_graph(fn: Callable[[], Any], *, warmup: int = 3, before: Optional[Callable[[], Any]] = None):
    """fn() captured in a CUDA graph (replay it: fn's kernels without the host's share), after `warmup` calls on a
    side stream, as capture requires. `before()` runs ahead of every call and of the capture (e.g. clearing .grad)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if before:
                before()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before:
        before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_ms(fn, inputs, grads_cache, leaves, warmup_ms: int, rep_ms: int) -> float:
    """Median ms of one forward+backward captured in a CUDA graph: kernel time without the host's share (Python,
    autograd, launches), which at a few hundred microseconds per fwd+bwd can exceed the kernels' own time.
    Raises NotCapturable (before any capture) for an implementation that synchronises with the host."""
    sync = _host_sync(fn, inputs, grads_cache, leaves)
    if sync is not None:
        raise NotCapturable(sync)

    def clear():
        for leaf in leaves:
            leaf.grad = None
    graph = capture_graph(lambda: _fwd_bwd(fn, inputs, grads_cache), before=clear)
    ms = do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms


def run_case(case: Case, *, warmup_ms: int = 100, rep_ms: int = 500, graphs: bool = False) -> List[Result]:
    """graphs=True times each implementation as a CUDA graph replay (falling back to eager timing, marked
    graphed=False, where capture fails)."""
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
        inputs = leaves = None
        gc.collect()
        torch.cuda.empty_cache()
    del ref_out
    gc.collect()
    torch.cuda.empty_cache()
    return results


def to_markdown(title: str, env: dict, results: List[Result], notes: str = "") -> str:
    lines = header(title, env, "triton", "transformers", "liger_kernel", "cut_cross_entropy") + [
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
        lines.append(f"| {r.op} | {r.shape} | {r.impl} | {r.ms:.3f} | {speed} | {fmt(r.gbps, '.0f')} | "
                     f"{fmt(r.tflops, '.0f')} | {fmt(r.peak_extra_gib, '.3f')} | {fmt(r.grad_gib, '.3f')} | "
                     f"{fmt(r.max_rel_err, '.1e')} |")
    return "\n".join(lines) + "\n"


def write(out_dir: str, stem: str, title: str, results: List[Result], notes: str = "") -> str:
    env = environment("python -m swift_liger.bench")
    return write_report(out_dir, stem, {"environment": env, "notes": notes,
                                        "results": [dataclasses.asdict(r) for r in results]},
                        to_markdown(title, env, results, notes))
