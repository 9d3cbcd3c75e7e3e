"""Cross-entropy on materialised logits, with label smoothing, Gemma-2 logit softcapping and z-loss.

Semantics (Hugging Face ``ForCausalLMLoss`` on already-shifted labels), per token with label y:

    z        = logits.float();  z = softcap * tanh(z / softcap)   if softcap
    lse      = logsumexp(z)
    loss_tok = (1 - eps) * (lse - z[y]) + eps * (lse - mean_v z_v)  (+ z_loss * lse^2)
    ignored tokens (y == ignore_index) contribute 0 loss and 0 gradient.

Reductions: "mean" (sum / number of valid tokens), "sum", "none" (per token, 0 at ignored tokens);
``num_items_in_batch`` makes the loss ``sum / num_items_in_batch`` (gradient accumulation over micro-batches).
Divisors stay on the device (no host sync) and are clamped so that an all-ignored batch gives loss 0, never NaN.

Kernels: forward is one program per row, an online logsumexp over the vocabulary in BLOCK_V chunks, writing the
per-token loss and lse (fp32). Backward recomputes softmax from the logits and the saved lse and writes dlogits
(logits dtype). Ignored rows never read their logits. Bytes: forward reads N*V logits, backward reads N*V and
writes N*V (the minimum without holding dlogits across the two passes).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common, _launch

from ._loss import LABEL_DTYPES, check_label_range, check_options, int_labels, labels_checked, reduce
from ._loss import tanh as _tanh

MAX_BLOCK_V = 8192   # one program per row walks the vocabulary in blocks of at most this many columns


@triton.jit
def _ce_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr,
                   stride_row, stride_label, n_cols, ignore_index, eps, softcap, z_loss,
                   HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
                   ALL_LSE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    label = tl.load(labels_ptr + row * stride_label).to(tl.int64)
    # Out-of-range labels (unchecked on CUDA unless validate_labels=True) are never read out of bounds: loss NaN.
    valid = (label != ignore_index) & (label >= 0) & (label < n_cols)
    row_ptr = logits_ptr + row * stride_row
    inv_cap = 1.0 / softcap
    # Ignored rows skip the vocabulary loop (their logits are never read) unless every lse is wanted.
    if ALL_LSE:
        n_end = n_cols
    else:
        n_end = tl.where(valid, n_cols, 0)

    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    z_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, n_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z * inv_cap)
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    has_lse = n_end > 0
    lse = tl.where(has_lse, m + tl.log(tl.where(has_lse, s, 1.0)), 0.0)

    z_y = tl.load(row_ptr + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * _tanh(z_y * inv_cap)
    loss = lse - z_y
    if HAS_SMOOTHING:
        loss = (1.0 - eps) * loss + eps * (lse - z_sum / n_cols)
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, tl.where(label == ignore_index, 0.0, float("nan"))))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, grad_ptr, dlogits_ptr,
                   stride_row, stride_label, stride_grad, stride_drow, n_cols, ignore_index, eps, softcap, z_loss,
                   HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    label = tl.load(labels_ptr + row * stride_label).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < n_cols)
    # Ignored rows: scale 0 and masked loads, so they write zeros without reading their logits.
    g = tl.where(valid, tl.load(grad_ptr + row * stride_grad).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    coef = g
    if HAS_Z_LOSS:
        coef = g * (1.0 + 2.0 * z_loss * lse)  # d(z_loss lse^2)/dz = 2 z_loss lse softmax(z)
    smooth = eps / n_cols
    inv_cap = 1.0 / softcap
    target = tl.where(valid, label, -1).to(tl.int32)  # int32 compare in the loop (label < V < 2^31)
    # An ignored row reads nothing: one compare against 0 columns, not `mask & valid` (Triton 3.9's interpreter
    # gives a block & scalar-i1 mask a non-bool dtype and refuses it).
    n_read = tl.where(valid, n_cols, 0)
    row_ptr = logits_ptr + row * stride_row
    drow_ptr = dlogits_ptr + row * stride_drow
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh(z * inv_cap)
            z = softcap * t
        d = coef * tl.exp(z - lse)
        if HAS_SMOOTHING:
            d -= g * smooth
        d = tl.where(cols == target, d - g * (1.0 - eps), d)
        if HAS_SOFTCAP:
            d = d * (1.0 - t * t)
        tl.store(drow_ptr + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (2-D logits [N, V] with unit column stride, labels [N])
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CEConfig:
    """Launch of _ce_fwd_kernel / _ce_bwd_kernel (one program per row): block_v (BLOCK_V) vocabulary columns per
    loop step, num_warps."""
    block_v: int
    num_warps: int


LAUNCH_CONFIGS = {None: CEConfig}


def launch_config(n_cols: int, device) -> CEConfig:
    """next_pow2(V) capped at MAX_BLOCK_V columns; warps by block size (_common.num_warps_for), at most 8: on the
    H200 (CUDA graphs, fwd+bwd, 8192 rows) 8 warps beat 16 by 3.5% at V=128256 (1.506 against 1.560 ms, 4.19 TB/s)
    and by 2.5% at V=32768; shared-memory pipelining of the vocabulary loop (tl.range num_stages 2-3) gained
    nothing there. Every device."""
    block = min(_common.next_pow2(n_cols), MAX_BLOCK_V)
    return _common.apply_override(__name__, None, CEConfig(block, min(8, _common.num_warps_for(block))))


_CE_FWD = _launch.FastLaunch(_ce_fwd_kernel)
_CE_BWD = _launch.FastLaunch(_ce_bwd_kernel)


def _ce_forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, label_smoothing: float,
                softcap: Optional[float], z_loss: float, all_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], labels [N] -> (loss per token [N] fp32, 0 at ignored rows; lse [N] fp32).

    lse is 0 at ignored rows unless ``all_lse``.
    """
    n_rows, n_cols = logits.shape
    loss = _common.new_empty((n_rows,), dtype=torch.float32, device=logits.device)
    lse = _common.new_empty((n_rows,), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss, lse
    cfg = launch_config(n_cols, logits.device)
    _CE_FWD.launch(
        (n_rows,), logits, labels, loss, lse, logits.stride(0), labels.stride(0), n_cols, ignore_index,
        float(label_smoothing), float(softcap or 1.0), float(z_loss),
        HAS_SMOOTHING=label_smoothing > 0, HAS_SOFTCAP=softcap is not None, HAS_Z_LOSS=z_loss > 0,
        ALL_LSE=bool(all_lse), BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)
    return loss, lse


def _ce_backward_into(dlogits: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                      grad_loss: torch.Tensor, ignore_index: int, label_smoothing: float,
                      softcap: Optional[float], z_loss: float) -> None:
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    grad_loss = grad_loss.reshape(-1)
    if grad_loss.dtype != torch.float32:
        grad_loss = grad_loss.float()
    cfg = launch_config(n_cols, logits.device)
    _CE_BWD.launch(
        (n_rows,), logits, labels, lse, grad_loss, dlogits, logits.stride(0), labels.stride(0), grad_loss.stride(0),
        dlogits.stride(0), n_cols, ignore_index, float(label_smoothing), float(softcap or 1.0), float(z_loss),
        HAS_SMOOTHING=label_smoothing > 0, HAS_SOFTCAP=softcap is not None, HAS_Z_LOSS=z_loss > 0,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)


def _ce_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                 ignore_index: int, label_smoothing: float, softcap: Optional[float],
                 z_loss: float) -> torch.Tensor:
    """grad_loss [N] (any stride, 0 for a broadcast scalar) -> dlogits [N, V], new, logits dtype."""
    dlogits = _common.new_empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _ce_backward_into(dlogits, logits, labels, lse, grad_loss, ignore_index, label_smoothing, softcap, z_loss)
    return dlogits


