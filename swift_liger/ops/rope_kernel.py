"""Rotary position embedding (Hugging Face ``apply_rotary_pos_emb``), q and k in one launch. Two layouts:

* rotate-half (default, Llama/Qwen/...): dims j and Dr/2 + j form a pair,
      q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., Dr/2:], x[..., :Dr/2])
* interleaved (``interleaved=True``, GLM-4 family, ``models/glm4``): dims 2i and 2i + 1 form a pair, rotated by
  cos[..., i], sin[..., i] for i < Dr/2; the second half of cos/sin is not read (HF GLM takes
  ``cos[..., :Dr/2].repeat_interleave(2)``).

Only the first ``Dr = cos.shape[-1]`` dims rotate (partial rotary); the rest pass through. One program handles
one token: it loads that token's cos/sin once and rotates every q head and every k head of the token, so q and
k share a single launch. The layout is a constexpr (INTERLEAVED) of the load/store helpers: the interleaved one
reads the rotary dims as one contiguous tile and splits it into even/odd dims (vector loads; stride-2 ones would
not be); the rotation math is shared. The backward pass is the transposed rotation (sin -> -sin when the two
halves of cos/sin are equal, as in every HF rotary embedding; always, in the interleaved layout) run by the same
kernel; nothing but cos/sin is saved.

Pure kernel module: no transformers / ms-swift imports.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import torch
import triton
import triton.language as tl

from . import _common, _launch


# ---------------------------------------------------------------------------------------------------------------
# Kernels. Tiles are [BLOCK_H heads, BLOCK_HALF] for each member of a rotary pair (x1: dims j, x2: dims HALF + j;
# INTERLEAVED: dims 2j and 2j + 1) plus [BLOCK_H, BLOCK_PASS] for the pass-through tail (dims Dr..D). The helpers
# are shared with qk_norm_rope (which uses the default INTERLEAVED=False).
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def load_heads(ptr, s_h, h0, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
               BLOCK_HALF: tl.constexpr, D: tl.constexpr, BLOCK_PASS: tl.constexpr,
               INTERLEAVED: tl.constexpr = False):
    """Heads h0 .. h0+BLOCK_H of one token (ptr = head 0, dim 0; heads s_h apart) as fp32 tiles
    (x1 [BH, BLOCK_HALF], x2 [BH, BLOCK_HALF], x3 [BH, BLOCK_PASS]); masked elements are 0."""
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h[:, None] < H
    if INTERLEAVED:
        # One contiguous [BH, 2 * BLOCK_HALF] load (vectorizes; stride-2 loads would not), split into the even
        # (x1) and odd (x2) dims in registers (no layout conversion on sm_90).
        j = tl.arange(0, 2 * BLOCK_HALF)
        x = tl.load(ptr + h[:, None] * s_h + j[None, :], mask=hmask & (j[None, :] < 2 * HALF),
                    other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
    else:
        d = tl.arange(0, BLOCK_HALF)
        mask = hmask & (d[None, :] < HALF)
        offs = h[:, None] * s_h + d[None, :]
        x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if D > 2 * HALF:
        p = tl.arange(0, BLOCK_PASS)
        pmask = hmask & (p[None, :] < D - 2 * HALF)
        x3 = tl.load(ptr + h[:, None] * s_h + 2 * HALF + p[None, :], mask=pmask, other=0.0).to(tl.float32)
    else:
        x3 = tl.zeros([BLOCK_H, BLOCK_PASS], dtype=tl.float32)
    return x1, x2, x3


@triton.jit
def store_heads(ptr, s_h, h0, o1, o2, o3, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                BLOCK_HALF: tl.constexpr, D: tl.constexpr, BLOCK_PASS: tl.constexpr,
                INTERLEAVED: tl.constexpr = False):
    """Store the tiles of ``load_heads`` layout into ptr's dtype."""
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h[:, None] < H
    if INTERLEAVED:
        j = tl.arange(0, 2 * BLOCK_HALF)
        o = tl.reshape(tl.join(o1, o2), [BLOCK_H, 2 * BLOCK_HALF])
        tl.store(ptr + h[:, None] * s_h + j[None, :], o.to(ptr.dtype.element_ty),
                 mask=hmask & (j[None, :] < 2 * HALF))
    else:
        d = tl.arange(0, BLOCK_HALF)
        mask = hmask & (d[None, :] < HALF)
        offs = h[:, None] * s_h + d[None, :]
        tl.store(ptr + offs, o1.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + offs + HALF, o2.to(ptr.dtype.element_ty), mask=mask)
    if D > 2 * HALF:
        p = tl.arange(0, BLOCK_PASS)
        pmask = hmask & (p[None, :] < D - 2 * HALF)
        tl.store(ptr + h[:, None] * s_h + 2 * HALF + p[None, :], o3.to(ptr.dtype.element_ty), mask=pmask)


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 INTERLEAVED: tl.constexpr = False):
    """cos/sin of token (b, t), each half as an fp32 [1, BLOCK_HALF] row: (c1, c2, s1, s2). INTERLEAVED reads
    only the first half (pair j uses cos[j], sin[j] for both members): c2 = c1, s2 = s1."""
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c_off = b * sc_b + t * sc_t
    s_off = b * ss_b + t * ss_t
    c1 = tl.load(cos_ptr + c_off + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        c2 = c1
    else:
        c2 = tl.load(cos_ptr + c_off + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + s_off + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        s2 = s1
    else:
        s2 = tl.load(sin_ptr + s_off + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def rotate(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    """Rotate-half: (x1 c1 - x2 s1, x2 c2 + x1 s2); BACKWARD applies the transposed matrix."""
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    return o1, o2


@triton.jit
def token_coords(tok, T):
    """(b, t) of a flattened token index, as int64 (offsets of long sequences exceed 2^31 elements)."""
    tok64 = tl.cast(tok, tl.int64)
    b = tok64 // T
    return b, tok64 - b * T


@triton.jit(do_not_specialize=["T"])
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                 T,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                 sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                 sc_b, sc_t, ss_b, ss_t,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Grid: (B * T,), one program per token = b * T + t. (A persistent loop over tokens cost 20 registers per
    thread, 80 against 60 at D=256 on sm_90, and up to 1.5x the time: docs/benchmarks/rope_lab_h200.md.)"""
    b, t = token_coords(tl.program_id(0), T)
    c1, c2, s1, s2 = load_cos_sin(cos_ptr, sin_ptr, b, t, sc_b, sc_t, ss_b, ss_t, HALF, BLOCK_HALF, INTERLEAVED)
    q_in = q_ptr + b * sq_b + t * sq_t
    k_in = k_ptr + b * sk_b + t * sk_t
    q_out = qo_ptr + b * sqo_b + t * sqo_t
    k_out = ko_ptr + b * sko_b + t * sko_t
    if BLOCK_HQ >= HQ and BLOCK_HK >= HK:
        # Every load of the token before the first store: stores may alias later loads for the compiler.
        q1, q2, q3 = load_heads(q_in, sq_h, 0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        k1, k2, k3 = load_heads(k_in, sk_h, 0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        o1, o2 = rotate(q1, q2, c1, c2, s1, s2, BACKWARD)
        store_heads(q_out, sqo_h, 0, o1, o2, q3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        o1, o2 = rotate(k1, k2, c1, c2, s1, s2, BACKWARD)
        store_heads(k_out, sko_h, 0, o1, o2, k3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
    else:
        for h0 in range(0, HQ, BLOCK_HQ):
            x1, x2, x3 = load_heads(q_in, sq_h, h0, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
            o1, o2 = rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
            store_heads(q_out, sqo_h, h0, o1, o2, x3, HQ, BLOCK_HQ, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
        for h0 in range(0, HK, BLOCK_HK):
            x1, x2, x3 = load_heads(k_in, sk_h, h0, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)
            o1, o2 = rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
            store_heads(k_out, sko_h, h0, o1, o2, x3, HK, BLOCK_HK, HALF, BLOCK_HALF, D, BLOCK_PASS, INTERLEAVED)


# ---------------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RoPEConfig:
    """Launch of a one-program-per-token rotary kernel (rope; qk_norm_rope's forward) for one head layout.

    block_hq / block_hk: BLOCK_HQ / BLOCK_HK, q / k heads per register tile (powers of 2; all heads when they fit,
    else the kernel loops over head blocks). block_half: BLOCK_HALF, next_pow2(rotary dims / 2). block_pass:
    BLOCK_PASS, next_pow2(pass-through dims) (1 without). num_warps.
    """
    block_hq: int
    block_hk: int
    block_half: int
    block_pass: int
    num_warps: int


LAUNCH_CONFIGS = {None: RoPEConfig}


def head_block(n_heads: int, half: int, tile_elems: int) -> int:
    """Heads per tile: all heads if they fit in ``tile_elems`` half-row elements, else the largest power of 2
    that does (at least 1)."""
    fit = max(1, tile_elems // _common.next_pow2(half))
    return min(_common.next_pow2(n_heads), 1 << (fit.bit_length() - 1))


def rope_warps(HQ: int, HK: int, D: int, block_hq: int, block_hk: int, block_half: int) -> int:
    """Warps of the one-program-per-token kernels, from a per-layout grid on the H200 (rope's forward kernel, 18
    layouts: q8..q64 over kv4/kv8 at D 64/128/256, warps 2/4/8; docs/benchmarks/rope_lab_h200.md). What decides it
    is the cos/sin columns each thread keeps for all its heads: at D=256 4 warps hold 8 of them x 4 tensors (64
    registers), 8 warps half that. By BLOCK_HALF: >= 128: 8 warps when all heads fit in one tile, 2 when the kernel
    loops over head blocks; 64: 4, or 8 from 8192 q+k elements per token; <= 32: 2 up to 2048 elements, else 4."""
    elems = (HQ + HK) * D
    if block_half >= 128:
        return 8 if (block_hq >= HQ and block_hk >= HK) else 2
    if block_half >= 64:
        return 8 if elems >= 8192 else 4
    return 2 if elems <= 2048 else 4


@functools.lru_cache(maxsize=1024)
def rotary_config(HQ: int, HK: int, D: int, half: int, *, num_warps=None) -> RoPEConfig:
    """Head tiles of at most 4096 q (or k) elements: all 32 heads x 64 of D=128 fit, so a program issues every load
    of its token before its first store. num_warps None: ``rope_warps``. Shared with qk_norm_rope."""
    pas = D - 2 * half
    bhq, bhk = head_block(HQ, half, 4096), head_block(HK, half, 4096)
    bhalf, bpass = _common.next_pow2(half), (_common.next_pow2(pas) if pas > 0 else 1)
    if num_warps is None:
        num_warps = rope_warps(HQ, HK, D, bhq, bhk, bhalf)
    return RoPEConfig(bhq, bhk, bhalf, bpass, num_warps)


def launch_config(HQ: int, HK: int, D: int, half: int, device) -> RoPEConfig:
    """Launch parameters of _rope_kernel (forward and backward) for q [B, HQ, T, D] and k [B, HK, T, D] with
    ``half`` = rotary dims / 2; one program per token; the same on every device."""
    return _common.apply_override(__name__, None, rotary_config(HQ, HK, D, half))


def cos_sin_strides(cos: torch.Tensor, sin: torch.Tensor):
    """(batch, token) strides of [Bc, T, Dr] cos/sin; batch stride 0 broadcasts a single row set."""
    return (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
            sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1))


_ROPE = _launch.FastLaunch(_rope_kernel)


def _rope_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 backward: bool, interleaved: bool = False, inplace: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D] (any strides, last dim contiguous), cos/sin [Bc, T, Dr] (Bc in {1, B},
    last dim contiguous). Returns new tensors shaped and strided like q and k (``empty_like``), or q and k
    themselves, rotated in place (each program reads a token's heads before it writes them)."""
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1] // 2
    qo = q if inplace else _common.new_empty_like(q)
    ko = k if inplace else _common.new_empty_like(k)
    n_tok = B * T
    if n_tok == 0 or (HQ == 0 and HK == 0) or D == 0:
        return qo, ko
    cfg = launch_config(HQ, HK, D, half, q.device)
    sq, sk, sqo, sko = q.stride(), k.stride(), qo.stride(), ko.stride()
    _ROPE.launch(
        (n_tok,), q, k, cos, sin, qo, ko, T,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
        *cos_sin_strides(cos, sin),
        HQ=HQ, HK=HK, HALF=half, D=D, BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk, BLOCK_HALF=cfg.block_half,
        BLOCK_PASS=cfg.block_pass, BACKWARD=backward, INTERLEAVED=bool(interleaved), num_warps=cfg.num_warps)
    return qo, ko


@torch.library.custom_op("swift_liger::rope_fwd", mutates_args=())
def _rope_fwd_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rope_launch(q, k, cos, sin, False, interleaved)


@torch.library.custom_op("swift_liger::rope_bwd", mutates_args=())
def _rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rope_launch(dq, dk, cos, sin, True, interleaved)


@_rope_fwd_op.register_fake
def _(q, k, cos, sin, interleaved=False):
    return torch.empty_like(q), torch.empty_like(k)


@_rope_bwd_op.register_fake
def _(dq, dk, cos, sin, interleaved=False):
    return torch.empty_like(dq), torch.empty_like(dk)


def _rope_fwd(q, k, cos, sin, interleaved=False):
    return _rope_launch(q, k, cos, sin, False, interleaved)


def _rope_bwd(dq, dk, cos, sin, interleaved=False):
    return _rope_launch(dq, dk, cos, sin, True, interleaved)


def last_dim_contiguous(g: torch.Tensor) -> torch.Tensor:
    """A gradient the kernels can read (expanded grads have stride 0). Done outside the custom ops so that real
    and fake output allocations agree."""
    if g.shape[-1] > 1 and g.stride(-1) != 1:
        return g.contiguous()
    return g


def _writable(t: torch.Tensor) -> bool:
    """A tensor the kernels may overwrite: last dim contiguous and no two elements sharing memory (the latter is
    checked for the common layouts: non-zero strides)."""
    return (t.shape[-1] <= 1 or t.stride(-1) == 1) and all(st != 0 or n == 1 for n, st in zip(t.shape, t.stride()))


def _can_rotate_in_place(q: torch.Tensor, k: torch.Tensor) -> bool:
    """In-place rotation is taken only eagerly, for writable q and k in separate storages (a fused qkv buffer, or
    expanded tensors, run out of place)."""
    return (not torch.compiler.is_compiling() and _writable(q) and _writable(k)
            and q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr())


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper. q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [Bc, T, Dr] (validated by ``apply_rope``),
    interleaved: bool (positional; default False = rotate-half), inplace: bool (eager only, and only for q/k that
    ``_can_rotate_in_place`` accepts, else out of place: forward overwrites q and k, backward the incoming gradients;
    their version counters are bumped, so a graph node that saved them fails loudly instead of reading rotated
    values)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved=False, inplace=False):
        interleaved = bool(interleaved)
        ctx.inplace = bool(inplace) and _can_rotate_in_place(q, k)
        if ctx.inplace:
            qo, ko = _rope_launch(q, k, cos, sin, False, interleaved, inplace=True)
            torch.autograd.graph.increment_version(q)
            torch.autograd.graph.increment_version(k)
        else:
            qo, ko = _common.compiled_or_eager("swift_liger::rope_fwd", _rope_fwd)(q, k, cos, sin, interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return qo, ko

    @staticmethod
    def backward(ctx, dqo, dko):
        # Unused outputs arrive as zeros (materialize_grads); expanded grads need a contiguous last dim.
        cos, sin = ctx.saved_tensors
        if ctx.inplace and _writable(dqo) and _writable(dko) and dqo.data_ptr() != dko.data_ptr():
            dq, dk = _rope_launch(dqo, dko, cos, sin, True, ctx.interleaved, inplace=True)
            torch.autograd.graph.increment_version(dqo)
            torch.autograd.graph.increment_version(dko)
        else:
            dq, dk = _common.compiled_or_eager("swift_liger::rope_bwd", _rope_bwd)(
                last_dim_contiguous(dqo), last_dim_contiguous(dko), cos, sin, ctx.interleaved)
        return dq, dk, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Validation, reference, public function
# ---------------------------------------------------------------------------------------------------------------

def _rope_args_common(q, k, cos, sin, unsqueeze_dim):
    """check_rope_args's result for the call every attention layer makes (4-D q/k, [Bc, T, Dr] cos/sin, one device,
    contiguous last dims), accepted in a few comparisons; None sends anything else through the full checks."""
    if not (type(unsqueeze_dim) is int and (unsqueeze_dim == 1 or unsqueeze_dim == 2) and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None
    qs, ks, cs = q.shape, k.shape, cos.shape
    if len(qs) != 4 or len(ks) != 4 or len(cs) != 3 or sin.shape != cs:
        return None
    dt, ct = q.dtype, cos.dtype
    if dt not in _common.FLOAT_DTYPES or k.dtype != dt or ct not in _common.FLOAT_DTYPES or sin.dtype != ct:
        return None
    dev = q.device
    if k.device != dev or cos.device != dev or sin.device != dev:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return None
    transposed = unsqueeze_dim == 2
    if transposed:
        (B, T, _, D), (kb, kt, _, kd) = qs, ks
    else:
        (B, _, T, D), (kb, _, kt, kd) = qs, ks
    dr = cs[2]
    if kb != B or kt != T or kd != D or cs[1] != T or (cs[0] != 1 and cs[0] != B) or dr == 0 or dr % 2 or dr > D:
        return None
    if transposed:
        return q.transpose(1, 2), k.transpose(1, 2), cos, sin, True
    return q, k, cos, sin, False


def check_rope_args(q, k, cos, sin, unsqueeze_dim, *, op: str = "apply_rope"):
    """Validate HF-style rotary arguments. Returns (q4, k4, cos3, sin3, transposed): q4/k4 as [B, H, T, D] views,
    cos3/sin3 as [Bc, T, Dr] with Bc in {1, B} and a contiguous last dim."""
    common = _rope_args_common(q, k, cos, sin, unsqueeze_dim)
    if common is not None:
        return common
    _common.check_tensor("q", q, ndim=4)
    _common.check_tensor("k", k, ndim=4)
    _common.check_same_dtype(q=q, k=k)
    _common.check_tensor("cos", cos)
    _common.check_tensor("sin", sin)
    _common.check_same_device(q=q, k=k, cos=cos, sin=sin)
    _common.check_same_dtype(cos=cos, sin=sin)
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(f"{op}: unsqueeze_dim must be 1 (q, k as [B, H, T, D]) or 2 (q, k as [B, T, H, D]), "
                         f"got {unsqueeze_dim!r}")
    transposed = unsqueeze_dim in (2, -2)
    _common.check_last_dim_contiguous("q", q)
    _common.check_last_dim_contiguous("k", k)
    q4 = q.transpose(1, 2) if transposed else q
    k4 = k.transpose(1, 2) if transposed else k
    B, _, T, D = q4.shape
    if k4.shape[0] != B or k4.shape[2] != T or k4.shape[3] != D:
        layout = "[B, T, H, D]" if transposed else "[B, H, T, D]"
        raise ValueError(f"{op}: k must match q in batch, sequence length and head_dim (layout {layout}); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() not in (2, 3):
        raise ValueError(f"{op}: cos must be [B, T, Dr] or [T, Dr], got shape {tuple(cos.shape)}")
    cos3 = cos if cos.dim() == 3 else cos.unsqueeze(0)
    sin3 = sin if sin.dim() == 3 else sin.unsqueeze(0)
    if cos3.shape[0] not in (1, B):
        raise ValueError(f"{op}: cos batch dim must be 1 or {B} (q's batch), got shape {tuple(cos.shape)}")
    if cos3.shape[1] != T:
        raise ValueError(f"{op}: cos sequence length must equal q's ({T}), got shape {tuple(cos.shape)}")
    dr = cos3.shape[2]
    if dr == 0 or dr % 2 or dr > D:
        raise ValueError(f"{op}: cos last dim (rotary dim) must be even, > 0 and <= head_dim {D}, "
                         f"got shape {tuple(cos.shape)}")
    # cos/sin are tiny (no head dim): copying an odd layout is cheaper than a strided kernel path.
    if cos3.stride(-1) != 1:
        cos3 = cos3.contiguous()
    if sin3.stride(-1) != 1:
        sin3 = sin3.contiguous()
    return q4, k4, cos3, sin3, transposed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    """HF GLM's ``rotate_half``: pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                         unsqueeze_dim: int = 1, interleaved: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face eager rotary (``apply_rotary_pos_emb``), plus partial rotary and [T, Dr] cos/sin.

    interleaved=True is GLM-4's ``apply_rotary_pos_emb`` (``models/glm4``): cos/sin[..., :Dr/2] repeat-interleaved
    and GLM's pairwise ``rotate_half``. Same shapes as ``apply_rope``. Outputs are cast back to q's dtype (HF
    would promote with fp32 cos/sin).
    """
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotate_half = _rotate_half
    if interleaved:
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        rotate_half = _rotate_half_interleaved
    dr = cos.shape[-1]

    def rot(x):
        x_rot, x_pass = x[..., :dr], x[..., dr:]
        out = (x_rot * cos) + (rotate_half(x_rot) * sin)
        if x_pass.shape[-1]:
            out = torch.cat((out.to(x.dtype), x_pass), dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               unsqueeze_dim: int = 1, interleaved: bool = False,
               inplace: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by cos/sin (HF rotate-half convention, or GLM's interleaved one) in one kernel launch.

    Args:
        q: [B, Hq, T, D] (unsqueeze_dim=1) or [B, T, Hq, D] (unsqueeze_dim=2); any strides, last dim contiguous
           (e.g. the transposed view of a [B, T, Hq, D] projection is read in place, no copy).
        k: [B, Hk, T, D] / [B, T, Hk, D]; same dtype as q; Hk need not divide Hq.
        cos, sin: [B, T, Dr], [1, T, Dr] or [T, Dr] (broadcast over batch); any float dtype (math in fp32).
           Dr <= D, even: only the first Dr dims rotate, the rest pass through.
        unsqueeze_dim: 1 or 2, as in HF ``apply_rotary_pos_emb``.
        interleaved: False = rotate-half pairs (j, Dr/2 + j) with cos/sin[..., j] and [..., Dr/2 + j] (Llama,
           Qwen, ...). True = GLM-4 (``models/glm4``): pairs (2i, 2i + 1) with cos/sin[..., i]; the second half
           of cos/sin is not read.
        inplace: rotate q and k in their own memory (the results share it) and, in training, the incoming
           gradients in theirs: no [B, H, T, D] outputs or gradients are allocated (Liger-Kernel's memory). Only
           for q/k that nothing else reads afterwards (e.g. fresh projection outputs); a graph node that saved
           them fails at backward instead of reading rotated values. q and k in one buffer, expanded (stride 0)
           tensors, torch.compile and the CPU reference path run out of place.
    Returns:
        (q_embed, k_embed): new tensors with q's / k's shape, dtype and memory layout (``empty_like``: a transposed
        [B, T, H, D] input gives a transposed [B, T, H, D]-contiguous output, which is what SDPA/flash prefer).
    cos/sin get no gradient (HF builds them under no_grad); if they require grad the reference path runs.
    """
    if not isinstance(interleaved, bool):
        raise TypeError(f"apply_rope: interleaved must be a bool, got {type(interleaved).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"apply_rope: inplace must be a bool, got {type(inplace).__name__}")
    q4, k4, cos3, sin3, transposed = check_rope_args(q, k, cos, sin, unsqueeze_dim)
    if not _common.use_triton(q) or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        return apply_rope_reference(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    if _common.records_grad(q4, k4):
        qo, ko = RoPEFunction.apply(q4, k4, cos3, sin3, interleaved, inplace)   # checks inplace itself
    elif inplace and _can_rotate_in_place(q4, k4):
        qo, ko = _rope_launch(q4, k4, cos3, sin3, False, interleaved, inplace=True)
    else:
        qo, ko = _common.compiled_or_eager("swift_liger::rope_fwd", _rope_fwd)(q4, k4, cos3, sin3, interleaved)
    if transposed:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko
