"""Shared plumbing for the ops: backend choice, argument checks, launch helpers.

Nothing here imports transformers or ms-swift.

Backends
--------
* CUDA tensors always run the Triton kernels (``SWIFT_LIGER_BACKEND=torch`` forces the reference).
* CPU tensors run the PyTorch reference implementation by default, with one notice per process.
  ``SWIFT_LIGER_BACKEND=triton`` together with ``TRITON_INTERPRET=1`` (set before the kernels are imported;
  the tests do this) runs the real Triton kernels on CPU through Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

import torch

from ..env import backend_from_env

logger = logging.getLogger("swift_liger")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


_backend_env = backend_from_env


@functools.lru_cache(maxsize=None)
def _notice_cpu_fallback() -> None:
    logger.warning(
        "swift_liger: tensors are on CPU, so ops run their PyTorch reference implementations. "
        "Set SWIFT_LIGER_BACKEND=triton and TRITON_INTERPRET=1 to run the Triton kernels in the interpreter.")


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run for tensors living where ``t`` lives."""
    env = _backend_env()
    if env == "torch":
        return False
    if t.is_cuda:
        return True
    if env == "triton":
        if not INTERPRET:
            raise RuntimeError(
                "SWIFT_LIGER_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before swift_liger.ops "
                "is imported")
        return True
    if not torch.compiler.is_compiling():   # a logging call would break the graph of a compiled layer
        _notice_cpu_fallback()
    return False


# ---------------------------------------------------------------------------------------------------------------
# Argument checks: every op validates before any work starts, naming the argument and what was expected.
# ---------------------------------------------------------------------------------------------------------------

def check_tensor(name: str, t, *, ndim: Optional[int] = None, min_ndim: Optional[int] = None,
                 dtypes: Optional[Iterable[torch.dtype]] = FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             f"all tensors must be on one device")


