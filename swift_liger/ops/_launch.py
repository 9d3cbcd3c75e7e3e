"""Direct launches of compiled Triton kernels, for every launch site of ours that a step repeats.

``kernel[grid](*args, **meta)`` costs 16-18 us of host time per launch on the H200 host against ~7 us for an aten op
(docs/benchmarks/host_lab_h200.md): on every call Triton binds the arguments, specializes each one in C++, builds a
cache key from the specialization and the options, and fills launch metadata for its hooks. Eager decode and training
steps of small models are host-bound (a Qwen2.5-1.5B LoRA step at 2k tokens issues ~7000 launches in ~250 ms of host
time against ~90 ms of kernels: docs/benchmarks/train_step_h200.md), so ``FastLaunch`` keeps, per call site, the
compiled kernel of every argument signature it has launched and calls that kernel's launcher directly.

The signature is what Triton specializes on: per tensor its dtype and whether its address is 16-byte aligned, per
int whether it is 0, 1 or a multiple of 16 and its integer width, a bool's value, the class of a float or None (any
other argument type sends the call through ``kernel[grid]``), plus the constexpr and option keywords by value. So two
calls that share our key share Triton's compiled kernel. A new signature launches through ``kernel[grid]`` (compiling
if needed) and is remembered.

Plain ``kernel[grid]`` is used instead: under ``TRITON_INTERPRET=1``; with ``SWIFT_LIGER_FAST_LAUNCH=0``; for Triton
versions whose launcher call has not been read for this (3.6 to 3.9 have: their ``JITFunction.run`` ends in the same
call made here; tests/ops/test_launch.py checks that, the launcher's parameters and that our key refines Triton's
argument specialization against the installed Triton, and on the H200, under 3.6 and 3.9, that a hit launches the
kernel Triton picks); while launch hooks or pre-run hooks are installed (e.g. Triton's proton profiler); and for a
call site that passes a runtime argument by keyword.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from . import _common

# Launcher calls read from triton/runtime/jit.py (JITFunction.run) and compiler.py (CompiledKernel.__getitem__):
# run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
# *every parameter in signature order, constexprs included).
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"))
_I32 = 1 << 31
_I64 = 1 << 63


def _triton_minor() -> Tuple[int, int]:
    try:
        import triton
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except Exception:   # no Triton, or a version string we cannot read
        return (0, 0)


def _runtime_knobs():
    try:
        from triton import knobs
        return knobs.runtime
    except Exception:
        return None


ENABLED = (not _common.INTERPRET and os.environ.get("SWIFT_LIGER_FAST_LAUNCH", "1").strip() != "0"
           and _triton_minor() in SUPPORTED_TRITON)
_KNOBS = _runtime_knobs() if ENABLED else None


def _no_hooks() -> bool:
    """No launch hook installed: Triton 3.6 to 3.9 hold them in (possibly empty) HookChains; older ones use None."""
    k = _KNOBS
    if k is None:
        return True
    enter, leave = k.launch_enter_hook, k.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class Unkeyed(Exception):
    """An argument whose specialization this module does not model (such a call launches through kernel[grid])."""


def signature(args: tuple) -> tuple:
    """What Triton specializes on, per positional argument (see the module docstring)."""
    out = []
    for a in args:
        c = a.__class__
        if c is int:
            if a == 1 or a == 0:
                out.append(a)
            else:
                width = 0 if -_I32 <= a < _I32 else (1 if -_I64 <= a < _I64 else 2)
                out.append((width, not a & 15))
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, not a.data_ptr() & 15))
        elif c is float or a is None:
            out.append(c)
        elif c is bool:   # not just `a`: True == 1 and False == 0 as keys, which Triton specializes apart
            out.append((bool, a))
        else:   # e.g. a numpy integer: Triton may specialize on its value in ways not modelled here
            raise Unkeyed(c.__name__)
    return tuple(out)


_INSTANCES: "weakref.WeakSet[FastLaunch]" = weakref.WeakSet()


class _Ahead:
    """compile_ahead's state: the thread pool, the compiles submitted, the (call site, signature) pairs seen."""

    def __init__(self, workers: int):
        import concurrent.futures   # lazy: only for a compile-ahead pass
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swift_liger_jit")
        self.futures: list = []
        self.seen: set = set()
        self.failed = 0


