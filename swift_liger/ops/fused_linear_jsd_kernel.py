"""Generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions, from their
hidden states and heads, without [N, V] logits (GKD distillation: ms-swift's ``--rlhf_type gkd``).

Per valid row (labels != ignore_index), with s = (h_s @ W_s^T + b_s) / T and t = (h_t @ W_t^T + b_t) / T, each head
computed in its own dtype (as an HF lm_head) and then in fp32, p = softmax(s) (student), q = softmax(t) (teacher):

    beta == 0:       KL(q || p) = sum_v q_v (log q_v - log p_v)                               (forward KL)
    beta == 1:       KL(p || q) = sum_v p_v (log p_v - log q_v)                               (reverse KL)
    0 < beta < 1:    beta KL(q || m) + (1 - beta) KL(p || m),   m = (1 - beta) p + beta q

which is ms-swift 4.6's ``gkd_loss`` / ``jsd_loss`` (swift/rlhf_trainers/gkd_loss.py). The gradient reaches the
student only (the teacher runs without one): d/ds_v = p_v (g_v - sum_u p_u g_u) with g = log p - log q (beta 1),
g = (1 - beta)(log p - log m) (0 < beta < 1), and d/ds = p - q (beta 0), times 1/T.

Machinery, per chunk of C valid rows: two GEMMs into two [C, V] workspaces (student, teacher; 256 MiB together by
default), one Triton program per row reads both rows three times (lse; loss and sum p g; dlogits written over the
student's row in place), then dh = dlogits @ W_s (one GEMM) and, for a trainable student head, dW_s += dlogits^T h_s
(fp32 sum of per-chunk products). So 3 GEMMs per chunk with a frozen student head (LoRA), 4 with a trainable one,
and no [N, V] tensor: Qwen2.5-7B teacher / 1.5B student heads (V = 152064) over 8k rows hold 0.25 GiB of workspace
where the logits path holds 2 x 2.3 GiB of bf16 logits plus their fp32 log-softmax chunks.

Top-k distillation (``topk=k``, ms-swift's ``--gkd_logits_topk``): per row the teacher's k largest logits and their
vocabulary ids; the student's logits at those ids only (h_s . W_s[ids], one [k, Hs] gather of head rows per row, no
student GEMM over the vocabulary); the same divergence over the k entries, each side's softmax renormalised over them.
The teacher's GEMM into its [C, V] workspace is the only vocabulary-wide work; the rest is k entries per row, so it
runs in PyTorch on every device (a row kernel over k values would not pay).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common
from .fused_linear_cross_entropy_kernel import autocast_inputs, default_chunk_size

REDUCTIONS = ("sum", "mean")


@triton.jit
def _jsd_rows_kernel(zs_ptr, zt_ptr, loss_ptr, stride_s, stride_t, V, inv_t, beta, log_beta, log_1mb,
                     MODE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row: zs/zt hold the raw logits (any float dtype); loss_ptr[row] <- the row's divergence (fp32); with
    WRITE_GRAD, zs's row <- d loss / d raw student logits. MODE 0: beta 0, 1: beta 1, 2: 0 < beta < 1."""
    row = tl.program_id(0).to(tl.int64)
    s_row = zs_ptr + row * stride_s
    t_row = zt_ptr + row * stride_t
    m_s = tl.full([], float("-inf"), tl.float32)
    m_t = tl.full([], float("-inf"), tl.float32)
    l_s = tl.zeros([], tl.float32)
    l_t = tl.zeros([], tl.float32)
    for off in range(0, V, BLOCK):   # pass 1: both log-sum-exps, online
        cols = off + tl.arange(0, BLOCK)
        msk = cols < V
        s = tl.load(s_row + cols, mask=msk, other=float("-inf")).to(tl.float32) * inv_t
        t = tl.load(t_row + cols, mask=msk, other=float("-inf")).to(tl.float32) * inv_t
        ms_new = tl.maximum(m_s, tl.max(s, 0))
        mt_new = tl.maximum(m_t, tl.max(t, 0))
        l_s = l_s * tl.exp(m_s - ms_new) + tl.sum(tl.exp(s - ms_new), 0)
        l_t = l_t * tl.exp(m_t - mt_new) + tl.sum(tl.exp(t - mt_new), 0)
        m_s = ms_new
        m_t = mt_new
    lse_s = m_s + tl.log(l_s)
    lse_t = m_t + tl.log(l_t)
    loss = tl.zeros([], tl.float32)
    pg = tl.zeros([], tl.float32)    # sum_v p_v g_v (modes 1 and 2)
    for off in range(0, V, BLOCK):   # pass 2: the divergence (and, for mode 0, the gradient)
        cols = off + tl.arange(0, BLOCK)
        msk = cols < V
        lp = tl.load(s_row + cols, mask=msk, other=0.0).to(tl.float32) * inv_t - lse_s
        lq = tl.load(t_row + cols, mask=msk, other=0.0).to(tl.float32) * inv_t - lse_t
        p = tl.exp(lp)
        q = tl.exp(lq)
        if MODE == 0:
            term = q * (lq - lp)
            if WRITE_GRAD:
                tl.store(s_row + cols, ((p - q) * inv_t).to(zs_ptr.dtype.element_ty), mask=msk)
        elif MODE == 1:
            term = p * (lp - lq)
        else:
            a = lp + log_1mb
            b = lq + log_beta
            mx = tl.maximum(a, b)
            lm = mx + tl.log(tl.exp(a - mx) + tl.exp(b - mx))
            term = beta * q * (lq - lm) + (1.0 - beta) * p * (lp - lm)
            pg += tl.sum(tl.where(msk, p * (1.0 - beta) * (lp - lm), 0.0), 0)
        loss += tl.sum(tl.where(msk, term, 0.0), 0)
    if MODE == 1:
        pg = loss
    tl.store(loss_ptr + row, loss)
    if WRITE_GRAD and MODE != 0:
        for off in range(0, V, BLOCK):   # pass 3: dlogits = p (g - sum p g) / T over the student's row
            cols = off + tl.arange(0, BLOCK)
            msk = cols < V
            lp = tl.load(s_row + cols, mask=msk, other=0.0).to(tl.float32) * inv_t - lse_s
            lq = tl.load(t_row + cols, mask=msk, other=0.0).to(tl.float32) * inv_t - lse_t
            p = tl.exp(lp)
            if MODE == 1:
                g = lp - lq
            else:
                a = lp + log_1mb
                b = lq + log_beta
                mx = tl.maximum(a, b)
                g = (1.0 - beta) * (lp - (mx + tl.log(tl.exp(a - mx) + tl.exp(b - mx))))
            tl.store(s_row + cols, (p * (g - pg) * inv_t).to(zs_ptr.dtype.element_ty), mask=msk)


