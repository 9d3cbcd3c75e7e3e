"""Hand a sharded lm_head to the fused linear cross-entropy op, with gradients flowing back the engine's way.

The fused loss reads ``lm_head.weight`` outside ``lm_head.forward`` (the patched head returns hidden states), so the
engine's own gather hooks have not run for it:

* DeepSpeed ZeRO-3: a partitioned parameter has ``ds_id`` / ``ds_status`` / ``ds_shape`` and shape [0] outside a
  gather. Gradients reach ZeRO-3 through the hook it put on the parameter's AccumulateGrad node, so the graph
  must use the parameter itself (or a view of it), never a copy.
* FSDP2 (``fully_shard``): parameters are DTensors (Shard(0)) at rest. Inside the forward of the FSDP unit that owns
  them they are swapped for plain unsharded tensors, so when the head is part of the root unit (the usual set-up)
  ``lm_head.weight`` is already a plain tensor while the loss runs. When ``lm_head`` is its own unit it is a DTensor.

Two ways to get a full [V, H] weight:

``call_through_module(module, fn, ...)`` (preferred, used by :func:`lm_head_cross_entropy`): runs ``fn`` as
    ``module.forward`` for one call, so the engine's hooks gather the parameters before, release them after, gather
    them again for backward and reduce the gradients with the engine's own settings (FSDP2 mixed precision,
    reduce dtype and divide factor; ZeRO-3 reduce-scatter). Nothing is held between forward and backward.
``gathered_lm_head(...)`` / ``gathered_lm_head_weight(...)`` (context managers):
    ZeRO-3: ``GatheredParameters(modifier_rank=None)`` when ``ds_status`` is not AVAILABLE, yielding the parameter
    itself. A frozen head (LoRA) is released when the block exits. A trainable one stays gathered until its
    AccumulateGrad node has run in backward (PyTorch lays the incoming [V, H] grad out like the param, which
    fails on the [0] partition; ZeRO-3's reduce hook on that node runs first), then is released: one head weight
    of memory held from the loss forward to the head's backward, and no second all-gather. Already AVAILABLE
    (the engine's hooks gathered it): the parameter itself, left to the engine.
    DTensor: ``full_tensor(grad_placements=Partial("avg"))`` after casting the local shard to ``dtype``: an all-gather
    forward and a reduce-scatter (mean over ranks, FSDP's default) backward via DTensor autograd. This bypasses an
    FSDP unit's mixed-precision policy and gradient hooks, which is why ``call_through_module`` is preferred for a
    head that is its own FSDP unit; it is the right tool for a tensor-parallel (vocab-sharded) DTensor head.

Nothing here imports transformers; deepspeed and torch.distributed are imported lazily.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Tuple, Union

import torch

from ...ops.fused_linear_cross_entropy_kernel import fused_linear_cross_entropy
from ...ops.fused_linear_jsd_kernel import fused_linear_jsd, fused_linear_jsd_topk
from ...ops.logprobs_op import fused_linear_logprobs

__all__ = [
    "call_through_module",
    "gathered_lm_head",
    "gathered_lm_head_weight",
    "is_dtensor",
    "is_fsdp_module",
    "is_zero3_param",
    "lm_head_cross_entropy",
    "lm_head_logprobs",
]


def is_zero3_param(t: Any) -> bool:
    """True for a DeepSpeed ZeRO-3 managed parameter (gathered or not)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "ds_id") and hasattr(t, "ds_status")


def _zero3_available(p: torch.Tensor) -> bool:
    return getattr(p.ds_status, "name", None) == "AVAILABLE"