# The active compile_ahead (None: every FastLaunch launches). A module global, not a context variable: autograd runs
# a backward's launches in its own thread, and those must be turned into compiles too.
_AHEAD: Optional[_Ahead] = None


def compiling_ahead() -> bool:
    """True inside compile_ahead's block, where our kernels compile instead of launching."""
    return _AHEAD is not None


@contextlib.contextmanager
def compile_ahead(workers: int = 8) -> Iterator[_Ahead]:
    """Inside the block no FastLaunch launches anything, from any thread: the kernel each call would run is compiled
    on a pool of ``workers`` threads instead (``JITFunction.warmup`` with the call's arguments: the same
    specialization, so the later launch finds it built), several at once, and leaving the block waits for all of them.
    Triton's compiles spend much of their time outside the GIL (LLVM, ptxas): ~1.45x on 2 CPU cores here, measured
    with 4 RMSNorm variants. The skipped launches leave their outputs unwritten: only code whose host side never reads
    them (no .item(), no data-dependent shapes) may run inside, and no other thread may be launching our kernels
    meanwhile (theirs would be skipped too). A compile that fails is counted and left to the real launch, which raises
    it. Not under the Triton interpreter (nothing compiles there): the block runs launches."""
    global _AHEAD
    if _AHEAD is not None or _common.INTERPRET:
        yield _AHEAD
        return
    ahead = _Ahead(max(1, min(workers, os.cpu_count() or 1)))
    _AHEAD = ahead
    try:
        yield ahead
    finally:
        _AHEAD = None
        for f in ahead.futures:
            try:
                f.result()
            except Exception:   # noqa: BLE001 - the real launch compiles again and raises it
                ahead.failed += 1
        ahead.pool.shutdown(wait=True)


_KEY_THREAD = None   # the thread warm_cache_key started (one per process)
KEY_FORK_WAIT_S = 10.0   # a fork waits this long at most for it (it takes ~0.4 s)