def _mode(beta: float) -> int:
    return 0 if beta == 0 else 1 if beta == 1 else 2


def _rows_torch(zs: torch.Tensor, zt: torch.Tensor, beta: float, inv_t: float, write_grad: bool) -> torch.Tensor:
    """The row kernel's math in PyTorch (fp32), for the reference backend's chunks: returns the per-row loss and,
    with write_grad, writes the student's dlogits over zs."""
    lp = torch.log_softmax(zs.float() * inv_t, -1)
    lq = torch.log_softmax(zt.float() * inv_t, -1)
    p, q = lp.exp(), lq.exp()
    mode = _mode(beta)
    if mode == 0:
        loss = (q * (lq - lp)).sum(-1)
        grad = p - q
    else:
        if mode == 1:
            g = lp - lq
            loss = (p * g).sum(-1)
        else:
            lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
            loss = (beta * q * (lq - lm) + (1 - beta) * p * (lp - lm)).sum(-1)
            g = (1 - beta) * (lp - lm)
        grad = p * (g - (p * g).sum(-1, keepdim=True))
    if write_grad:
        zs.copy_(grad * inv_t)
    return loss


class _FusedLinearJSD(torch.autograd.Function):
    """Inputs are the valid rows only: hs [n, Hs], ht [n, Ht]. Output: the fp32 sum of the rows' divergences. The
    gradient is computed in the forward (at unit output grad) and scaled in the backward."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, beta, inv_t, chunk_size, triton_rows):
        n, vs, vocab = hs.shape[0], ws.shape[0], wt.shape[0]   # vs <= vocab: the teacher's may be padded wider
        need_dh, need_dw = hs.requires_grad, ws.requires_grad
        need_db = bs is not None and bs.requires_grad
        write_grad = need_dh or need_dw or need_db
        loss = _common.new_empty((n,), dtype=torch.float32, device=hs.device)   # NaN under SWIFT_LIGER_POISON=1
        dh = _common.new_empty_like(hs) if need_dh else None
        dw = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if need_dw else None
        db = torch.zeros(vs, dtype=torch.float32, device=ws.device) if need_db else None
        # both [C, V] workspaces together within the loss head's workspace budget (256 MiB)
        elem = hs.element_size() + ht.element_size()
        c = max(1, min(n, chunk_size)) if chunk_size else default_chunk_size(n, vocab, elem)
        ws_s = _common.new_empty((c, vocab), dtype=hs.dtype, device=hs.device)
        ws_t = _common.new_empty((c, vocab), dtype=ht.dtype, device=ht.device)
        mode = _mode(beta)
        block = min(1024 if not _common.INTERPRET else 256, _common.next_pow2(vocab))
        for r0 in range(0, n, c):
            r1 = min(n, r0 + c)
            zs, zt = ws_s[:r1 - r0], ws_t[:r1 - r0]
            torch.matmul(ht[r0:r1], wt.t(), out=zt)
            if bt is not None:
                zt.add_(bt)
            if vs == vocab:
                torch.matmul(hs[r0:r1], ws.t(), out=zs)
            else:   # ms-swift's _align_vocab: the student's missing columns take the teacher's logits (no gradient)
                zs[:, :vs].copy_(hs[r0:r1] @ ws.t())
                zs[:, vs:].copy_(zt[:, vs:])
            if bs is not None:
                zs[:, :vs].add_(bs)
            if triton_rows:
                _jsd_rows_kernel[(r1 - r0,)](
                    zs, zt, loss[r0:r1], zs.stride(0), zt.stride(0), vocab, inv_t, float(beta),
                    math.log(beta) if mode == 2 else 0.0, math.log1p(-beta) if mode == 2 else 0.0,
                    MODE=mode, WRITE_GRAD=write_grad, BLOCK=block, num_warps=_common.num_warps_for(block))
            else:
                loss[r0:r1] = _rows_torch(zs, zt, beta, inv_t, write_grad)
            g = zs if vs == vocab else zs[:, :vs]   # the padded columns' gradient has nowhere to go
            if need_dh:
                torch.matmul(g, ws, out=dh[r0:r1])
            if need_dw:
                dw += (g.t() @ hs[r0:r1]).float()
            if need_db:
                db += g.float().sum(0)
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (ws.dtype, None if bs is None else bs.dtype)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):   # grad: a scalar
        dh, dw, db = ctx.saved_tensors
        g_hs = None if dh is None else dh * grad.to(dh.dtype)
        g_ws = None if dw is None else (dw * grad).to(ctx.dtypes[0])
        g_bs = None if db is None else (db * grad).to(ctx.dtypes[1])
        return g_hs, g_ws, g_bs, None, None, None, None, None, None, None


# student head rows gathered per sub-chunk of top-k rows: [c, k, Hs] within this budget
TOPK_GATHER_BYTES = 64 << 20


class _TopkGrads:
    """The student's loss per row and gradient buffers of a top-k pass (valid rows only)."""

    def __init__(self, hs, ws, bs):
        self.need_dh, self.need_dw = hs.requires_grad, ws.requires_grad
        self.need_db = bs is not None and bs.requires_grad
        self.write = self.need_dh or self.need_dw or self.need_db
        self.loss = _common.new_empty((hs.shape[0],), dtype=torch.float32, device=hs.device)
        self.dh = _common.new_empty_like(hs) if self.need_dh else None
        self.dw = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if self.need_dw else None
        self.db = torch.zeros(ws.shape[0], dtype=torch.float32, device=ws.device) if self.need_db else None

    def rows(self, hs, ws, bs, top, ids, r0, beta, inv_t):
        """Rows r0 .. r0 + len(top) of hs against the teacher's top-k values and ids there: the student's logits at
        those ids (its head rows gathered a few rows at a time), the divergence and its gradient."""
        k, hdim = top.shape[1], hs.shape[1]
        c2 = max(1, TOPK_GATHER_BYTES // (k * hdim * max(4, hs.element_size())))
        for q0 in range(0, top.shape[0], c2):
            q1 = min(top.shape[0], q0 + c2)
            sel, h = ids[q0:q1], hs[r0 + q0:r0 + q1]
            w_rows = ws[sel]   # [c2, k, Hs]
            zs = torch.einsum("ch,ckh->ck", h, w_rows).float()
            if bs is not None:
                zs += bs[sel].float()
            self.loss[r0 + q0:r0 + q1] = _rows_torch(zs, top[q0:q1], beta, inv_t, self.write)
            if self.need_dh:   # zs holds dL/ds now
                self.dh[r0 + q0:r0 + q1] = torch.einsum("ck,ckh->ch", zs, w_rows.float()).to(self.dh.dtype)
            if self.need_dw:
                self.dw.index_put_((sel.reshape(-1),), (zs[..., None] * h[:, None, :].float()).reshape(-1, hdim),
                                   accumulate=True)
            if self.need_db:
                self.db.index_put_((sel.reshape(-1),), zs.reshape(-1), accumulate=True)

    def save(self, ctx, ws, bs):
        ctx.save_for_backward(self.dh, self.dw, self.db)
        ctx.dtypes = (ws.dtype, None if bs is None else bs.dtype)
        return self.loss.sum()


class _FusedLinearTopkJSD(torch.autograd.Function):
    """The top-k path of _FusedLinearJSD: valid rows only, the gradient computed in the forward."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, beta, inv_t, chunk_size, k):
        n, vocab = hs.shape[0], wt.shape[0]
        out = _TopkGrads(hs, ws, bs)
        c = max(1, min(n, chunk_size)) if chunk_size else default_chunk_size(n, vocab, ht.element_size())
        zt_ws = _common.new_empty((c, vocab), dtype=ht.dtype, device=ht.device)
        for r0 in range(0, n, c):
            r1 = min(n, r0 + c)
            zt = zt_ws[:r1 - r0]
            torch.matmul(ht[r0:r1], wt.t(), out=zt)
            if bt is not None:
                zt.add_(bt)
            top, ids = zt.topk(k, dim=-1)   # ms-swift's to_topk: the teacher's logits in its own dtype
            if vocab > ws.shape[0] and int(ids.max()) >= ws.shape[0]:   # a padded teacher column made its top-k
                raise ValueError(f"topk: a teacher top-{k} id ({int(ids.max())}) is beyond the student's vocabulary "
                                 f"({ws.shape[0]}); ms-swift's gather of the student's logits fails there too")
            out.rows(hs, ws, bs, top, ids, r0, beta, inv_t)
        return out.save(ctx, ws, bs)

    @staticmethod
    def backward(ctx, grad):
        return _FusedLinearJSD.backward(ctx, grad)


class _StudentTopkJSD(torch.autograd.Function):
    """fused_linear_jsd_topk: the teacher's top-k given (valid rows only)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, top, ids, beta, inv_t):
        out = _TopkGrads(hs, ws, bs)
        out.rows(hs, ws, bs, top, ids, 0, beta, inv_t)
        return out.save(ctx, ws, bs)

    @staticmethod
    def backward(ctx, grad):
        return _FusedLinearJSD.backward(ctx, grad)[:7]


def _check_student(student_hidden, student_weight, labels):
    _common.check_tensor("student_hidden", student_hidden, min_ndim=2)
    _common.check_tensor("student_weight", student_weight, ndim=2)
    if student_hidden.shape[-1] != student_weight.shape[1]:
        raise ValueError(f"student_hidden [..., {student_hidden.shape[-1]}] does not match student_weight "
                         f"{list(student_weight.shape)} ([V, H])")
    if labels.shape != student_hidden.shape[:-1]:
        raise ValueError(f"labels {list(labels.shape)} must be student_hidden's leading shape "
                         f"{list(student_hidden.shape[:-1])}")


def _check_options(beta, temperature, reduction):
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def _check(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, teacher_labels, student_bias,
           teacher_bias, beta, temperature, reduction, chunk_size, topk=None):
    _check_student(student_hidden, student_weight, labels)
    _common.check_tensor("teacher_hidden", teacher_hidden, min_ndim=2)
    _common.check_tensor("teacher_weight", teacher_weight, ndim=2)
    if teacher_hidden.shape[-1] != teacher_weight.shape[1]:
        raise ValueError(f"teacher_hidden [..., {teacher_hidden.shape[-1]}] does not match teacher_weight "
                         f"{list(teacher_weight.shape)} ([V, H])")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or
                             not 1 <= topk <= teacher_weight.shape[0]):
        raise ValueError(f"topk must be an int in [1, {teacher_weight.shape[0]}] (the teacher's vocabulary) or None, "
                         f"got {topk!r}")
    if topk is None and student_weight.shape[0] > teacher_weight.shape[0]:
        raise ValueError(f"the student's vocabulary ({student_weight.shape[0]}) is wider than the teacher's "
                         f"({teacher_weight.shape[0]}): fused_linear_jsd needs the teacher's to be as wide or wider")
    t_labels = labels if teacher_labels is None else teacher_labels
    if t_labels.shape != teacher_hidden.shape[:-1]:
        raise ValueError(f"{'labels' if teacher_labels is None else 'teacher_labels'} {list(t_labels.shape)} must "
                         f"be teacher_hidden's leading shape {list(teacher_hidden.shape[:-1])}")
    for name, t in (("labels", labels), ("teacher_labels", teacher_labels)):
        if t is not None and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    for name, b, w in (("student_bias", student_bias, student_weight), ("teacher_bias", teacher_bias, teacher_weight)):
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{name} must be [V] = [{w.shape[0]}], got {list(b.shape)}")
    _common.check_same_device(student_hidden=student_hidden, student_weight=student_weight,
                              teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, labels=labels,
                              teacher_labels=teacher_labels, student_bias=student_bias, teacher_bias=teacher_bias)
    _common.check_same_dtype(student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias)
    _common.check_same_dtype(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias)
    _check_options(beta, temperature, reduction)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")


