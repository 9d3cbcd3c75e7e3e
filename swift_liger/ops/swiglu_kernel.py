"""Gated MLP activations: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu_tanh(gate) * up``.

Shapes: ``gate``, ``up``: [..., I] (same shape, dtype, device; last dimension contiguous, any row strides, e.g. the
two halves of a fused ``gate_up`` projection). Output: a new contiguous [..., I] tensor in the input dtype.

Rounding: Hugging Face computes ``act_fn(gate) * up`` in the input dtype, so under bf16 the activation is rounded
before the multiply. The kernel computes ``act(gate) * up`` in fp32 and rounds once when storing, which is closer
to the exact value; the test tolerances cover the difference.

Backward recomputes the activation from ``gate`` (nothing but the inputs is saved):
``d_gate = d_out * up * act'(gate)``, ``d_up = d_out * act(gate)``. Forward moves 3 tensors' worth of bytes
(read gate, up; write out), backward 5 (read gate, up, d_out; write d_gate, d_up).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common, _launch

SILU = 0
GELU_TANH = 1


@triton.jit
def _act_fwd(g, ACT: tl.constexpr):
    """act(g) for fp32 g."""
    if ACT == 0:
        return g * tl.sigmoid(g)
    else:
        # gelu_tanh(g) = 0.5 g (1 + tanh(k)) = g * sigmoid(2k), k = sqrt(2/pi) (g + 0.044715 g^3): no tanh needed.
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))


@triton.jit
def _act_fwd_bwd(g, ACT: tl.constexpr):
    """(act(g), act'(g)) for fp32 g."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    else:
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        a = g * s
        # d/dg [g * sigmoid(u)] = s + g s (1 - s) du/dg, du/dg = 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2)
        da = s + a * (1.0 - s) * (1.5957691216057308 * (1.0 + 0.134145 * g * g))
    return a, da


@triton.jit
def _offsets(pid, n_cols, n_col_blocks, stride_a, stride_b, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """Element offsets into two row-strided inputs (a, b) and into contiguous outputs, plus the mask."""
    if FLAT:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        off_a = offs
        off_b = offs
        off_o = offs
    else:
        row = pid // n_col_blocks
        cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        off_a = row * stride_a + cols
        off_b = row * stride_b + cols
        off_o = row * n_cols + cols
    return off_a, off_b, off_o, mask


@triton.jit
def _glu_fwd_kernel(g_ptr, u_ptr, o_ptr, n_cols, n_col_blocks, stride_g, stride_u,
                    ACT: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    # FLAT: n_cols is the total element count. int64 program id: offsets of >2^31-element tensors.
    pid = tl.cast(tl.program_id(0), tl.int64)
    off_g, off_u, off_o, mask = _offsets(pid, n_cols, n_col_blocks, stride_g, stride_u, FLAT, BLOCK)
    g = tl.load(g_ptr + off_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off_u, mask=mask, other=0.0).to(tl.float32)
    out = _act_fwd(g, ACT) * u
    tl.store(o_ptr + off_o, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, n_col_blocks, stride_do, stride_g, stride_u,
                    ACT: tl.constexpr, FLAT: tl.constexpr, INPLACE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    off_g, off_u, off_o, mask = _offsets(pid, n_cols, n_col_blocks, stride_g, stride_u, FLAT, BLOCK)
    if FLAT:
        off_do = off_o
    else:
        off_do = (pid // n_col_blocks) * stride_do + (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    do = tl.load(do_ptr + off_do, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off_u, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_fwd_bwd(g, ACT)
    if INPLACE:
        # d_gate / d_up overwrite gate / up (same strides); each element is read before this program writes it.
        off_dg = off_g
        off_du = off_u
    else:
        off_dg = off_o
        off_du = off_o
    tl.store(dg_ptr + off_dg, (do * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + off_du, (do * a).to(du_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GLUConfig:
    """Launch of _glu_fwd_kernel / _glu_bwd_kernel. flat: FLAT, a 1-D grid over all elements of contiguous inputs
    (else one program per (row, column block) of row-strided views); block: BLOCK, elements per program; num_warps."""
    flat: bool
    block: int
    num_warps: int


LAUNCH_CONFIGS = {None: GLUConfig}


def launch_config(n_cols: int, contiguous: bool, device) -> GLUConfig:
    """Contiguous inputs: 4096-element blocks, 8 warps. Row views of n_cols columns: the largest column block of
    8192..512 that wastes at most 1/8 of the lanes (or the smallest), block / 512 warps in [4, 16]. Same on
    every device."""
    return _common.apply_override(__name__, None, _base_config(int(n_cols), bool(contiguous)))


@functools.lru_cache(maxsize=1024)
def _base_config(n_cols: int, contiguous: bool) -> GLUConfig:
    if contiguous:
        cfg = GLUConfig(True, 4096, 8)
    else:
        top = _common.next_pow2(n_cols)
        block = min(top, 512)
        for b in (8192, 4096, 2048, 1024, 512):
            if b <= top and _common.cdiv(n_cols, b) * b - n_cols <= n_cols // 8:
                block = b
                break
        cfg = GLUConfig(False, block, max(4, min(16, block // 512)))
    return cfg


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., I] -> [R, I] with unit column stride; a view whenever the leading dims collapse."""
    t2 = t.reshape(-1, n_cols)
    if n_cols > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _layout(*tensors: torch.Tensor):
    """(config, tensors (flat) or their [R, I] row views, n_cols (all elements when flat), n_col_blocks, grid)."""
    n_cols = tensors[0].shape[-1]
    contiguous = all(t.is_contiguous() for t in tensors)
    cfg = launch_config(n_cols, contiguous, tensors[0].device)
    if cfg.flat and not contiguous:
        raise ValueError("GLUConfig.flat=True needs contiguous inputs")
    if cfg.flat:
        n = tensors[0].numel()
        return cfg, tensors, n, 1, (_common.cdiv(n, cfg.block),)
    rows = tuple(_rows(t, n_cols) for t in tensors)
    ncb = _common.cdiv(n_cols, cfg.block)
    return cfg, rows, n_cols, ncb, (rows[0].shape[0] * ncb,)


_GLU_FWD = _launch.FastLaunch(_glu_fwd_kernel)
_GLU_BWD = _launch.FastLaunch(_glu_bwd_kernel)


def _glu_forward(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """gate, up [..., I] -> act(gate) * up, new contiguous [..., I] in gate.dtype."""
    out = (_common.new_empty_like(gate) if gate.is_contiguous()
           else _common.new_empty(gate.shape, dtype=gate.dtype, device=gate.device))
    if out.numel() == 0:
        return out
    cfg, (g, u), n_cols, ncb, grid = _layout(gate, up)
    flat = cfg.flat
    _GLU_FWD.launch(grid, g, u, out, n_cols, ncb, 0 if flat else g.stride(0), 0 if flat else u.stride(0),
                    ACT=act, FLAT=flat, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return out


def _glu_backward_into(d_gate, d_up, d_out, gate, up, act: int, inplace: bool) -> None:
    if gate.numel() == 0:
        return
    if d_out.dtype != gate.dtype:
        d_out = d_out.to(gate.dtype)
    cfg, (do, g, u), n_cols, ncb, grid = _layout(d_out, gate, up)
    if inplace:
        d_gate, d_up = g, u
    s = (0, 0, 0) if cfg.flat else (do.stride(0), g.stride(0), u.stride(0))
    _GLU_BWD.launch(grid, do, g, u, d_gate, d_up, n_cols, ncb, *s,
                    ACT=act, FLAT=cfg.flat, INPLACE=inplace, BLOCK=cfg.block, num_warps=cfg.num_warps)


def _glu_backward(d_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  act: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """d_out, gate, up [..., I] -> (d_gate, d_up), new contiguous [..., I] in gate.dtype."""
    d_gate = _common.new_empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = _common.new_empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _glu_backward_into(d_gate, d_up, d_out, gate, up, act, inplace=False)
    return d_gate, d_up


@torch.library.custom_op("swift_liger::glu_fwd", mutates_args=())
def _glu_fwd_op(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    return _glu_forward(gate, up, act)


@_glu_fwd_op.register_fake
def _(gate, up, act):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("swift_liger::glu_bwd", mutates_args=())
def _glu_bwd_op(d_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                act: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return _glu_backward(d_out, gate, up, act)


@_glu_bwd_op.register_fake
def _(d_out, gate, up, act):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _aliases_rows(t: torch.Tensor) -> bool:
    return t.numel() == 0 or _rows(t, t.shape[-1]).data_ptr() == t.data_ptr()


def _fwd(ctx, gate, up, act, inplace_backward):
    ctx.save_for_backward(gate, up)
    # Disjoint buffers only (swiglu(x, x) would write both gradients into one); never under torch.compile.
    ctx.inplace = (bool(inplace_backward) and not torch.compiler.is_compiling()
                   and gate.data_ptr() != up.data_ptr())
    return _common.compiled_or_eager("swift_liger::glu_fwd", _glu_forward)(gate, up, act)


def _bwd(ctx, d_out, act):
    gate, up = ctx.saved_tensors
    # In place needs row views that alias the inputs (a reshape copy would receive the gradients instead).
    if ctx.inplace and not torch.compiler.is_compiling() and _aliases_rows(gate) and _aliases_rows(up):
        _glu_backward_into(None, None, d_out, gate, up, act, inplace=True)
        # Any other node that saved gate / up now fails loudly instead of reading gradients.
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        return gate, up, None
    d_gate, d_up = _common.compiled_or_eager("swift_liger::glu_bwd", _glu_backward)(d_out, gate, up, act)
    return d_gate, d_up, None


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; gate, up [..., I] -> [..., I]. Saves only the inputs.

    ``inplace_backward``: d_gate / d_up overwrite the gate / up buffers (eager only).
    """

    @staticmethod
    def forward(ctx, gate, up, inplace_backward=False):
        return _fwd(ctx, gate, up, SILU, inplace_backward)

    @staticmethod
    def backward(ctx, d_out):
        return _bwd(ctx, d_out, SILU)


class GeGLUFunction(torch.autograd.Function):
    """gelu_tanh(gate) * up; gate, up [..., I] -> [..., I]. Saves only the inputs.

    ``inplace_backward``: d_gate / d_up overwrite the gate / up buffers (eager only).
    """

    @staticmethod
    def forward(ctx, gate, up, inplace_backward=False):
        return _fwd(ctx, gate, up, GELU_TANH, inplace_backward)

    @staticmethod
    def backward(ctx, d_out):
        return _bwd(ctx, d_out, GELU_TANH)


# ---------------------------------------------------------------------------------------------------------------
# References (Hugging Face eager: activation rounded to the input dtype, then the multiply) and public functions
# ---------------------------------------------------------------------------------------------------------------

def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF LlamaMLP: ``F.silu(gate) * up`` in the input dtype. gate, up [..., I] -> [..., I]."""
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF GemmaMLP (gelu_pytorch_tanh): ``F.gelu(gate, approximate="tanh") * up``. [..., I] -> [..., I]."""
    return F.gelu(gate, approximate="tanh") * up


def _check(gate, up) -> None:
    if (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) and gate.dtype in _common.FLOAT_DTYPES
            and up.dtype == gate.dtype and gate.dim() >= 1 and up.shape == gate.shape and up.device == gate.device
            and (gate.stride(-1) == 1 or gate.shape[-1] <= 1) and (up.stride(-1) == 1 or up.shape[-1] <= 1)):
        return   # the common call in one expression (host time per layer); anything else is checked below
    _common.check_tensor("gate", gate, min_ndim=1)
    _common.check_tensor("up", up, min_ndim=1)
    if gate.shape != up.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    _common.check_same_device(gate=gate, up=up)
    _common.check_same_dtype(gate=gate, up=up)
    _common.check_last_dim_contiguous("gate", gate)
    _common.check_last_dim_contiguous("up", up)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``.

    gate, up: [..., I], same shape/dtype (fp32/fp16/bf16)/device, last dim contiguous (row strides free, so the
    halves of a fused gate_up projection are read in place). Returns a new contiguous [..., I] in that dtype.

    inplace_backward: the backward writes d_gate / d_up into the gate / up buffers (as Liger does), saving two
    [..., I] allocations at the backward peak. Only for intermediate activations that nothing else reads after
    this op's backward (e.g. fresh projection outputs); not for leaves, not with retain_graph. Eager only (a
    no-op under torch.compile); other graph nodes that saved gate / up raise instead of reading gradients.
    """
    _check(gate, up)
    if not _common.use_triton(gate):
        return swiglu_reference(gate, up)
    if not _common.records_grad(gate, up):
        return _common.compiled_or_eager("swift_liger::glu_fwd", _glu_forward)(gate, up, SILU)
    return SwiGLUFunction.apply(gate, up, inplace_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """GeGLU with the tanh GELU (HF ``gelu_pytorch_tanh``): ``gelu_tanh(gate) * up``. Arguments as :func:`swiglu`."""
    _check(gate, up)
    if not _common.use_triton(gate):
        return geglu_reference(gate, up)
    if not _common.records_grad(gate, up):
        return _common.compiled_or_eager("swift_liger::glu_fwd", _glu_forward)(gate, up, GELU_TANH)
    return GeGLUFunction.apply(gate, up, inplace_backward)