def check_same_dtype(**tensors: Optional[torch.Tensor]) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                            f"mixed dtypes are not supported")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Attention inputs: 4-D float tensors on one device, one dtype, contiguous last dim (shapes: the op's own)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    check_same_device(q=q, k=k, v=v)
    check_same_dtype(q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


# ---------------------------------------------------------------------------------------------------------------
# Launch helpers
# ---------------------------------------------------------------------------------------------------------------

def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def num_warps_for(block: int) -> int:
    """Warps per program for a row-wise kernel whose row block has ``block`` elements."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ---------------------------------------------------------------------------------------------------------------
# Launch configurations
#
# Every kernel module defines a frozen dataclass per kernel (its constexpr tile sizes, num_warps, num_stages, grid
# size where the grid is a choice), ``LAUNCH_CONFIGS = {kind: that class}`` (kind None when the module has one) and
# a pure ``launch_config(...)`` that picks the configuration from the shape and a device (a torch.device or a
# ``Target``). Benchmarks and tuners force fields through ``launch_override`` / ``set_launch_override``.
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Target:
    """What launch selection reads about a device. ``type`` is "cuda" for a GPU, anything else for the interpreter.

    cc: compute capability (90 = sm_90); sm_count: streaming multiprocessors (4 under the interpreter: a handful of
    programs); max_shared: opt-in shared memory per block, bytes (0 under the interpreter: no limit).
    """
    type: str
    cc: int = 0
    sm_count: int = 4
    max_shared: int = 0


INTERPRETER_TARGET = Target("cpu")


@functools.lru_cache(maxsize=None)
def _cuda_target(device_index: int) -> Target:
    props = torch.cuda.get_device_properties(device_index)
    shared = int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)
    return Target("cuda", props.major * 10 + props.minor, props.multi_processor_count, shared)


def target(device: Union[torch.device, Target]) -> Target:
    """The ``Target`` of a device (queried once per CUDA device); a ``Target`` is returned as is."""
    if isinstance(device, Target):
        return device
    if device.type != "cuda":
        return INTERPRETER_TARGET
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


_OVERRIDES: Dict[Tuple[str, Optional[str]], Dict[str, Any]] = {}


def _override_key(module, kind: Optional[str]) -> Tuple[str, Optional[str]]:
    configs = getattr(module, "LAUNCH_CONFIGS", None)
    if not configs:
        raise TypeError(f"{getattr(module, '__name__', module)!r} defines no LAUNCH_CONFIGS")
    if kind not in configs:
        raise ValueError(f"{module.__name__} has launch kinds {sorted(configs, key=str)}, got {kind!r}")
    return module.__name__, kind


def set_launch_override(module, kind: Optional[str] = None, **fields) -> None:
    """Force ``fields`` of every configuration ``module.launch_config`` returns for ``kind``, at every shape,
    until the next call for (module, kind); no fields clears it. Values are used verbatim (the caller keeps them
    valid for the shapes it runs, e.g. rms_norm's block_h >= H)."""
    key = _override_key(module, kind)
    names = {f.name for f in dataclasses.fields(module.LAUNCH_CONFIGS[kind])}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"{module.LAUNCH_CONFIGS[kind].__name__} has no field(s) {', '.join(unknown)}")
    if fields:
        _OVERRIDES[key] = dict(fields)
    else:
        _OVERRIDES.pop(key, None)


@contextlib.contextmanager
def launch_override(module, kind: Optional[str] = None, **fields) -> Iterator[None]:
    """``with launch_override(rms_norm_kernel, "bwd", num_warps=8): ...``: set_launch_override for the block (added
    to an enclosing override of the same kind), the previous state restored on exit."""
    key = _override_key(module, kind)
    saved = _OVERRIDES.get(key)
    set_launch_override(module, kind, **{**(saved or {}), **fields})
    try:
        yield
    finally:
        if saved is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = saved


def apply_override(module_name: str, kind: Optional[str], cfg):
    """``cfg`` with the forced fields of (module, kind) replaced; called at the end of every launch_config."""
    fields = _OVERRIDES.get((module_name, kind))
    return dataclasses.replace(cfg, **fields) if fields else cfg


_CONTEXT_THREADS: set = set()


def bind_cuda_context(t: torch.Tensor) -> None:
    """Make the primary CUDA context current in this thread, once per thread, before a backward's first cuBLAS call.

    Autograd runs CUDA backwards in its own thread, which torch starts without a current context; a torch kernel
    launch or a Triton launch binds one, a cuBLAS call warns first ("Attempting to run cuBLAS, but there was no
    current CUDA context!", once per process, in every `swift sft --use_liger` log) and then binds it. The LoRA
    backward's first op is a cuBLAS product, and under graph_layers it is the first node the thread runs. One
    1-element fill launched here binds the context quietly (under graph capture it is one more node of one graph)."""
    if t.is_cuda:
        tid = threading.get_ident()
        if tid not in _CONTEXT_THREADS:
            torch.empty(1, device=t.device).zero_()
            _CONTEXT_THREADS.add(tid)


def records_grad(*tensors) -> bool:
    """Whether autograd would record an op on these inputs (grad mode on and one of them requires grad). Ops call
    their forward launcher directly otherwise: torch.autograd.Function.apply costs ~8 us of host time per call
    even under no_grad (2-core x86 CPU), which inference (each decode step, every layer) pays for nothing."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def compiled_or_eager(op_name: str, eager: Callable) -> Callable:
    """Return the registered custom op while torch.compile traces, else the plain Python launcher.

    The custom op lets a compiled region keep the kernel as one opaque node (no graph break); in eager
    mode calling the launcher directly skips ~10 us of dispatcher overhead per call.
    """
    if torch.compiler.is_compiling():
        namespace, name = op_name.split("::")
        return getattr(getattr(torch.ops, namespace), name)
    return eager


# Tests set SWIFT_LIGER_POISON=1: every output buffer a kernel is meant to fill starts as NaN (ints as -1), so an
# element the kernel forgot to write fails the comparison instead of passing on a lucky zero.
POISON = os.environ.get("SWIFT_LIGER_POISON", "0") == "1"


def new_empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate an output buffer that the kernel writes completely (poisoned under SWIFT_LIGER_POISON=1)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


def new_empty_like(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    out = torch.empty_like(t, dtype=dtype or t.dtype)
    if POISON:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out