def _valid_rows(hidden, labels, ignore_index):
    h = hidden.reshape(-1, hidden.shape[-1])
    idx = (labels.reshape(-1) != ignore_index).nonzero().squeeze(-1)
    return h.index_select(0, idx)


def fused_linear_jsd(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                     teacher_weight: torch.Tensor, labels: torch.Tensor, *, student_bias: Optional[torch.Tensor] = None,
                     teacher_bias: Optional[torch.Tensor] = None, teacher_labels: Optional[torch.Tensor] = None,
                     beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100, reduction: str = "sum",
                     chunk_size: Optional[int] = None, topk: Optional[int] = None) -> torch.Tensor:
    """GKD's generalized JSD over the rows whose label is not ``ignore_index``; no [N, V] logits.

    student_hidden [..., Hs] with student_weight [Vs, Hs] (+ student_bias [Vs]); teacher_hidden [..., Ht] with
    teacher_weight [V, Ht] (+ teacher_bias [V]), V >= Vs (a teacher whose embedding rows are padded wider, e.g. a
    Qwen2.5-7B teacher's 152064 for a 1.5B student's 151936: as ms-swift, the student's missing columns take the
    teacher's logits); labels [...] = student_hidden's leading shape, already shifted (labels[t]
    is the token predicted at t). teacher_labels (teacher_hidden's leading shape) picks the teacher's rows when its
    prompt differs (ms-swift's OPSD); it must mark as many rows as labels. beta in [0, 1] (0: KL(teacher || student),
    1: KL(student || teacher)), temperature > 0 divides both heads' logits. ``topk=k``: the divergence over each
    row's k largest teacher logits only (ms-swift's ``gkd_logits_topk``; both softmaxes renormalised over those k
    ids; with a teacher head wider than the student's, every top-k id must fall inside the student's vocabulary, as
    ms-swift's gather needs).
    Returns an fp32 scalar: the sum over valid rows (``reduction="sum"``, ms-swift's ``total``) or their mean (0.0
    with no valid row, still connected to the student's graph). Gradients reach the student's hidden states, weight
    and bias (a trainable head: fp32 sums of per-chunk products); the teacher gets none. The graph can be
    backpropagated once. On CPU tensors (no Triton) the same chunks run in PyTorch.
    """
    student_hidden, student_weight, student_bias = autocast_inputs(student_hidden, student_weight, student_bias)
    teacher_hidden, teacher_weight, teacher_bias = autocast_inputs(teacher_hidden, teacher_weight, teacher_bias)
    _check(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, teacher_labels, student_bias,
           teacher_bias, beta, temperature, reduction, chunk_size, topk)
    hs = _valid_rows(student_hidden, labels, ignore_index)
    with torch.no_grad():
        ht = _valid_rows(teacher_hidden, labels if teacher_labels is None else teacher_labels, ignore_index)
    if ht.shape[0] != hs.shape[0]:
        raise ValueError(f"teacher_labels mark {ht.shape[0]} rows, labels {hs.shape[0]}: student and teacher must "
                         f"score the same number of tokens")
    teacher_args = (ht.contiguous(), teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach(),
                    float(beta), 1.0 / float(temperature), chunk_size)
    if topk is not None:
        total = _FusedLinearTopkJSD.apply(hs.contiguous(), student_weight, student_bias, *teacher_args, topk)
    else:
        total = _FusedLinearJSD.apply(hs.contiguous(), student_weight, student_bias, *teacher_args,
                                      _common.use_triton(student_hidden))
    return total / max(1, hs.shape[0]) if reduction == "mean" else total


def fused_linear_jsd_topk(student_hidden: torch.Tensor, student_weight: torch.Tensor, labels: torch.Tensor,
                          teacher_topk_values: torch.Tensor, teacher_topk_ids: torch.Tensor, *,
                          student_bias: Optional[torch.Tensor] = None, teacher_labels: Optional[torch.Tensor] = None,
                          beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                          reduction: str = "sum") -> torch.Tensor:
    """:func:`fused_linear_jsd` with ``topk`` when the teacher's top-k arrives precomputed (ms-swift's teacher served
    by API, ``--teacher_model_server``): the student's logits at the given ids only, no [N, V] logits.

    student_hidden [..., Hs], student_weight [Vs, Hs] (+ student_bias [Vs]), labels [...] (already shifted);
    teacher_topk_values / teacher_topk_ids [..., k] (the teacher's top-k log-probs, or logits: the softmax over the k
    entries is the same) with the leading shape of teacher_labels (default: labels), ids < Vs. As ms-swift's
    ``extract_active``, rows whose k values are all -inf (positions the teacher did not cover) are left out of the sum
    and of the mean. Returns an fp32 scalar; gradients reach the student's hidden states, weight and bias.
    """
    student_hidden, student_weight, student_bias = autocast_inputs(student_hidden, student_weight, student_bias)
    _check_student(student_hidden, student_weight, labels)
    t_labels = labels if teacher_labels is None else teacher_labels
    if teacher_topk_values.shape != teacher_topk_ids.shape or teacher_topk_values.shape[:-1] != t_labels.shape:
        raise ValueError(f"teacher_topk_values {list(teacher_topk_values.shape)} and teacher_topk_ids "
                         f"{list(teacher_topk_ids.shape)} must both be [{', '.join(map(str, t_labels.shape))}, k]")
    if not teacher_topk_values.is_floating_point() or teacher_topk_ids.dtype.is_floating_point:
        raise ValueError(f"teacher_topk_values must be floating point and teacher_topk_ids integer, got "
                         f"{teacher_topk_values.dtype} and {teacher_topk_ids.dtype}")
    if student_bias is not None and tuple(student_bias.shape) != (student_weight.shape[0],):
        raise ValueError(f"student_bias must be [V] = [{student_weight.shape[0]}], got {list(student_bias.shape)}")
    _common.check_same_device(student_hidden=student_hidden, student_weight=student_weight, labels=labels,
                              teacher_topk_values=teacher_topk_values, teacher_topk_ids=teacher_topk_ids,
                              teacher_labels=teacher_labels, student_bias=student_bias)
    _check_options(beta, temperature, reduction)
    k = teacher_topk_values.shape[-1]
    s_idx = (labels.reshape(-1) != ignore_index).nonzero().squeeze(-1)
    t_idx = (t_labels.reshape(-1) != ignore_index).nonzero().squeeze(-1)
    if s_idx.numel() != t_idx.numel():
        raise ValueError(f"teacher_labels mark {t_idx.numel()} rows, labels {s_idx.numel()}: student and teacher must "
                         f"score the same number of tokens")
    top = teacher_topk_values.detach().reshape(-1, k).index_select(0, t_idx)
    ids = teacher_topk_ids.reshape(-1, k).index_select(0, t_idx)
    covered = ~torch.isinf(top).all(-1)   # ms-swift's extract_active drops positions the teacher did not cover
    if not bool(covered.all()):
        s_idx, top, ids = s_idx[covered], top[covered], ids[covered]
    if ids.numel() and (int(ids.max()) >= student_weight.shape[0] or int(ids.min()) < 0):
        raise ValueError(f"teacher_topk_ids must index the student's vocabulary [0, {student_weight.shape[0]}), got "
                         f"ids in [{int(ids.min())}, {int(ids.max())}]")
    hs = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, s_idx)
    total = _StudentTopkJSD.apply(hs.contiguous(), student_weight, student_bias, top.contiguous(), ids.contiguous(),
                                  float(beta), 1.0 / float(temperature))
    return total / max(1, hs.shape[0]) if reduction == "mean" else total


