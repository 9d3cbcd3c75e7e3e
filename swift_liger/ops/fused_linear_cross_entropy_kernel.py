"""Fused linear + cross-entropy (FLCE) through one fixed rolling chunk buffer.

The [N, V] logits are never materialised. Tokens go through ONE workspace ``ws`` of [C, V] elements in the input
dtype, allocated once per call and reused for every chunk of C tokens:

    pass 1 (forward, token chunks):  ws = h[c] @ W^T (+ b)                       GEMM 1 (cuBLAS, out=ws)
                                     Triton: per-row lse / loss, then ws <- dlogits (unit scale) in place
                                     dh[c] = ws @ W   (written straight into the grad buffer)  GEMM 2
                                     "accumulate" only: dW_acc += ws^T @ h[c] in fp32            GEMM 3
    backward:                        dh *= grad_out (in place), dW_acc -> dW with the scale folded into the cast
    pass 2 ("recompute", backward, VOCAB slices of all N tokens, using the saved lse):
                                     ws = h @ W[vs]^T (+ b[vs])                                  GEMM 3
                                     Triton: ws <- grad_out * dlogits
                                     dW[vs] = ws^T @ h  (one GEMM over all N: fp32 inside, one rounding) GEMM 4

Because every token chunk holds the full vocabulary, dh needs no accumulation across chunks; dW either
accumulates across token chunks in an fp32 [V, H] buffer ("accumulate", 3 GEMMs, +V*H*4 bytes), accumulates in the
weight's own dtype ("accumulate_lowp", 3 GEMMs; the buffer becomes the gradient, scaled in place: no memory beyond
the gradient and the workspace; one bf16/fp16 rounding per token chunk, as Liger-Kernel accumulates by default) or
is recomputed per vocab slice ("recompute", 4 GEMMs, no buffer beyond the workspace). Frozen W (LoRA): 2 GEMMs, no
dW work.

Numbers for the Llama-3-8B head, N=8192, H=4096, V=128256, bf16 (H200, ~790 TFLOP/s bf16 dense):
    each GEMM = 2*N*H*V = 8.6 TFLOP ~ 10.9 ms.   frozen W: 2 GEMMs ~ 23 ms.   "accumulate": 3 GEMMs ~ 35-38 ms
    (the K=C dW GEMM also reads+writes the fp32 buffer every chunk), "recompute": 4 GEMMs ~ 46 ms.
    fp32 dW buffer: V*H*4 = 2.1 GB; workspace: C*V*2 = 262 MB at C=1024 (8 chunks).
    "auto" picks "accumulate" only while V*H*4 <= DW_ACCUMULATE_BUDGET_BYTES (256 MiB), so large heads recompute.

Loss semantics per valid token (HF ForCausalLMLoss on already-shifted labels): z = (h @ W^T + b) computed in the
input dtype (like an HF lm_head) then ``.float()``; optional softcap z = c*tanh(z/c); lse = logsumexp(z);
nll = lse - z[label]; label smoothing as torch F.cross_entropy: (1-eps)*nll + eps*(lse - mean_v z_v);
z-loss adds z_loss * lse^2. Ignored tokens contribute 0.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from . import _common, _launch
from ._scale import scale_into
from ._loss import LABEL_DTYPES, check_label_range, check_options, int_labels, labels_checked, reduce
from ._loss import tanh as _tanh

# ---------------------------------------------------------------------------------------------------------------
# Sizing (H200 defaults; see the module docstring for the arithmetic)
# ---------------------------------------------------------------------------------------------------------------
WORKSPACE_BYTES = 256 << 20          # rolling [C, V] logits buffer (and the pass-2 [N, Vs] buffer)
CHUNK_ALIGN = 128                    # token chunk rows: a multiple of the GEMM M tile
SLICE_ALIGN = 128                    # vocab slice width in pass 2: a multiple of the GEMM N tile
DW_ACCUMULATE_BUDGET_BYTES = 256 << 20  # "auto": accumulate dW in fp32 only when V*H*4 fits in this

DW_STRATEGIES = ("auto", "accumulate", "accumulate_lowp", "recompute")


class FLCEOutput(NamedTuple):
    """loss: the reduced loss (0-d fp32), or [*labels.shape] fp32 for reduction="none".
    token_loss: [*labels.shape] fp32 per-token loss before the divisor (0 at ignored tokens), or None.
    lse: [*labels.shape] fp32 logsumexp of the (softcapped) fp32 logits (no gradient), or None.
    argmax: [*labels.shape] int64 arg max of each position's logits (every position; no gradient), or None."""
    loss: torch.Tensor
    token_loss: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    argmax: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _logit_transform(z, cap, inv_temp, HAS_CAP: tl.constexpr, HAS_TEMP: tl.constexpr):
    """Model logits -> the logits the loss sees: softcap c*tanh(z/c) (in the model), then 1/temperature (in the
    trainer). Returns them and dz_loss/dz_model, the chain factor for their gradient (1.0 when neither applies)."""
    chain = 1.0
    if HAS_CAP:
        th = _tanh(z / cap)
        z = cap * th
        chain = 1.0 - th * th
    if HAS_TEMP:
        z = z * inv_temp
        chain = chain * inv_temp
    return z, chain