@torch.library.custom_op("swift_liger::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, label_smoothing: float,
               softcap: Optional[float], z_loss: float, all_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ce_forward(logits, labels, ignore_index, label_smoothing, softcap, z_loss, all_lse)


@_ce_fwd_op.register_fake
def _(logits, labels, ignore_index, label_smoothing, softcap, z_loss, all_lse):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("swift_liger::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
               ignore_index: int, label_smoothing: float, softcap: Optional[float], z_loss: float) -> torch.Tensor:
    return _ce_backward(logits, labels, lse, grad_loss, ignore_index, label_smoothing, softcap, z_loss)


@_ce_bwd_op.register_fake
def _(logits, labels, lse, grad_loss, ignore_index, label_smoothing, softcap, z_loss):
    return logits.new_empty(logits.shape)


class CrossEntropyFunction(torch.autograd.Function):
    """Per-token cross-entropy: logits [N, V], labels [N] -> (loss [N] fp32, 0 at ignored; lse [N] fp32).

    lse is not differentiable. With ``inplace_backward`` (eager only) dlogits overwrite the logits buffer.
    """

    @staticmethod
    def forward(ctx, logits, labels, ignore_index: int, label_smoothing: float, softcap: Optional[float],
                z_loss: float, all_lse: bool, inplace_backward: bool):
        fwd = _common.compiled_or_eager("swift_liger::cross_entropy_fwd", _ce_forward)
        loss, lse = fwd(logits, labels, ignore_index, label_smoothing, softcap, z_loss, all_lse)
        ctx.save_for_backward(logits, labels, lse)
        ctx.cfg = (ignore_index, label_smoothing, softcap, z_loss)
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        logits, labels, lse = ctx.saved_tensors
        if ctx.inplace_backward and not torch.compiler.is_compiling():
            _ce_backward_into(logits, logits, labels, lse, grad_loss, *ctx.cfg)
            # Any other graph node that saved these logits now fails loudly instead of reading gradients.
            torch.autograd.graph.increment_version(logits)
            dlogits = logits
        else:
            bwd = _common.compiled_or_eager("swift_liger::cross_entropy_bwd", _ce_backward)
            dlogits = bwd(logits, labels, lse, grad_loss, *ctx.cfg)
        return dlogits, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Reduction (shared by the kernel path and the reference), reference, public function
# ---------------------------------------------------------------------------------------------------------------

def _valid_mask(labels: torch.Tensor, n_cols: int, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index) & (labels >= 0) & (labels < n_cols)


def _finish(loss_tok, lse, valid, labels_shape, reduction, num_items_in_batch, return_lse):
    loss = reduce(loss_tok.sum(), loss_tok, None if valid is None else valid.sum(), reduction, num_items_in_batch)
    if reduction == "none" and num_items_in_batch is None:
        loss = loss.view(labels_shape)
    return (loss, lse.view(labels_shape)) if return_lse else loss


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                            label_smoothing: float = 0.0, softcap: Optional[float] = None, z_loss: float = 0.0,
                            reduction: str = "mean", num_items_in_batch=None, return_lse: bool = False):
    """The Hugging Face eager computation (``logits.float()``, ``F.cross_entropy``) plus softcap / z-loss.

    Same arguments and outputs as :func:`cross_entropy` (computed in fp32, or fp64 for fp64 logits; lse is
    computed for every row). Labels must be in range or ignore_index.
    """
    n_cols = logits.shape[-1]
    z = logits.reshape(-1, n_cols)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lab = labels.reshape(-1).long()
    valid = _valid_mask(lab, n_cols, ignore_index)
    loss_tok = F.cross_entropy(z, lab, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, dim=-1)
    if z_loss > 0:
        loss_tok = loss_tok + z_loss * torch.where(valid, lse * lse, torch.zeros_like(lse))
    return _finish(loss_tok, lse.detach(), valid, labels.shape, reduction, num_items_in_batch, return_lse)