def is_dtensor(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def is_fsdp_module(module: Any) -> bool:
    """True when ``module`` is an FSDP2 unit (``fully_shard`` was applied to it)."""
    if not isinstance(module, torch.nn.Module) or not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def _weight_and_bias(module_or_param) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(module_or_param, torch.nn.Module):
        weight = getattr(module_or_param, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"module_or_param: {type(module_or_param).__name__} has no weight tensor")
        bias = getattr(module_or_param, "bias", None)
        return weight, bias if isinstance(bias, torch.Tensor) else None
    if isinstance(module_or_param, torch.Tensor):
        return module_or_param, None
    raise TypeError(f"module_or_param must be an nn.Module or a tensor, got {type(module_or_param).__name__}")


def _release_after_grad(gather_ctx, params) -> None:
    """Exit the ZeRO-3 gather once every trainable param's AccumulateGrad node has run.

    AccumulateGrad lays the incoming [V, H] grad out like the param, so the param must still be gathered then.
    Our hook is registered after ZeRO-3's reduce hook on the same node, so it runs after it.
    """
    pending = {id(p) for p in params}
    handles = []

    def make_hook(p):
        def hook(*_):
            pending.discard(id(p))
            if not pending:
                for h in handles:
                    h.remove()
                gather_ctx.__exit__(None, None, None)
        return hook

    with torch.enable_grad():
        for p in params:
            node = p.view_as(p).grad_fn.next_functions[0][0]   # the param's (shared) AccumulateGrad node
            handles.append(node.register_hook(make_hook(p)))


def _full(p: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    if p is None:
        return None
    if dtype is not None and p.dtype != dtype:
        p = p.to(dtype)   # on a DTensor this casts the local shard: the all-gather moves the smaller dtype
    if not is_dtensor(p):
        return p
    from torch.distributed.tensor import Partial
    return p.full_tensor(grad_placements=[Partial("avg")] * len(p.placements))


@contextlib.contextmanager
def gathered_lm_head(module_or_param: Union[torch.nn.Module, torch.Tensor], dtype: Optional[torch.dtype] = None
                     ) -> Iterator[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Yield (weight [V, H], bias [V] or None) of an lm_head, gathered if sharded (see the module docstring).

    module_or_param: the lm_head module (weight and bias) or its weight tensor (bias None).
    dtype: for DTensor parameters, cast the local shard first (e.g. to the FSDP param dtype / hidden dtype).
    Plain tensors pass through unchanged.
    """
    weight, bias = _weight_and_bias(module_or_param)
    zero = [p for p in (weight, bias) if p is not None and is_zero3_param(p)]
    if zero:
        pending = [p for p in zero if not _zero3_available(p)]
        if not pending:   # the engine's hooks gathered it and will manage it
            yield weight, bias
            return
        try:
            import deepspeed
        except ImportError as exc:
            raise RuntimeError("lm_head parameters are ZeRO-3 partitioned but deepspeed cannot be imported") from exc
        gather_ctx = deepspeed.zero.GatheredParameters(pending, modifier_rank=None)
        gather_ctx.__enter__()
        deferred = False
        try:
            yield weight, bias
            trainable = [p for p in pending if p.requires_grad] if torch.is_grad_enabled() else []
            if trainable:
                _release_after_grad(gather_ctx, trainable)
                deferred = True
        finally:
            if not deferred:
                gather_ctx.__exit__(None, None, None)
        return
    if is_dtensor(weight) or is_dtensor(bias):
        yield _full(weight, dtype), _full(bias, dtype)
        return
    yield weight, bias


@contextlib.contextmanager
def gathered_lm_head_weight(module_or_param: Union[torch.nn.Module, torch.Tensor],
                            dtype: Optional[torch.dtype] = None) -> Iterator[torch.Tensor]:
    """Yield the full [V, H] lm_head weight (a module's bias is gathered alongside; use :func:`gathered_lm_head`
    to receive it too)."""
    with gathered_lm_head(module_or_param, dtype) as (weight, _):
        yield weight


def call_through_module(module: torch.nn.Module, fn: Callable, *args, **kwargs):
    """Return ``module(*args, **kwargs)`` computed as ``fn(module.weight, module.bias, *args, **kwargs)``.

    The module's own ``__call__`` runs, with every hook the engine registered on it: FSDP2 unshards its parameters
    before ``fn`` and reshards after, registers a pre-backward unshard on the outputs and reduce-scatters the
    gradients; ZeRO-3 fetches / releases / re-fetches for backward the same way. ``fn`` sees plain full tensors.
    Outputs should be tensors or tuples of tensors (what those hooks walk).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    missing = object()
    previous = module.__dict__.get("forward", missing)

    def forward(*a, **k):
        return fn(module.weight, getattr(module, "bias", None), *a, **k)

    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        if previous is missing:
            del module.forward
        else:
            module.forward = previous


def _head_op(module: torch.nn.Module, op: Callable, hidden: torch.Tensor, labels: torch.Tensor, **options):
    """``op(hidden, module.weight, labels, module.bias, **options)`` for a possibly sharded head: through the module's
    forward when it is an FSDP2 unit or holds ZeRO-3 parameters that are not gathered, else directly (DTensors that
    remain, e.g. tensor parallel, are gathered with full_tensor)."""
    def run(weight, bias, h, y):
        with gathered_lm_head(weight, h.dtype if h.is_floating_point() else None) as (w, _):
            with gathered_lm_head(bias) if bias is not None else contextlib.nullcontext((None, None)) as (b, _):
                return op(h, w, y, b, **options)

    weight, bias = _weight_and_bias(module)
    zero_pending = any(is_zero3_param(p) and not _zero3_available(p) for p in (weight, bias) if p is not None)
    if is_fsdp_module(module) or zero_pending:
        return call_through_module(module, run, hidden, labels)
    return run(weight, bias, hidden, labels)


def lm_head_cross_entropy(module: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **options):
    """``fused_linear_cross_entropy(hidden, module.weight, labels, module.bias, **options)`` for a possibly sharded
    head (see :func:`_head_op`)."""
    return _head_op(module, fused_linear_cross_entropy, hidden, labels, **options)


def lm_head_jsd(student: torch.nn.Module, hidden: torch.Tensor, teacher: torch.nn.Module, teacher_hidden: torch.Tensor,
                labels: torch.Tensor, **options):
    """``fused_linear_jsd(hidden, student.weight, teacher_hidden, teacher.weight, labels, ...)`` for possibly sharded
    heads: the student's as in :func:`_head_op` (its gradients the engine's way), the teacher's gathered for the call
    (it gets no gradient; the op reads it in the forward only)."""
    def op(h, w, y, b, **opts):
        with gathered_lm_head(teacher, teacher_hidden.dtype) as (tw, tb):
            return fused_linear_jsd(h, w, teacher_hidden, tw.detach(), y, student_bias=b,
                                    teacher_bias=None if tb is None else tb.detach(), **opts)
    return _head_op(student, op, hidden, labels, **options)


def lm_head_jsd_topk(student: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, values: torch.Tensor,
                     ids: torch.Tensor, **options):
    """``fused_linear_jsd_topk(hidden, student.weight, labels, values, ids, ...)`` for a possibly sharded student head
    (see :func:`_head_op`): the teacher's top-k given."""
    def op(h, w, y, b, **opts):
        return fused_linear_jsd_topk(h, w, y, values, ids, student_bias=b, **opts)
    return _head_op(student, op, hidden, labels, **options)


def lm_head_logprobs(module: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **options):
    """``fused_linear_logprobs(hidden, module.weight, labels, module.bias, **options)`` for a possibly sharded head
    (see :func:`_head_op`). With ``return_logit_sum`` the result is a LogprobsOutput, a tuple of tensors, which the
    engines' output hooks walk like any tuple."""
    return _head_op(module, fused_linear_logprobs, hidden, labels, **options)