@triton.jit
def _flce_rows_kernel(
    z_ptr, stride_z,            # [R, V] logits chunk (input dtype); overwritten with dlogits when WRITE_GRAD
    labels_ptr,                 # [R] int
    loss_ptr, lse_ptr, sum_ptr, ent_ptr,  # [R] fp32 outputs (sum_ptr / ent_ptr written only when WRITE_SUM / WRITE_ENT)
    am_ptr,                     # [R] int32 output, written only when WRITE_ARGMAX
    V, ignore_index,
    eps, cap, z_loss, inv_temp,  # fp32 scalars: label smoothing, softcap, z-loss weight, 1/temperature
    HAS_CAP: tl.constexpr, HAS_EPS: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_TEMP: tl.constexpr,
    WRITE_GRAD: tl.constexpr, WRITE_SUM: tl.constexpr, WRITE_ENT: tl.constexpr, WRITE_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per token row: online max/sum-exp over V, then (optionally) dlogits in place.

    dlogits (gradient of this row's loss, unit scale) = p*(1 + 2*z_loss*lse) - (1-eps)*onehot - eps/V,
    times the softcap / temperature chain. Ignored rows get zeros; out-of-range labels get loss NaN, zero grads.
    For every row, ignored ones included: WRITE_SUM stores its sum of (transformed) logits; WRITE_ENT its entropy
    -sum_v p_v log p_v = lse - sum_v p_v z_v (the p-weighted sum kept online beside the sum of exponentials: no
    second read); WRITE_ARGMAX the column of its largest logit (the first on ties, as torch.argmax).
    """
    row = tl.program_id(0)
    base = z_ptr + tl.cast(row, tl.int64) * stride_z
    offs = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < V)
    valid = (~ignored) & in_range

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    sum_z = tl.full((), 0.0, tl.float32)
    sum_pz = tl.full((), 0.0, tl.float32)   # sum_v exp(z_v - m) * z_v, rescaled with s
    arg = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _logit_transform(z, cap, inv_temp, HAS_CAP, HAS_TEMP)
        z0 = tl.where(mask, z, 0.0)
        if HAS_EPS or WRITE_SUM:
            sum_z += tl.sum(z0, 0)
        z = tl.where(mask, z, float("-inf"))
        block_max = tl.max(z, 0)
        if WRITE_ARGMAX:   # strictly greater: an earlier block keeps a tie
            arg = tl.where(block_max > m, start + tl.argmax(z, 0), arg)
        m_new = tl.maximum(m, block_max)
        e = tl.exp(z - m_new)
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(e, 0)
        if WRITE_ENT:
            sum_pz = sum_pz * alpha + tl.sum(e * z0, 0)
        m = m_new
    lse = m + tl.log(s)

    # The label logit is read before the row is overwritten; a masked-out label reads column 0.
    zy = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    zy, _ = _logit_transform(zy, cap, inv_temp, HAS_CAP, HAS_TEMP)
    loss = lse - zy
    if HAS_EPS:
        loss = (1.0 - eps) * loss + eps * (lse - sum_z / V)
    if HAS_ZLOSS:
        loss += z_loss * lse * lse
    loss = tl.where(valid, loss, 0.0)
    loss = tl.where(ignored | in_range, loss, float("nan"))
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    if WRITE_SUM:
        tl.store(sum_ptr + row, sum_z)
    if WRITE_ENT:
        tl.store(ent_ptr + row, lse - sum_pz / s)
    if WRITE_ARGMAX:
        tl.store(am_ptr + row, arg)

    if WRITE_GRAD:
        coef = 1.0
        if HAS_ZLOSS:
            coef = 1.0 + 2.0 * z_loss * lse
        w_label = 1.0
        w_uniform = 0.0
        if HAS_EPS:
            w_label = 1.0 - eps
            w_uniform = eps / V
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            z, chain = _logit_transform(z, cap, inv_temp, HAS_CAP, HAS_TEMP)
            g = tl.exp(z - lse) * coef - tl.where(cols == label, w_label, 0.0) - w_uniform
            if HAS_CAP or HAS_TEMP:
                g = g * chain
            g = tl.where(valid, g, 0.0)
            tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flce_slice_kernel(
    z_ptr, stride_z,            # [N, Vs] logits of vocab columns [v0, v0+Vs) for all tokens; overwritten in place
    labels_ptr, lse_ptr,        # [N] int, [N] fp32 (saved by pass 1)
    scale_ptr, scale_stride,    # fp32 grad scale: one value (stride 0) or one per row (stride 1)
    v0, Vs, V, ignore_index,
    eps, cap, z_loss, inv_temp,
    HAS_CAP: tl.constexpr, HAS_EPS: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_TEMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 2: dlogits = scale * d(loss)/dz for one vocab slice, from the saved lse (no row reduction needed)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < Vs
    ptrs = z_ptr + tl.cast(row, tl.int64) * stride_z + cols
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < V)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride)

    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z, chain = _logit_transform(z, cap, inv_temp, HAS_CAP, HAS_TEMP)
    coef = 1.0
    if HAS_ZLOSS:
        coef = 1.0 + 2.0 * z_loss * lse
    w_label = 1.0
    w_uniform = 0.0
    if HAS_EPS:
        w_label = 1.0 - eps
        w_uniform = eps / V
    g = tl.exp(z - lse) * coef - tl.where(cols + v0 == label, w_label, 0.0) - w_uniform
    if HAS_CAP or HAS_TEMP:
        g = g * chain
    g = tl.where(valid, g * scale, 0.0)
    tl.store(ptrs, g.to(z_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class FLCEConfig:
    """Launch of a Triton FLCE kernel: block_v (BLOCK_V) vocabulary columns per loop step ("rows", one program per
    token row) or per program ("slice", a 2-D grid of rows x column blocks), num_warps."""
    block_v: int
    num_warps: int


LAUNCH_CONFIGS = {"rows": FLCEConfig, "slice": FLCEConfig}


def launch_config(kind: str, n_cols: int, device) -> FLCEConfig:
    """``kind`` "rows" (pass 1, n_cols = V) or "slice" (pass 2, n_cols = the slice width): next_pow2(n_cols)
    capped at 4096 columns, warps by block size (_common.num_warps_for); every device."""
    if kind not in LAUNCH_CONFIGS:
        raise ValueError(f"kind must be 'rows' or 'slice', got {kind!r}")
    block = min(4096, _common.next_pow2(n_cols))
    return _common.apply_override(__name__, kind, FLCEConfig(block, _common.num_warps_for(block)))


_ROWS = _launch.FastLaunch(_flce_rows_kernel)
_SLICE = _launch.FastLaunch(_flce_slice_kernel)


def _launch_rows(z, labels, loss, lse, logit_sum, entropy, argmax, V, ignore_index, eps, cap, z_loss, temperature,
                 write_grad):
    cfg = launch_config("rows", V, z.device)
    _ROWS.launch(
        (z.shape[0],), z, z.stride(0), labels, loss, lse, logit_sum if logit_sum is not None else lse,
        entropy if entropy is not None else lse, argmax if argmax is not None else labels, V, ignore_index, float(eps),
        float(cap or 1.0), float(z_loss), 1.0 / float(temperature),
        HAS_CAP=cap is not None and cap > 0, HAS_EPS=eps > 0, HAS_ZLOSS=z_loss > 0, HAS_TEMP=temperature != 1.0,
        WRITE_GRAD=write_grad, WRITE_SUM=logit_sum is not None, WRITE_ENT=entropy is not None,
        WRITE_ARGMAX=argmax is not None,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)


def _launch_slice(z, labels, lse, scale, v0, V, ignore_index, eps, cap, z_loss, temperature):
    n, vs = z.shape
    cfg = launch_config("slice", vs, z.device)
    _SLICE.launch(
        (n, _common.cdiv(vs, cfg.block_v)), z, z.stride(0), labels, lse, scale, 0 if scale.dim() == 0 else 1, v0, vs,
        V, ignore_index,
        float(eps), float(cap or 1.0), float(z_loss), 1.0 / float(temperature),
        HAS_CAP=cap is not None and cap > 0, HAS_EPS=eps > 0, HAS_ZLOSS=z_loss > 0, HAS_TEMP=temperature != 1.0,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)


# ---------------------------------------------------------------------------------------------------------------
# GEMMs (module-level so tests can count them)
# ---------------------------------------------------------------------------------------------------------------

def _gemm_logits(h, w, b, out):
    """out[R, Vs] = h[R, H] @ w[Vs, H]^T (+ b[Vs]), in the input dtype like an HF lm_head."""
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)


def _gemm_dh(dz, w, out):
    """out[R, H] = dz[R, V] @ w[V, H] (fp32 accumulation inside the GEMM, one rounding)."""
    torch.mm(dz, w, out=out)


def _gemm_dw(dz_t, h, out):
    """out[Vs, H] = dz_t[Vs, N] @ h[N, H] over all tokens at once (pass 2)."""
    torch.mm(dz_t, h, out=out)


@functools.lru_cache(maxsize=None)
def _fp32_out_gemm_mode(device: torch.device) -> str:
    """How to accumulate a bf16/fp16 product into an fp32 buffer on this device.

    "addmm": torch.addmm(acc, a, b, out_dtype=fp32, out=acc) (cuBLAS, fp32 C in the epilogue; torch >= 2.9 CUDA)
    "float": upcast the operands (CPU; only tests run this)
    "slices": fallback, the product in the input dtype (fp32 inside the GEMM) added into the fp32 buffer
    """
    if device.type != "cuda":
        return "float"
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        acc = torch.empty(16, 16, dtype=torch.float32, device=device)
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        if float(acc[0, 0]) == 32.0:   # one host sync per process, not on the hot path
            return "addmm"
    except Exception:   # noqa: BLE001 - any failure means the overload is missing or broken
        pass
    _common.logger.warning("swift_liger: torch.addmm(out_dtype=float32) is unavailable; fused linear cross-entropy "
                           "accumulates dW from input-dtype chunk products")
    return "slices"


def _gemm_dw_acc(acc, dz_t, h, first):
    """acc[Va, H] (fp32) (+)= dz_t[Va, R] @ h[R, H]; fp32 accumulation across chunks."""
    if acc.dtype == dz_t.dtype:
        if first:
            torch.mm(dz_t, h, out=acc)
        else:
            acc.addmm_(dz_t, h)
        return
    mode = _fp32_out_gemm_mode(acc.device)
    if mode == "addmm":
        if first:
            torch.mm(dz_t, h, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, dz_t, h, out_dtype=torch.float32, out=acc)
    elif mode == "float":
        if first:
            torch.mm(dz_t.float(), h.float(), out=acc)
        else:
            acc.addmm_(dz_t.float(), h.float())
    else:
        step = max(1, (WORKSPACE_BYTES // 2) // max(1, h.shape[1] * h.element_size()))
        for r0 in range(0, acc.shape[0], step):
            part = torch.mm(dz_t[r0:r0 + step], h)
            if first:
                acc[r0:r0 + step].copy_(part)
            else:
                acc[r0:r0 + step].add_(part)


# ---------------------------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------------------------

def default_chunk_size(n: int, v: int, elt: int) -> int:
    """Token rows per chunk: the [C, V] workspace fits WORKSPACE_BYTES, C a multiple of CHUNK_ALIGN, chunks balanced."""
    c = max(CHUNK_ALIGN, WORKSPACE_BYTES // max(1, v * elt) // CHUNK_ALIGN * CHUNK_ALIGN)
    if c >= n:
        return max(1, n)
    chunks = _common.cdiv(n, c)
    return min(c, _common.cdiv(_common.cdiv(n, chunks), CHUNK_ALIGN) * CHUNK_ALIGN)


def _slice_width(n: int, v_todo: int, ws_elems: int) -> int:
    """Vocab columns per pass-2 slice: [N, Vs] reuses the workspace size, Vs a multiple of SLICE_ALIGN, balanced."""
    vs = max(SLICE_ALIGN, ws_elems // max(1, n) // SLICE_ALIGN * SLICE_ALIGN)
    if vs >= v_todo:
        return max(1, v_todo)
    slices = _common.cdiv(v_todo, vs)
    return min(vs, _common.cdiv(_common.cdiv(v_todo, slices), SLICE_ALIGN) * SLICE_ALIGN)


def _resolve_dw_rows(strategy: str, v: int, h: int, reduction: str) -> int:
    """Leading vocab rows whose dW accumulates during pass 1 (the rest is recomputed in pass 2)."""
    if reduction == "none":   # per-token grad scales: accumulated dW would be unusable
        return 0
    if strategy in ("accumulate", "accumulate_lowp"):
        return v
    if strategy == "recompute":
        return 0
    return v if v * h * 4 <= DW_ACCUMULATE_BUDGET_BYTES else 0


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------

def _flce_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, temperature: float,
                  chunk_size: int, dw_acc_rows: int, need_dh: bool, need_db: bool, write_grad: bool, need_sum: bool,
                  dw_acc_lowp: bool = False, need_entropy: bool = False, need_argmax: bool = False):
    """Pass 1 over token chunks.

    hidden [N, H], weight [V, H], bias [V] or None, labels [N] int; softcap 0 means none, temperature 1.0 none.
    Returns token_loss [N] fp32, lse [N] fp32, dh [N, H] (input dtype, unit scale; [0] unless need_dh),
    dw_acc [dw_acc_rows, H] fp32 (unit scale, sum over all tokens; in the weight's dtype when dw_acc_lowp), db_acc
    [V] fp32 ([0] unless need_db),
    logit_sum [N] fp32 (each row's sum of the logits the loss sees; [0] unless need_sum), entropy [N] fp32 (of each
    row's softmax over the logits the loss sees; [0] unless need_entropy), argmax [N] int32 (each row's arg max;
    [0] unless need_argmax).
    """
    n, h_dim = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    cap = softcap if softcap > 0 else None
    token_loss = _common.new_empty((n,), dtype=torch.float32, device=dev)
    lse = _common.new_empty((n,), dtype=torch.float32, device=dev)
    dh = _common.new_empty((n, h_dim), dtype=hidden.dtype, device=dev) if (write_grad and need_dh) \
        else hidden.new_empty((0,))
    acc_rows = dw_acc_rows if write_grad else 0
    acc = _common.new_empty((acc_rows, h_dim), dtype=weight.dtype if dw_acc_lowp else torch.float32, device=dev)
    db = _common.new_empty((v,), dtype=torch.float32, device=dev) if (write_grad and need_db) \
        else hidden.new_empty((0,), dtype=torch.float32)
    logit_sum = _common.new_empty((n if need_sum else 0,), dtype=torch.float32, device=dev)
    entropy = _common.new_empty((n if need_entropy else 0,), dtype=torch.float32, device=dev)
    argmax = _common.new_empty((n if need_argmax else 0,), dtype=torch.int32, device=dev)
    if n == 0:
        acc.zero_()
        db.zero_()
        return token_loss, lse, dh, acc, db, logit_sum, entropy, argmax

    c = min(chunk_size, n)
    ws = _common.new_empty((c * v,), dtype=hidden.dtype, device=dev)
    with _no_autocast(dev):
        for r0 in range(0, n, c):
            rows = min(c, n - r0)
            z = ws[:rows * v].view(rows, v)
            h = hidden[r0:r0 + rows]
            _gemm_logits(h, weight, bias, z)
            _launch_rows(z, labels[r0:r0 + rows], token_loss[r0:r0 + rows], lse[r0:r0 + rows],
                         logit_sum[r0:r0 + rows] if need_sum else None, entropy[r0:r0 + rows] if need_entropy else None,
                         argmax[r0:r0 + rows] if need_argmax else None, v, ignore_index, label_smoothing, cap,
                         z_loss, temperature, write_grad)
            if not write_grad:
                continue
            if dh.numel():
                _gemm_dh(z, weight, dh[r0:r0 + rows])
            if acc_rows:
                _gemm_dw_acc(acc, z[:, :acc_rows].t(), h, r0 == 0)
            if db.numel():
                if r0 == 0:
                    torch.sum(z, 0, dtype=torch.float32, out=db)
                else:
                    db.add_(z.sum(0, dtype=torch.float32))
    return token_loss, lse, dh, acc, db, logit_sum, entropy, argmax


def _flce_backward(dh: torch.Tensor, dw_acc: torch.Tensor, db_acc: torch.Tensor, scale: torch.Tensor,
                   hidden: Optional[torch.Tensor], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   labels: Optional[torch.Tensor], lse: Optional[torch.Tensor], need_dh: bool, need_dw: bool,
                   need_db: bool, v: int, h_dim: int, w_dtype: torch.dtype, b_dtype: torch.dtype, ignore_index: int,
                   label_smoothing: float, softcap: float, z_loss: float, temperature: float, chunk_size: int,
                   inplace: bool):
    """Scale the pass-1 grads by grad_output and run pass 2 (vocab slices) for the dW rows not accumulated.

    dh [N, H] / dw_acc [Va, H] fp32 / db_acc [V] fp32: unit-scale grads from pass 1 (empty when not needed).
    scale: fp32, 0-d (d loss_sum) or [N] (per token: reduction="none" or a gradient through token_loss).
    hidden [N, H], weight [V, H], bias, labels [N], lse [N]: needed only by pass 2 (None when it cannot run).
    Returns grad_hidden [N, H] (``dh`` itself, scaled in place, when ``inplace``), grad_weight [V, H] in w_dtype,
    grad_bias [V] in b_dtype (empty [0] tensors for grads not needed).
    """
    dev = scale.device
    per_row = scale.dim() == 1
    cap = softcap if softcap > 0 else None

    def empty():   # a distinct tensor per unused output (custom-op outputs may not alias)
        return torch.empty((0,), dtype=w_dtype, device=dev)

    grad_h = empty()
    if need_dh:   # fp32 math, one rounding (ops/_scale.py: torch's mixed-dtype mul runs at ~0.9 TB/s)
        grad_h = scale_into(dh, scale, dh if inplace else _common.new_empty_like(dh))
        if inplace:   # a second backward through the saved dh must fail, as after torch's mul_
            torch.autograd.graph.increment_version(dh)

    grad_w, grad_b, v_start = empty(), empty(), v
    if need_dw:
        acc_rows = 0 if per_row else dw_acc.shape[0]
        if inplace and acc_rows == v and dw_acc.dtype == w_dtype:   # accumulate_lowp: the buffer is the gradient
            grad_w = scale_into(dw_acc, scale, dw_acc)
            torch.autograd.graph.increment_version(dw_acc)
        else:
            grad_w = _common.new_empty((v, h_dim), dtype=w_dtype, device=dev)
            if acc_rows:
                scale_into(dw_acc, scale, grad_w[:acc_rows])
        v_start = acc_rows
    if need_db:
        grad_b = _common.new_empty((v,), dtype=b_dtype, device=dev)
        if per_row:
            v_start = 0
        else:
            scale_into(db_acc, scale, grad_b)
    if v_start == v:
        return grad_h, grad_w, grad_b
    if hidden is None:
        raise RuntimeError("fused_linear_cross_entropy: a gradient through token_loss needs row_grads=True "
                           "(hidden and weight were not kept for backward)")
    n = hidden.shape[0]
    if n == 0:
        if need_dw:
            grad_w[v_start:].zero_()
        if need_db:
            grad_b.zero_()
        return grad_h, grad_w, grad_b
    vs = _slice_width(n, v - v_start, min(chunk_size, n) * v)
    ws = _common.new_empty((n * vs,), dtype=hidden.dtype, device=dev)
    with _no_autocast(dev):
        for v0 in range(v_start, v, vs):
            cols = min(vs, v - v0)
            z = ws[:n * cols].view(n, cols)
            _gemm_logits(hidden, weight[v0:v0 + cols], None if bias is None else bias[v0:v0 + cols], z)
            _launch_slice(z, labels, lse, scale, v0, v, ignore_index, label_smoothing, cap, z_loss, temperature)
            if need_dw:
                _gemm_dw(z.t(), hidden, grad_w[v0:v0 + cols])
            if need_db and per_row:
                grad_b[v0:v0 + cols].copy_(z.sum(0, dtype=torch.float32))
    return grad_h, grad_w, grad_b


class _no_autocast:
    """The launchers pick dtypes themselves; autocast must not re-cast the out= GEMMs."""

    def __init__(self, device: torch.device):
        self.ctx = torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


# ---------------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile keeps each launcher as one opaque node)
# ---------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("swift_liger::flce_forward", mutates_args=())
def _flce_forward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                     ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, temperature: float,
                     chunk_size: int, dw_acc_rows: int, need_dh: bool, need_db: bool, write_grad: bool,
                     need_sum: bool, dw_acc_lowp: bool = False, need_entropy: bool = False, need_argmax: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
    return _flce_forward(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, z_loss, temperature,
                         chunk_size, dw_acc_rows, need_dh, need_db, write_grad, need_sum, dw_acc_lowp, need_entropy,
                         need_argmax)


@_flce_forward_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, z_loss, temperature, chunk_size,
      dw_acc_rows, need_dh, need_db, write_grad, need_sum, dw_acc_lowp=False, need_entropy=False, need_argmax=False):
    n, h_dim = hidden.shape
    v = weight.shape[0]
    f32 = torch.float32
    dh = hidden.new_empty((n, h_dim)) if (write_grad and need_dh) else hidden.new_empty((0,))
    acc = hidden.new_empty((dw_acc_rows if write_grad else 0, h_dim), dtype=weight.dtype if dw_acc_lowp else f32)
    db = hidden.new_empty((v,) if (write_grad and need_db) else (0,), dtype=f32)
    logit_sum = hidden.new_empty((n if need_sum else 0,), dtype=f32)
    entropy = hidden.new_empty((n if need_entropy else 0,), dtype=f32)
    argmax = hidden.new_empty((n if need_argmax else 0,), dtype=torch.int32)
    return (hidden.new_empty((n,), dtype=f32), hidden.new_empty((n,), dtype=f32), dh, acc, db, logit_sum, entropy,
            argmax)


@torch.library.custom_op("swift_liger::flce_backward", mutates_args=())
def _flce_backward_op(dh: torch.Tensor, dw_acc: torch.Tensor, db_acc: torch.Tensor, scale: torch.Tensor,
                      hidden: Optional[torch.Tensor], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                      labels: Optional[torch.Tensor], lse: Optional[torch.Tensor], need_dh: bool, need_dw: bool,
                      need_db: bool, v: int, h_dim: int, w_dtype: torch.dtype, b_dtype: torch.dtype,
                      ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, temperature: float,
                      chunk_size: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A custom op may not return (an alias of) its input, so the compiled path never scales dh in place.
    return _flce_backward(dh, dw_acc, db_acc, scale, hidden, weight, bias, labels, lse, need_dh, need_dw, need_db,
                          v, h_dim, w_dtype, b_dtype, ignore_index, label_smoothing, softcap, z_loss, temperature,
                          chunk_size, False)


@_flce_backward_op.register_fake
def _(dh, dw_acc, db_acc, scale, hidden, weight, bias, labels, lse, need_dh, need_dw, need_db, v, h_dim, w_dtype,
      b_dtype, ignore_index, label_smoothing, softcap, z_loss, temperature, chunk_size, inplace):
    grad_h = dh.new_empty(dh.shape) if need_dh else scale.new_empty((0,), dtype=w_dtype)
    grad_w = scale.new_empty((v, h_dim) if need_dw else (0,), dtype=w_dtype)
    grad_b = scale.new_empty((v,), dtype=b_dtype) if need_db else scale.new_empty((0,), dtype=w_dtype)
    return grad_h, grad_w, grad_b


# ---------------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------------

class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V]|None, labels [N], options...)
    -> (loss_sum 0-d, token_loss [N], lse [N], logit_sum [N] or [0] unless need_sum, entropy [N] or [0] unless
    need_entropy, argmax [N] int32 or [0] unless need_argmax).

    Outputs fp32 but argmax. Gradients flow from loss_sum and token_loss (the others are non-differentiable);
    ``row_grads`` says whether token_loss may receive one (then pass 2 may need hidden/weight in backward, so they
    are kept). swift_liger.ops.logprobs_op uses this Function with row_grads=True: log p = -token_loss.
    The gradients are formed in forward at unit scale and scaled by grad_output in backward, so the graph can be
    backpropagated only once (a second backward raises the saved-tensor version error). Unless pass 2 can run,
    backward reads neither hidden nor weight: a ZeRO-3 weight may be re-partitioned after forward, and hidden is
    not kept alive.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, z_loss, chunk_size,
                dw_acc_rows, row_grads, temperature, need_sum, dw_acc_lowp=False, need_entropy=False,
                need_argmax=False):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        write_grad = need_dh or need_dw or need_db
        v = weight.shape[0]
        acc_rows = dw_acc_rows if need_dw else 0
        fwd = _common.compiled_or_eager("swift_liger::flce_forward", _flce_forward)
        token_loss, lse, dh, acc, db_acc, logit_sum, entropy, argmax = fwd(
            hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, z_loss, temperature, chunk_size,
            acc_rows, need_dh, need_db, write_grad, need_sum, dw_acc_lowp, need_entropy, need_argmax)
        keep = (need_dw and (acc_rows < v or row_grads)) or (need_db and row_grads)
        kept = (hidden, weight, bias, labels, lse) if keep else (None,) * 5
        ctx.save_for_backward(dh, acc, db_acc, *kept)
        ctx.meta = (need_dh, need_dw, need_db, v, hidden.shape[1], weight.dtype,
                    bias.dtype if bias is not None else weight.dtype)
        ctx.opts = (ignore_index, label_smoothing, softcap, z_loss, temperature, chunk_size)
        ctx.row_grads = row_grads
        ctx.mark_non_differentiable(lse, logit_sum, entropy, argmax)
        ctx.set_materialize_grads(False)
        return token_loss.sum(), token_loss, lse, logit_sum, entropy, argmax

    @staticmethod
    def backward(ctx, grad_sum, grad_tok, grad_lse, grad_logit_sum, grad_entropy, grad_argmax):
        need_dh, need_dw, need_db = ctx.meta[:3]
        none = (None,) * 13
        if grad_sum is None and (grad_tok is None or not ctx.row_grads):
            return (None, None, None) + none
        saved = ctx.saved_tensors
        if not ctx.row_grads:   # token_loss was not handed out; compiled graphs pass zeros for it
            grad_tok = None
        if grad_tok is not None:
            scale = grad_tok.to(torch.float32).reshape(-1)
            if grad_sum is not None:
                scale = scale + grad_sum.to(torch.float32)
            scale = scale.contiguous()
        else:
            scale = grad_sum.to(torch.float32).reshape(())
        if torch.compiler.is_compiling():
            bwd, inplace = torch.ops.swift_liger.flce_backward, False
        else:
            bwd, inplace = _flce_backward, True
        gh, gw, gb = bwd(*saved[:3], scale, *saved[3:], *ctx.meta, *ctx.opts, inplace)
        return (gh if need_dh else None, gw if need_dw else None, gb if need_db else None) + none


# ---------------------------------------------------------------------------------------------------------------
# Reference (HF eager way; also the CPU fallback and the "eager" benchmark peer)
# ---------------------------------------------------------------------------------------------------------------

def _reduce(loss_sum, token_loss, labels, ignore_index, reduction, num_items_in_batch):
    valid = (labels != ignore_index).sum() if reduction == "mean" and num_items_in_batch is None else None
    return reduce(loss_sum, token_loss, valid, reduction, num_items_in_batch)


def _pack(loss, token_loss, lse, return_token_loss, return_lse, argmax=None):
    if not (return_token_loss or return_lse or argmax is not None):
        return loss
    return FLCEOutput(loss, token_loss if return_token_loss else None, lse if return_lse else None, argmax)


def fused_linear_cross_entropy_reference(hidden, weight, labels, bias=None, *, ignore_index=-100,
                                         label_smoothing=0.0, softcap=None, z_loss=0.0, reduction="mean",
                                         num_items_in_batch=None, return_token_loss=False, return_lse=False,
                                         return_argmax=False, **_unused):
    """PyTorch reference, written like HF eager: logits = hidden @ W^T (+ b) in the input dtype, ``.float()``, CE.

    Same arguments, shapes and return values as :func:`fused_linear_cross_entropy` (chunking options ignored).
    Materialises the [N, V] logits (input dtype and fp32): this is the memory-hungry baseline.
    """
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = int_labels(labels.reshape(-1))
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    token_loss = torch.nn.functional.cross_entropy(logits, y.long(), ignore_index=ignore_index, reduction="none",
                                                   label_smoothing=label_smoothing)
    lse = torch.logsumexp(logits, dim=-1)
    if z_loss:
        token_loss = token_loss + torch.where(y != ignore_index, z_loss * lse * lse, 0.0)
    loss = _reduce(token_loss.sum(), token_loss, y, ignore_index, reduction, num_items_in_batch)
    if reduction == "none":
        loss = loss.view(shape)
    return _pack(loss, token_loss.view(shape), lse.detach().view(shape), return_token_loss, return_lse,
                 logits.detach().argmax(-1).view(shape) if return_argmax else None)


# ---------------------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------------------

def check_args(hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, z_loss, reduction,
                num_items_in_batch, chunk_size, dw_strategy, validate_labels):
    _common.check_tensor("hidden", hidden, min_ndim=2)
    if isinstance(weight, torch.Tensor) and weight.numel() == 0:
        raise ValueError(f"weight is empty (shape {tuple(weight.shape)}): a partitioned ZeRO-3 / sharded parameter? "
                         "gather it with swift_liger.fusions.loss_head.sharding.gathered_lm_head_weight")
    _common.check_tensor("weight", weight, ndim=2)
    _common.check_tensor("labels", labels, dtypes=LABEL_DTYPES)
    if bias is not None:
        _common.check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (weight rows), got {tuple(bias.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, {hidden.shape[-1]}] (hidden size of hidden), "
                         f"got {tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden without its last dimension), "
                         f"got {tuple(labels.shape)}")
    _common.check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, num_items_in_batch)
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if dw_strategy not in DW_STRATEGIES:
        raise ValueError(f"dw_strategy must be one of {', '.join(DW_STRATEGIES)}, got {dw_strategy!r}")
    if labels_checked(labels, validate_labels) and labels.numel():
        check_label_range(labels, weight.shape[0], ignore_index)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                               label_smoothing: float = 0.0, softcap: Optional[float] = None, z_loss: float = 0.0,
                               reduction: str = "mean",
                               num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None,
                               return_token_loss: bool = False, return_lse: bool = False, return_argmax: bool = False,
                               chunk_size: Optional[int] = None, dw_strategy: str = "auto",
                               validate_labels: Optional[bool] = None):
    """Cross-entropy of ``hidden @ weight^T + bias`` against ``labels`` without materialising the logits.

    hidden [..., H] (fp32/fp16/bf16), weight [V, H] and bias [V] (same dtype as hidden; under autocast all three
    are cast to the autocast dtype like nn.Linear), labels [...] int (already shifted; ``ignore_index`` skipped).

    Returns the loss (fp32; 0-d for "mean"/"sum", [...] for "none") or, when ``return_token_loss`` /
    ``return_lse`` / ``return_argmax``, an :class:`FLCEOutput` (loss, token_loss [...] fp32, lse [...] fp32, argmax
    [...] int64: each position's predicted token, e.g. for token accuracy, from the same pass over the workspace).
      * mean: sum / #valid tokens (0 when none are valid); sum: sum; none: per-token loss.
      * num_items_in_batch (int or one-element tensor, reduction "mean"): sum / num_items_in_batch, for exact
        gradient accumulation over micro-batches (clamped to >= 1).
      * token_loss carries a gradient (e.g. log-prob losses: -token_loss = log p[label] with no smoothing and
        no z-loss); when it does and W is trainable, dW is recomputed (4 GEMMs) even if accumulated.
        lse has no gradient.
      * softcap: z = softcap * tanh(z / softcap) on the fp32 logits (Gemma-2); z_loss: + z_loss * lse^2 per token.
      * chunk_size: token rows per workspace chunk (default: workspace <= WORKSPACE_BYTES).
      * dw_strategy: "accumulate" (fp32 [V, H] buffer, 3 GEMMs), "accumulate_lowp" (3 GEMMs, accumulated in the
        weight's dtype: no buffer beyond the gradient, one rounding per token chunk), "recompute" (4 GEMMs, no
        buffer) or "auto" (accumulate while V*H*4 <= DW_ACCUMULATE_BUDGET_BYTES, else recompute). reduction "none"
        always recomputes.
      * validate_labels: None (default) checks labels on CPU only; on CUDA the check would sync the host, so it
        runs only with True. Unchecked out-of-range labels never read out of bounds: their token loss is NaN
        (so the loss is NaN) and they get zero gradient.
    The graph can be backpropagated once (gradients are formed in forward and scaled in place in backward).
    """
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_args(hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, z_loss, reduction,
                num_items_in_batch, chunk_size, dw_strategy, validate_labels)
    _common.check_same_dtype(hidden=hidden, weight=weight, bias=bias)
    opts = dict(ignore_index=ignore_index, label_smoothing=float(label_smoothing), softcap=softcap,
                z_loss=float(z_loss), reduction=reduction, num_items_in_batch=num_items_in_batch,
                return_token_loss=return_token_loss, return_lse=return_lse, return_argmax=return_argmax)
    if not _common.use_triton(hidden):
        return fused_linear_cross_entropy_reference(hidden, weight, labels, bias, **opts)

    shape = labels.shape
    h2, y = flat_rows(hidden, labels)
    acc_rows = _resolve_dw_rows(dw_strategy, weight.shape[0], h2.shape[1], reduction)
    loss_sum, token_loss, lse, _, _, argmax = run_rows(h2, weight, bias, y, ignore_index=ignore_index,
                                            label_smoothing=float(label_smoothing), softcap=softcap,
                                            z_loss=float(z_loss), temperature=1.0, chunk_size=chunk_size,
                                            dw_acc_rows=acc_rows,
                                            row_grads=bool(return_token_loss or reduction == "none"),
                                            need_sum=False, dw_acc_lowp=dw_strategy == "accumulate_lowp",
                                            need_argmax=bool(return_argmax))
    loss = _reduce(loss_sum, token_loss, y, ignore_index, reduction, num_items_in_batch)
    if reduction == "none":
        loss = loss.view(shape)
    return _pack(loss, token_loss.view(shape), lse.view(shape), return_token_loss, return_lse,
                 argmax.view(shape).long() if return_argmax else None)


# ---------------------------------------------------------------------------------------------------------------
# The row engine: the named internal API the public functions here and the other linear+loss ops (ops.logprobs_op)
# build on: check_args (above), autocast_inputs, flat_rows, run_rows. A new loss over the head uses these four.
# ---------------------------------------------------------------------------------------------------------------

def autocast_inputs(hidden, weight, bias):
    """Under autocast, cast hidden, weight and bias to the autocast dtype, as nn.Linear's GEMM would."""
    if torch.is_tensor(hidden) and torch.is_tensor(weight) and torch.is_autocast_enabled(hidden.device.type) \
            and hidden.is_floating_point():
        dt = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if torch.is_tensor(bias) else bias
    return hidden, weight, bias


def flat_rows(hidden: torch.Tensor, labels: torch.Tensor):
    """hidden [..., H] -> [N, H]; labels [...] -> contiguous int32/int64 [N]."""
    return hidden.reshape(-1, hidden.shape[-1]), int_labels(labels.reshape(-1)).contiguous()


def run_rows(h2, weight, bias, y, *, ignore_index, label_smoothing, softcap, z_loss, temperature, chunk_size,
             dw_acc_rows, row_grads, need_sum, dw_acc_lowp=False, need_entropy=False, need_argmax=False):
    """Pass 1 (and, when a gradient is wanted, the autograd Function): (loss_sum, token_loss, lse, logit_sum,
    entropy, argmax)."""
    n, v = h2.shape[0], weight.shape[0]
    c = chunk_size if chunk_size is not None else default_chunk_size(n, v, h2.element_size())
    cap = float(softcap) if softcap is not None else 0.0
    grad = torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if grad:
        return FusedLinearCrossEntropyFunction.apply(h2, weight, bias, y, ignore_index, label_smoothing, cap, z_loss,
                                                     c, dw_acc_rows, row_grads, temperature, need_sum, dw_acc_lowp,
                                                     need_entropy, need_argmax)
    fwd = _common.compiled_or_eager("swift_liger::flce_forward", _flce_forward)
    token_loss, lse, _, _, _, logit_sum, entropy, argmax = fwd(h2, weight, bias, y, ignore_index, label_smoothing,
                                                               cap, z_loss, temperature, c, 0, False, False, False,
                                                               need_sum, False, need_entropy, need_argmax)
    return token_loss.sum(), token_loss, lse, logit_sum, entropy, argmax