def _check(logits, labels, ignore_index, label_smoothing, softcap, z_loss, reduction, num_items_in_batch) -> None:
    _common.check_tensor("logits", logits, min_ndim=2)
    _common.check_tensor("labels", labels, dtypes=LABEL_DTYPES)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(logits.shape[:-1])} (logits without its last dim), "
                         f"got {tuple(labels.shape)}")
    _common.check_same_device(logits=logits, labels=labels)
    _common.check_last_dim_contiguous("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, num_items_in_batch)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, softcap: Optional[float] = None, z_loss: float = 0.0,
                  reduction: str = "mean", num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None,
                  return_lse: bool = False, validate_labels: Optional[bool] = None, inplace_backward: bool = False):
    """Cross-entropy of logits [..., V] against labels [...] (already shifted), HF ForCausalLMLoss semantics.

    logits: [..., V] fp32/fp16/bf16, last dim contiguous (row stride free). labels: [...] int64/int32/int16/uint8.
    label_smoothing: eps in [0, 1]. softcap: Gemma-2 ``softcap * tanh(z / softcap)`` on the logits before the loss.
    z_loss: adds ``z_loss * lse^2`` per valid token. reduction: "mean" (over valid tokens) | "sum" | "none".
    num_items_in_batch: int / float / one-element tensor; the loss becomes ``sum / num_items_in_batch`` (clamped
    away from 0 on device) for "mean" and "sum"; an error with "none".
    validate_labels: check labels are in [0, V) or ignore_index (ValueError): None (default) on CPU only, True on
    CUDA too (one host sync), False never; skipped under torch.compile. An unchecked out-of-range label is never
    read out of bounds: its token loss is NaN (so is the mean) and its gradient zero, as in
    fused_linear_cross_entropy (ops/_loss.py).
    inplace_backward: write dlogits into the logits buffer (saves N*V memory). Only when nothing else needs the
    logits afterwards (no retain_graph; logits not returned to the caller); ignored under torch.compile.

    Returns the loss (fp32 scalar, or [...] for "none", 0 at ignored tokens); with ``return_lse`` also
    lse [...] fp32 (after softcap, every row, not differentiable).
    """
    _check(logits, labels, ignore_index, label_smoothing, softcap, z_loss, reduction, num_items_in_batch)
    n_cols = logits.shape[-1]
    if labels_checked(labels, validate_labels):
        check_label_range(labels, n_cols, ignore_index)
    if not _common.use_triton(logits):
        return cross_entropy_reference(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
            z_loss=z_loss, reduction=reduction, num_items_in_batch=num_items_in_batch, return_lse=return_lse)
    logits2 = logits.reshape(-1, n_cols)
    if n_cols > 1 and logits2.stride(1) != 1:
        logits2 = logits2.contiguous()
    labels1 = int_labels(labels.reshape(-1))
    loss_tok, lse = CrossEntropyFunction.apply(
        logits2, labels1, ignore_index, float(label_smoothing), None if softcap is None else float(softcap),
        float(z_loss), bool(return_lse), bool(inplace_backward))
    valid = None
    if reduction == "mean" and num_items_in_batch is None:
        valid = labels1 != ignore_index   # an out-of-range label counts: its NaN makes the mean NaN
    return _finish(loss_tok, lse, valid, labels.shape, reduction, num_items_in_batch, return_lse)