def fused_linear_jsd_reference(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *,
                               student_bias=None, teacher_bias=None, teacher_labels=None, beta=0.5, temperature=1.0,
                               ignore_index=-100, reduction="sum", topk=None, **_unused):
    """ms-swift's logits path: both heads' [N, V] logits, ``.float()``, divided by the temperature, log-softmax and
    the divergence as ``swift.rlhf_trainers.gkd_loss.jsd_loss`` writes it. Same arguments and result as
    :func:`fused_linear_jsd`."""
    s_mask = labels.reshape(-1) != ignore_index
    t_mask = s_mask if teacher_labels is None else teacher_labels.reshape(-1) != ignore_index
    s = torch.nn.functional.linear(student_hidden.reshape(-1, student_hidden.shape[-1])[s_mask], student_weight,
                                   student_bias).float() / temperature
    with torch.no_grad():
        t = torch.nn.functional.linear(teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[t_mask],
                                       teacher_weight, teacher_bias).float() / temperature
    if topk is not None:   # ms-swift's to_topk on the teacher's logits, the student's gathered at those ids
        top, ids = torch.nn.functional.linear(teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[t_mask].detach(),
                                              teacher_weight.detach(), teacher_bias).topk(topk, dim=-1)
        s, t = s.gather(-1, ids), top.float() / temperature
    elif s.shape[-1] < t.shape[-1]:   # ms-swift's _align_vocab: the teacher's logits fill the student's missing columns
        s = torch.cat([s, t[:, s.shape[-1]:]], -1)
    lp, lq = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    if beta == 0:
        rows = (lq.exp() * (lq - lp)).sum(-1)
    elif beta == 1:
        rows = (lp.exp() * (lp - lq)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log1p(-beta), lq + math.log(beta)]), 0)
        rows = beta * (lq.exp() * (lq - lm)).sum(-1) + (1 - beta) * (lp.exp() * (lp - lm)).sum(-1)
    total = rows.sum()
    return total / max(1, rows.shape[0]) if reduction == "mean" else total