def warm_cache_key() -> Optional[Any]:
    """Start, once per process, a daemon thread computing Triton's cache key of its own installation
    (``triton.runtime.cache.triton_key``, cached for the process: a sha256 of libtriton and of the compiler's and
    language's sources). Every kernel's first launch needs it, loaded from the disk cache or not; unwarmed it was
    0.37 s of the first training step at Qwen2.5-0.5B, 1 x 2k on the H200 host (0.31 s in hashlib, 0.07 s reading
    files; SWIFT_LIGER_PROFILE_FIRST_STEP's cProfile in docs/benchmarks/train_cli_grid_h200.md). Started when a model
    is patched, it runs beside the adapter wrapping, the dataset's encoding and the trainer's set-up; hashlib and
    file reads release the GIL. Should a launch come first, it computes the key itself (the cache takes either
    result: same value). A fork waits for the thread first, up to KEY_FORK_WAIT_S (the thread may hold an import
    lock while it walks Triton's packages, and a child forked then would inherit it held; the bound keeps a fork made
    while the forking thread holds a lock the key thread waits for from waiting forever). Returns the thread, or None
    under the interpreter or where Triton has no such function."""
    global _KEY_THREAD
    if _KEY_THREAD is not None or _common.INTERPRET:
        return _KEY_THREAD
    try:
        from triton.runtime.cache import triton_key   # lazy: Triton's internals, read only to warm them
    except Exception:   # another Triton layout: its first launch pays as before
        return None
    import threading   # lazy: only where a model is patched for CUDA

    def warm():
        try:
            triton_key()
        except Exception:   # noqa: BLE001 - the first launch computes it again and raises what it raises
            pass
    _KEY_THREAD = threading.Thread(target=warm, name="swift_liger_triton_key", daemon=True)
    _KEY_THREAD.start()
    if hasattr(os, "register_at_fork"):   # dataset workers and DataLoader workers fork
        os.register_at_fork(before=functools.partial(_KEY_THREAD.join, KEY_FORK_WAIT_S))
    return _KEY_THREAD


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Every FastLaunch goes through ``kernel[grid]`` inside the block (A/B timing of the launch path)."""
    saved = [(fl, fl._plain) for fl in list(_INSTANCES)]
    for fl, _ in saved:
        fl._plain = True
    try:
        yield
    finally:
        for fl, plain in saved:
            fl._plain = plain


class FastLaunch:
    """``FastLaunch(kernel).launch(grid, *args, **meta)`` does what ``kernel[grid](*args, **meta)`` does.

    One instance per call site: runtime arguments positional, constexprs and options (num_warps, ...) by keyword.
    """

    __slots__ = ("kernel", "_cache", "_plain", "hits", "misses", "__weakref__")

    def __init__(self, kernel):
        self.kernel = kernel
        self._cache: Dict[tuple, tuple] = {}
        self._plain = not ENABLED   # True: every call goes through kernel[grid]
        self.hits = 0
        self.misses = 0
        _INSTANCES.add(self)

    def compiled(self, grid: tuple, *args, **meta):
        """The compiled kernel a hit for these arguments would launch (None before their first launch)."""
        entry = self._cache.get((_current_device(), tuple(meta.items()), signature(args)))
        return None if entry is None else entry[4]

    def launch(self, grid: tuple, *args, **meta) -> None:
        if _AHEAD is not None:
            self._compile_ahead(_AHEAD, grid, args, meta)
            return
        if self._plain:
            self.kernel[grid](*args, **meta)
            return
        dev = _current_device()
        try:
            key = (dev, tuple(meta.items()), signature(args))
        except Unkeyed:
            self.kernel[grid](*args, **meta)
            return
        hit = self._cache.get(key)
        if hit is not None and _no_hooks() and not self.kernel.pre_run_hooks:
            run, function, packed, consts, _ = hit
            n = len(grid)
            run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(dev), function, packed,
                None, None, None, *args, *consts)
            self.hits += 1
            return
        compiled = self.kernel[grid](*args, **meta)
        self.misses += 1
        if hit is None:
            entry = self._entry(compiled, len(args), meta)
            if entry is None:
                self._plain = True
            else:
                self._cache[key] = entry

    def _compile_ahead(self, ahead: _Ahead, grid: tuple, args: tuple, meta: Dict[str, Any]) -> None:
        """Under compile_ahead: this call's kernel compiled on the pool (once per call site and signature), nothing
        launched."""
        dev = _current_device()
        try:
            key = (dev, tuple(meta.items()), signature(args))
        except Unkeyed:
            key = None
        if key is not None and (key in self._cache or (id(self), key) in ahead.seen):
            return
        if key is not None:
            ahead.seen.add((id(self), key))
        kernel = self.kernel

        def build():   # Triton compiles for the current device: the caller's, not the pool thread's default
            with torch.cuda.device(dev) if torch.cuda.is_available() else contextlib.nullcontext():
                kernel.warmup(*args, grid=grid, **meta)
        ahead.futures.append(ahead.pool.submit(build))

    def _entry(self, compiled, n_args: int, meta: Dict[str, Any]) -> Optional[tuple]:
        """(launcher, function, packed metadata, the parameters after the positional ones in signature order, the
        compiled kernel), or None when this call site cannot be replayed (a runtime argument by keyword, an unknown
        compiled-kernel layout)."""
        kernel = self.kernel
        names = getattr(kernel, "arg_names", None)
        params = getattr(kernel, "params", None)
        function = getattr(compiled, "function", None)
        if names is None or params is None or function is None or not hasattr(compiled, "packed_metadata"):
            return None
        if any(name not in OPTIONS and name not in names[n_args:] for name in meta):
            return None
        consts = []
        for p in params[n_args:]:
            if not p.is_constexpr:
                return None
            if p.name in meta:
                consts.append(meta[p.name])
            elif getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty:
                consts.append(p.default)
            else:
                return None
        return compiled.run, function, compiled.packed_metadata, tuple(consts), compiled
