"""A frozen linear weight stored in FP8 (e4m3, one fp32 scale per output row) and the matmuls that use it.

    forward      y  = x W^T (+ bias)      x quantized per row (token), W per output row:  y = s_x s_W^T * (x_q W_q^T)
    input grad   dx = g W                 W's row scales lie along this GEMM's reduction, so they are folded into g
                                          before g is quantized per row:  dx = s_g * ((g s_W)_q W_q)

The GEMMs are ``torch._scaled_mm`` (cuBLASLt / CUTLASS FP8 on sm_89+; fp32 accumulation, a bf16 result). Hopper's FP8
tensor cores take both operands K-major, so the input-gradient GEMM reads a transposed copy of W_q made per call (out x
in bytes, freed after it): a weight stored twice would cost the bytes FP8 saves. Quantizing an operand is one Triton
kernel (fp8_quant_kernel: ~3 bytes per bf16 element, one launch) on the Triton backend; the CPU reference backend runs
the same maths as torch ops, bit for bit with the kernel's division (on an sm_89+ GPU the kernel multiplies by each
row's reciprocal instead: a code may differ by one step where the two round apart). The weight gets no gradient (it is
frozen); the quantization of x and g is treated as the identity in the backward (straight-through), as in FP8 training
recipes.

Memory at Qwen2.5-7B: the 7.0 B projection weights under LoRA are 13.1 GiB in bf16, 6.5 GiB in FP8 (+ 0.2 MiB of
scales). :class:`Fp8Weight` keeps the exact 16-bit original in host memory, so anything that reads the weight
outside these matmuls (a merge, a full save, ``swift_liger.revert``) sees the loaded values, not the quantized ones.

Shapes: x [..., in]; W [out, in]; bias [out] or None; in and out multiples of 16 (``fp8_weight_problem`` says why a
weight cannot be stored). Pure op: no PEFT, transformers or ms-swift import.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ._common import use_triton
from .fp8_quant_kernel import quantize_rows_kernel
from .fp8_transpose_kernel import transpose_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # the largest finite e4m3fn value
_TINY = 1e-12              # floor of a row's max: an all-zero row gets a tiny scale and quantizes to zeros
MIN_CAPABILITY = (8, 9)    # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90)
_ALIGN = 16                # torch._scaled_mm wants K and N multiples of 16

aten = torch.ops.aten


# Rows per chunk of quantize_rows: its fp32 working copy stays under this (8192 x 18944, Qwen2.5-7B's down projection
# input at 8k tokens, is 592 MiB in fp32: 3 chunks).
CHUNK_BYTES = 256 << 20


def _quantize(x2: torch.Tensor, fold: Optional[torch.Tensor], reciprocal: bool = False):
    xf = x2.to(torch.float32, copy=True)       # a copy also of fp32 rows: the in-place steps below must not reach x2
    if fold is not None:
        xf.mul_(fold)
    amax = torch.linalg.vector_norm(xf, float("inf"), dim=1, keepdim=True)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, 1 ulp off IEEE's quotient
    scale = amax.clamp_(min=_TINY).div_(torch.full_like(amax, FP8_MAX))
    xf = xf.mul_(torch.reciprocal(scale)) if reciprocal else xf.div_(scale)
    return xf.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows_fast_torch(x2: torch.Tensor, fold: Optional[torch.Tensor] = None):
    """What fp8_quant_kernel computes with ``Fp8QuantConfig.hw_cvt``, in torch ops (its tests' reference): the same
    scales as quantize_rows, x * fold times each row's IEEE reciprocal of its scale instead of a division, torch's
    round-to-nearest-even conversion. x2 [N, K] -> (q [N, K] e4m3, scale [N, 1] fp32)."""
    return _quantize(x2, fold, reciprocal=True)


def quantize_rows(x2: torch.Tensor, fold: Optional[torch.Tensor] = None):
    """(q [N, K] e4m3, scale [N, 1] fp32) with x2[n] * fold ~= scale[n] * q[n]: each row's largest magnitude maps
    to 448. x2: [N, K] any float dtype; fold: [K] fp32 factors applied first (the weight's row scales in the
    input-gradient GEMM), or None. The Triton kernel (fp8_quant_kernel) where the backend is Triton; else torch ops
    over row chunks of at most CHUNK_BYTES in fp32 (the bits of the kernel's division path; see hw_cvt there)."""
    if use_triton(x2):
        return quantize_rows_kernel(x2, None if fold is None else fold.contiguous())
    return quantize_rows_torch(x2, fold)


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] (an Fp8Weight's codes) -> its contiguous transpose [C, R]: the Triton kernel where the backend is
    Triton (fp8_transpose_kernel: torch's copy moves 1-byte elements at a fraction of the memory's speed)."""
    return transpose_kernel(q) if use_triton(q) else q.t().contiguous()


def quantize_rows_torch(x2: torch.Tensor, fold: Optional[torch.Tensor] = None):
    """quantize_rows in torch ops (the CPU reference backend, and the reference of the kernel's tests)."""
    n, k = x2.shape
    rows = max(1, CHUNK_BYTES // (4 * max(1, k)))
    if n <= rows:
        return _quantize(x2, fold)
    q = torch.empty(n, k, dtype=FP8, device=x2.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x2.device)
    for c0 in range(0, n, rows):
        qc, sc = _quantize(x2[c0:c0 + rows], fold)
        q[c0:c0 + rows].copy_(qc)
        scale[c0:c0 + rows].copy_(sc)
    return q, scale


# (device type, index) -> False where this torch has no row-wise scaled FP8 GEMM there (probed once per device, when
# the first weight is quantized on it, outside any CUDA graph capture). Row-wise scaling is a CUTLASS kernel written
# for sm_90; whether a given torch build has one for sm_89 (or a CPU one) is only known by calling it.
_ROWWISE: dict = {}


def _device_key(device: torch.device) -> tuple:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def _probe_rowwise(device: torch.device) -> bool:
    key = _device_key(device)
    if key not in _ROWWISE:
        a = torch.ones(16, 16, device=device).to(FP8)
        s = torch.ones(16, 1, device=device)
        try:
            torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
            _ROWWISE[key] = True
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            _ROWWISE[key] = False
            name = torch.cuda.get_device_name(key[1]) if key[0] == "cuda" else key[0]
            warnings.warn(f"swift_liger: torch {torch.__version__} has no row-wise scaled FP8 GEMM on {name} "
                          f"({str(exc).splitlines()[0][:160]}); FP8 base weights there multiply through bf16 GEMMs: "
                          "half the weight memory, no FP8 speed-up", stacklevel=3)
    return _ROWWISE[key]


def _scaled_mm(a_q, b_q_t, s_a, s_b, out_dtype: torch.dtype) -> torch.Tensor:
    """(s_a * s_b) * (a_q @ b_q_t) in out_dtype. a_q [M, K] row-major, b_q_t [K, N] column-major (the transpose of a
    row-major [N, K]); s_a [M, 1], s_b [1, N] fp32. cuBLASLt's row-wise scaled FP8 GEMM returns bf16 only; other
    16-bit results are cast from it. Where torch lacks it (see _ROWWISE): the same product from bf16 copies of the
    operands (FP8 values are exact in bf16), scaled in fp32."""
    kind = a_q.device.type
    if not _ROWWISE.get((kind, a_q.device.index), True):
        out = (a_q.to(torch.bfloat16) @ b_q_t.to(torch.bfloat16)).float().mul_(s_a).mul_(s_b)
        return out.to(out_dtype)
    if torch.is_autocast_enabled(kind):               # CPU autocast would recast the FP8 GEMM's operands
        with torch.autocast(kind, enabled=False):
            out = torch._scaled_mm(a_q, b_q_t, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
    else:
        out = torch._scaled_mm(a_q, b_q_t, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


class Fp8Weight(torch.Tensor):
    """A frozen [out, in] weight as FP8 rows ``q`` (e4m3, on the weight's device) with fp32 ``scale`` [out], posing as
    the 16-bit tensor it was made from (its dtype, shape and device), so a module, PEFT and the Trainer keep treating
    it as that weight. ``fp8_linear`` and ``lora_linear`` compute with q and scale. Every other read
    (``.to(torch.float32)``, ``clone``, a merge, ``state_dict`` saving) sees the exact original, kept in host memory
    (``original``). Writing into it is refused: it is frozen, and a write would land in a temporary copy."""

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, original: torch.Tensor, ones=None, input_group=None):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=original.dtype, device=q.device,
                                                   requires_grad=False)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, original: torch.Tensor, ones=None,
                 input_group: Optional["InputGroup"] = None):
        self.q, self.scale, self.original = q, scale, original
        # the input-gradient GEMM's column scales (the row scales are folded into g): made once, not per call
        self.ones = ones if ones is not None else torch.ones(1, q.shape[1], dtype=torch.float32, device=q.device)
        self.input_group = input_group                # FP8 weights that read the same input (see InputGroup)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Fp8Weight":
        """The FP8 form of a [out, in] 16-bit weight (``fp8_weight_problem`` must accept it). The weight itself is
        not changed; the original kept is a host copy of it (on a CPU weight, the weight's own storage)."""
        problem = fp8_weight_problem(weight)
        if problem:
            raise ValueError(problem)
        w = weight.detach()
        _probe_rowwise(w.device)
        q, scale = quantize_rows(w)
        return cls(q, scale.view(-1), w.to("cpu"))

    def exact(self) -> torch.Tensor:
        """The original 16-bit weight on this weight's device (a fresh copy)."""
        return self.original.to(self.device, copy=True)

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        # nn.Module.to / .cuda / .half assign `param.data = converted`: the FP8 rows would stay behind
        if value is not self:
            raise RuntimeError(
                "swift_liger: a frozen FP8 base weight (--liger_fp8_base) cannot be moved or cast in place; "
                "move or cast the model before the FP8 bases are made, or revert the patch first "
                "(swift_liger.revert(model) restores the 16-bit weights)")

    def dequantize(self) -> torch.Tensor:
        """What the FP8 GEMMs multiply by: scale * q, in the original dtype."""
        return (self.q.float() * self.scale[:, None]).to(self.dtype)

    def nbytes_on_device(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.ones))

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return (f"Fp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"stored as {FP8} with row scales)")

    def __deepcopy__(self, memo):
        new = Fp8Weight(self.q.clone(), self.scale.clone(), self.original.clone())   # (and its own `ones`)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        return self.exact().__reduce_ex__(protocol)   # pickling / torch.save store the exact 16-bit weight

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            w = args[0]
            return Fp8Weight(w.q, w.scale, w.original, w.ones, w.input_group)
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if info is not None and info.is_write and isinstance(value, Fp8Weight):
                raise RuntimeError(
                    f"swift_liger: {func} would write into a frozen FP8 base weight (--liger_fp8_base); "
                    "revert the patch first (swift_liger.revert(model) restores the 16-bit weights), or merge "
                    "adapters with `swift export --merge_lora true`, which reloads the base")
        unwrap = lambda t: t.exact() if isinstance(t, Fp8Weight) else t   # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def fp8_weight_problem(weight) -> Optional[str]:
    """Why ``Fp8Weight.quantize`` would refuse this weight (None: it takes it)."""
    if not isinstance(weight, torch.Tensor) or isinstance(weight, Fp8Weight):
        return f"expected a 16-bit torch.Tensor weight, got {type(weight).__name__}"
    if weight.dim() != 2:
        return f"weight must be [out, in], got shape {tuple(weight.shape)}"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"weight must be bfloat16 or float16, got {weight.dtype}"
    if weight.requires_grad:
        return "weight must be frozen (requires_grad=False): an FP8 base gets no gradient"
    if weight.shape[0] % _ALIGN or weight.shape[1] % _ALIGN:
        return f"weight dims must be multiples of {_ALIGN} for the FP8 GEMM, got {tuple(weight.shape)}"
    return None


def fp8_device_problem(device) -> Optional[str]:
    """Why FP8 GEMMs cannot run on `device` (None: they can). CPU runs torch's reference FP8 GEMM (tests)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU, got device {device}"
    if torch.version.hip is not None:
        return "FP8 base weights are built for NVIDIA GPUs (cuBLASLt e4m3); this is a ROCm build"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; FP8 GEMMs need sm_89 or newer "
                "(L4, L40S, RTX 4090, H100, H200)")
    return None


class InputGroup:
    """FP8 weights whose modules read one input tensor: gate_proj and up_proj of a gated MLP, the FP8 ones of q/k/v.
    The first member's quantization of x serves the others (Qwen2.5-7B at 8k tokens: one 8192 x 3584 quantization
    less per MLP forward and recompute, 27-69 us on an H200). Set by patching/fp8.py; ``size`` members."""
    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __repr__(self):
        return f"InputGroup(size={self.size})"


# The last quantized input of a group, while other members have yet to read it: [x, x's version, group, capturing,
# xq, sx, reads left]. Any FP8 call on another input drops it, so it holds at most one quantized copy, briefly.
_SHARED: list = [None]


def _quantized_input(x: torch.Tensor, x2: torch.Tensor, group: Optional[InputGroup]):
    """quantize_rows(x2), or the quantization a member of `group` made of this very x (same object, same version,
    same CUDA-graph capture state: a copy made outside a capture must not be read by a captured graph)."""
    entry = _SHARED[0]
    if entry is not None:
        _SHARED[0] = None
        if (entry[0] is x and entry[2] is group and entry[1] == x._version
                and entry[3] == (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            if entry[6] > 1:
                entry[6] -= 1
                _SHARED[0] = entry
            return entry[4], entry[5]
    xq, sx = quantize_rows(x2)
    if group is not None and group.size > 1 and not torch.compiler.is_compiling():
        _SHARED[0] = [x, x._version, group, x.is_cuda and torch.cuda.is_current_stream_capturing(), xq, sx,
                      group.size - 1]
    return xq, sx


def fp8_matmul(x: torch.Tensor, weight: Fp8Weight, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias [out]) -> [..., out] in out_dtype, x quantized per row (once per InputGroup). No
    autograd."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    xq, sx = _quantized_input(x, x2, weight.input_group)
    y = _scaled_mm(xq, weight.q.t(), sx, weight.scale.view(1, -1), out_dtype)
    if bias is not None:
        y.add_(bias.to(y.dtype))
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_input_grad(g: torch.Tensor, weight: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """g [..., out] @ W -> [..., in] in out_dtype: W's row scales folded into g before g is quantized per row."""
    _SHARED[0] = None                                 # a forward's leftover shared input is not kept into the backward
    g2 = g.reshape(-1, g.shape[-1])
    gq, sg = quantize_rows(g2, fold=weight.scale)
    w_t = transpose_codes(weight.q)                   # [in, out]: K-major for this GEMM (see the module docstring)
    dx = _scaled_mm(gq, w_t.t(), sg, weight.ones, out_dtype)
    return dx.view(*g.shape[:-1], weight.shape[1])


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight                           # kept on ctx: a frozen weight, nothing to version-check
        ctx.x_dtype = x.dtype
        return fp8_matmul(x, weight, x.dtype, bias)

    @staticmethod
    def backward(ctx, dy):
        dx = fp8_input_grad(dy, ctx.weight, ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, W, bias) through the FP8 GEMM, computed in x's dtype (autocast's when it is on); bias frozen.
    Raises ValueError when x's width is not W's in, or when x is not 16-bit."""
    if not isinstance(weight, Fp8Weight):
        raise ValueError(f"weight must be an Fp8Weight (Fp8Weight.quantize(w)), got {type(weight).__name__}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., {weight.shape[1]}], got {tuple(x.shape)}")
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        x = x.to(torch.get_autocast_dtype(kind))
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16 (or run under autocast), got {x.dtype}")
    if bias is not None and bias.requires_grad:
        raise ValueError("fp8_linear needs a frozen bias (requires_grad=False)")
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fp8_matmul(x, weight, x.dtype, bias)
    return Fp8LinearFunction.apply(x, weight, bias)


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The forward in float64 from the same quantized operands: (s_x q_x) (s_W q_W)^T + bias."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_rows(x2)
    xd = xq.double() * sx.double()
    wd = weight.q.double() * weight.scale.double()[:, None]
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], weight.shape[0])
