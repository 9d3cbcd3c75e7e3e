"""The loss semantics cross_entropy and fused_linear_cross_entropy share: one definition of their options and of
the reduction, so the two cannot drift apart.

    per token (label y, not ignored):  loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v)  (+ z_loss * lse^2)
    reduction "mean": sum / (number of valid tokens, at least 1); "sum"; "none": per token (0 where ignored)
    num_items_in_batch (with "mean" or "sum"): sum / num_items_in_batch, a divisor <= 0 taken as 1 (HF's gradient
    accumulation: the loss of one micro-batch over the tokens of the whole step)
    softcap: z = c * tanh(z / c) on the fp32 logits, with the one `tanh` below in both kernels
    labels: checked against [0, V) or ignore_index on CPU always, on CUDA only with validate_labels=True (the check
    syncs the host); an unchecked out-of-range label is never read out of bounds: its token loss is NaN (so is the
    mean), its gradient zero
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)   # the kernels read int64/int32; others widen


def is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, num_items_in_batch) -> None:
    """ValueError / TypeError naming the option and what it takes."""
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not (is_number(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if softcap is not None and not (is_number(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a number > 0, got {softcap!r}")
    if not (is_number(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a number >= 0, got {z_loss!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError("num_items_in_batch needs reduction 'mean' or 'sum' (the loss is sum / num_items), "
                             "not 'none'")
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(f"num_items_in_batch must be a number or a one-element tensor, got shape "
                                 f"{tuple(num_items_in_batch.shape)}")
        elif not (is_number(num_items_in_batch) and num_items_in_batch >= 0):
            raise ValueError(f"num_items_in_batch must be a number >= 0 or a tensor, got {num_items_in_batch!r}")


def reduce(loss_sum: torch.Tensor, token_loss: torch.Tensor, valid_count, reduction: str, num_items_in_batch):
    """loss_sum 0-d, token_loss [N], valid_count () -> tensor or None (only needed for "mean" without num_items):
    the reduced loss, divisors on the device (no host sync).

    A divisor of 0 (every label ignored, or num_items_in_batch 0) gives NaN, as torch's mean cross-entropy and
    transformers' loss divided by num_items_in_batch do for no tokens (transformers gives inf where num_items is 0
    but tokens remain), while the gradients stay finite: the NaN is added as a constant, so the backward sees a
    divisor of 1 (rows with ignored labels get 0)."""
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            d = num_items_in_batch.to(device=loss_sum.device, dtype=loss_sum.dtype).reshape(())
        elif num_items_in_batch > 0:
            return loss_sum / num_items_in_batch
        else:
            d = loss_sum.new_zeros(())
        return _divide(loss_sum, d)
    if reduction == "none":
        return token_loss
    if reduction == "sum":
        return loss_sum
    return _divide(loss_sum, valid_count.to(loss_sum.dtype))


def _divide(loss_sum: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """loss_sum / d; NaN (with the gradient of loss_sum / 1) where d is 0."""
    ok = d > 0
    nan = torch.where(ok, 0.0, float("nan")).to(loss_sum.dtype)
    return loss_sum / torch.where(ok, d, torch.ones_like(d)) + nan


def check_label_range(labels: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """ValueError for a label outside [0, n_classes) that is not ignore_index (a reduction and, on CUDA, a host
    sync: the callers skip it where that matters)."""
    labels = int_labels(labels)   # compared in int64: a uint8 label cannot hold -100 or V
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_classes))
    if bool(bad.any()):
        value = labels[bad].reshape(-1)[0].item()
        raise ValueError(f"labels must be in [0, {n_classes}) or equal ignore_index={ignore_index}; found {value}")


def int_labels(labels: torch.Tensor) -> torch.Tensor:
    """int64/int32 as they are, narrower ints widened to int64 (for the kernels, and so that comparisons with
    ignore_index and V are made in a type that holds them)."""
    return labels if labels.dtype in (torch.int64, torch.int32) else labels.long()


@triton.jit
def tanh(x):
    """tanh from tl.exp only (the interpreter runs it); exp(-2|x|) never overflows, +-1 at large |x|."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


def labels_checked(labels: torch.Tensor, validate_labels) -> bool:
    """Whether to check the label range now: validate_labels None = on CPU only, True / False = always / never
    (never under torch.compile)."""
    if validate_labels not in (None, True, False):
        raise TypeError(f"validate_labels must be None, True or False, got {validate_labels!r}")
    if torch.compiler.is_compiling():
        return False
    return (not labels.is_cuda) if validate_labels is None else validate_labels
