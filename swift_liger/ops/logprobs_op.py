"""Per-token log-probabilities of the label tokens from hidden states, without materialising the logits.

    logps[t] = log softmax(z_t)[y_t] = z_t[y_t] - logsumexp(z_t),   z_t = transform(h_t @ W^T + b)

where transform is the model's softcap c*tanh(z/c) (Gemma-2) followed by the trainer's 1/temperature. This is what
preference trainers (DPO, ORPO, CPO/SimPO, KTO) compute from ``outputs.logits`` with a log-softmax over [rows, V].

Machinery: the fused linear cross-entropy's rolling workspace and kernels (``fused_linear_cross_entropy_kernel.py``)
with per-token gradients: logps = -token_loss of its autograd Function, with no smoothing and no z-loss. So
    forward:  per token chunk, logits GEMM into the [C, V] workspace, one row kernel (lse, log p, optional row sum
              of logits, dlogits at unit scale in place), dh = dlogits @ W          2 GEMMs, frozen W (LoRA)
    backward: dh *= grad per token (in place); trainable W only: vocab slices of all tokens recompute logits
              and dW[vs] = (g * dlogits)^T h in one GEMM each (fp32 accumulation inside) + 2 GEMMs
Memory beyond the inputs: the workspace (WORKSPACE_BYTES, 256 MiB), dh [N, H] in the input dtype and a few [N] fp32
vectors; never [N, V]. Qwen2.5-7B's head (V = 152064, H = 3584) over a 2 x 5k-token DPO pair: 0.25 GiB workspace
+ 0.07 GiB dh, where the eager path holds 2.8 GiB of bf16 logits and as much again of saved log-softmax rows.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _common
from .fused_linear_cross_entropy_kernel import autocast_inputs, check_args, flat_rows, run_rows


class LogprobsOutput(NamedTuple):
    """logps: [...] fp32 log p of each label (0 at ignored positions), differentiable.
    logit_sum: [...] fp32 sum over the vocabulary of the logits the log-softmax sees, at every position (ignored
    ones included), no gradient; ``logit_sum / V`` is ``logits.mean(-1)``. None unless asked for.
    entropy: [...] fp32 entropy -sum_v p_v log p_v of the softmax the log-probs come from, at every position
    (ignored ones included), no gradient. None unless asked for.
    argmax: [...] int64 arg max of the logits at every position (ignored ones included). None unless asked for."""
    logps: torch.Tensor
    logit_sum: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None


def _check(hidden, weight, labels, bias, ignore_index, softcap, temperature, chunk_size, validate_labels):
    check_args(hidden, weight, labels, bias, ignore_index, 0.0, softcap, 0.0, "none", None, chunk_size, "auto",
                validate_labels)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    _common.check_same_dtype(hidden=hidden, weight=weight, bias=bias)


def fused_linear_logprobs_reference(hidden, weight, labels, bias=None, *, ignore_index=-100, softcap=None,
                                    temperature=1.0, return_logit_sum=False, return_entropy=False,
                                    return_argmax=False, **_unused):
    """PyTorch reference, the way trainers compute it: logits = hidden @ W^T (+ b) in the input dtype, ``.float()``,
    log-softmax, gather. Same arguments and returns as :func:`fused_linear_logprobs` (chunking options ignored);
    materialises [N, V] logits: the memory-hungry baseline, and the CPU fallback."""
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    valid = y != ignore_index
    picked = logits.gather(-1, torch.where(valid, y, 0)[:, None]).squeeze(-1)
    logps = torch.where(valid, picked - torch.logsumexp(logits, dim=-1), 0.0).view(shape)
    if not (return_logit_sum or return_entropy or return_argmax):
        return logps
    z = logits.detach()
    entropy = None
    if return_entropy:
        logp = torch.log_softmax(z, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1).view(shape)
    return LogprobsOutput(logps, z.sum(-1).view(shape) if return_logit_sum else None, entropy,
                          z.argmax(-1).view(shape) if return_argmax else None)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                          softcap: Optional[float] = None, temperature: float = 1.0, return_logit_sum: bool = False,
                          return_entropy: bool = False, return_argmax: bool = False, chunk_size: Optional[int] = None,
                          validate_labels: Optional[bool] = None):
    """log p(labels | hidden) under the head ``weight`` [V, H] (+ ``bias`` [V]), per token, logits never whole.

    hidden [..., H] (fp32/fp16/bf16; weight and bias in the same dtype, or all cast to the autocast dtype under
    autocast like nn.Linear), labels [...] int (already aligned with hidden: labels[t] is the token predicted at t).
    Returns logps [...] fp32 (0 where labels == ignore_index) or, with ``return_logit_sum`` / ``return_entropy`` /
    ``return_argmax``, a :class:`LogprobsOutput` that adds each position's sum of logits / entropy / arg max (no
    gradient; kept online in the same pass over the workspace row as the logsumexp: no extra read, no [N, V]
    tensor).
      * backward takes any gradient per token (sequence sums, length-normalised means, masks, several uses);
        frozen weight/bias do no dW work; a trainable weight gets dW recomputed over vocab slices (fp32 GEMM
        accumulation, one rounding to its dtype).
      * softcap: z = softcap * tanh(z / softcap) on the fp32 logits (as Gemma-2's model does), then z / temperature.
      * chunk_size: token rows per workspace chunk (default: the workspace stays <= 256 MiB).
      * validate_labels: None checks labels on CPU only (on CUDA the check would sync the host); unchecked
        out-of-range labels read nothing out of bounds and give NaN.
    The graph can be backpropagated once.
    """
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    _check(hidden, weight, labels, bias, ignore_index, softcap, temperature, chunk_size, validate_labels)
    if not _common.use_triton(hidden):
        return fused_linear_logprobs_reference(hidden, weight, labels, bias, ignore_index=ignore_index,
                                               softcap=softcap, temperature=float(temperature),
                                               return_logit_sum=return_logit_sum, return_entropy=return_entropy,
                                               return_argmax=return_argmax)
    shape = labels.shape
    h2, y = flat_rows(hidden, labels)
    _, token_loss, _, logit_sum, entropy, argmax = run_rows(
        h2, weight, bias, y, ignore_index=ignore_index, label_smoothing=0.0, softcap=softcap, z_loss=0.0,
        temperature=float(temperature), chunk_size=chunk_size, dw_acc_rows=0, row_grads=True,
        need_sum=bool(return_logit_sum), need_entropy=bool(return_entropy), need_argmax=bool(return_argmax))
    logps = torch.neg(token_loss.view(shape))   # a fresh tensor, not a view (FSDP2 output hooks warn on views)
    if not (return_logit_sum or return_entropy or return_argmax):
        return logps
    return LogprobsOutput(logps, logit_sum.view(shape) if return_logit_sum else None,
                          entropy.view(shape) if return_entropy else None,
                          argmax.view(shape).long() if return_argmax else None)
