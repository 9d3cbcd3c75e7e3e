"""Single-token decode attention over a full KV cache, split along the keys (flash-decoding), GQA-aware.

    out[b, 0, h, :] = softmax(scale * q[b, h, 0, :] @ k[b, h // G, :, :]^T) @ v[b, h // G, :, :]     G = Hq / Hkv

Every cached key is visible (no mask): this is the step ``RollingKVCache`` runs once its ring is full, where the
cache is exactly the sinks plus the last ``window`` tokens. With ``lens`` ([B] int, on the device) row b sees only
its first ``min(lens[b], C)`` keys: the cache's CUDA-graph steps before the ring fills pass the whole storage and the
row lengths, so one captured graph serves every step (the grid stays sized for C; slices past a row's length exit
at once). Why not SDPA: with one query row, PyTorch's flash
kernel runs one program per (row, query head) that walks all keys alone. For Llama-3-8B shapes at 4100 keys
that measured ~0.6 ms per layer at batch 8 on the H200 (about 0.2 TB/s), where reading the 128 MiB of K/V once
takes ~35 us. Here each program takes one KV head (all G query heads share its K/V reads, so they are read once)
and one slice of the keys, and a second tiny launch merges the slices with their log-sum-exps.

Pure kernel module: no transformers imports. Inference only (no autograd).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _launch

PROGRAMS_PER_SM = 2     # split the keys until there are about this many programs per SM


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Launch configuration of the split kernel: keys per inner step, software-pipeline depth, warps."""
    block_n: int = 64
    num_stages: int = 3   # Triton's default
    num_warps: int = 4


# Most preferred first. The K/V tiles are [block_n, BLOCK_D] per pipeline stage; the first candidate whose estimated
# shared memory fits the device's per-block limit is launched (tests/ops/test_portability.py compiles the choice
# for sm_75..sm_90 and checks the real usage). On the H100/H200 every head dim in bf16/fp16 keeps the first one.
CANDIDATES = (SplitConfig(64, 3), SplitConfig(64, 2), SplitConfig(32, 2), SplitConfig(64, 1), SplitConfig(32, 1),
              SplitConfig(16, 1))
DEFAULT = CANDIDATES[0]


def shared_estimate(cfg: SplitConfig, block_d: int, elt_bytes: int, write: bool = False) -> int:
    """An upper estimate of the split kernel's shared memory, bytes: K and V tiles for max(1, stages - 1) buffered
    stages plus 24 KiB for the dot operands. Compiled for sm_86 and sm_90 at D 64-256, block_n 16-64, 1-3 stages,
    fp32 and 16-bit, the real figure was at most 20544 B above the tiles (fp32 D=256 block_n 64, 2 stages: 151616
    real, 155648 estimated); the portability test checks the chosen configurations on every target. ``write`` (the
    fused ring write: the tiles pass through a select) costs about one more stage of tiles: at D=256 it measured
    up to 126 KiB more (fp32, sm_90), counted as one extra stage."""
    stages = max(1, cfg.num_stages - 1) + (1 if write else 0)
    return stages * 2 * cfg.block_n * block_d * elt_bytes + 24 * 1024


def split_config(block_d: int, elt_bytes: int, max_shared: int, write: bool = False) -> SplitConfig:
    for cfg in CANDIDATES:
        if shared_estimate(cfg, block_d, elt_bytes, write) <= max_shared:
            return cfg
    return CANDIDATES[-1]


def config_for(device, block_d: int, elt_bytes: int, write: bool = False) -> SplitConfig:
    """The selection: split_config for the device's shared memory (torch.device or _common.Target); DEFAULT under
    the interpreter (no shared-memory limit)."""
    t = _common.target(device)
    if t.type != "cuda":
        return DEFAULT
    return split_config(block_d, elt_bytes, t.max_shared, write)


LAUNCH_CONFIGS = {None: SplitConfig}


def launch_config(block_d: int, elt_bytes: int, device, write: bool = False) -> SplitConfig:
    """Launch parameters of the split kernel for BLOCK_D = block_d and elt_bytes-byte inputs (``write``: with the
    fused ring write): config_for, with any _common.launch_override applied. The merge kernel always runs 4 warps."""
    return _common.apply_override(__name__, None, config_for(device, block_d, elt_bytes, write))


@triton.jit(do_not_specialize=["slot"])   # the slot moves every step: one compiled kernel for all of them
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, C, HKV, keys_per_split, scale,
                         sq_b, sq_h, sk_b, sk_h, sk_c, sv_b, sv_h, sv_c,
                         kn_ptr, vn_ptr, slot, skn_b, skn_h, svn_b, svn_h, lens_ptr,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         WRITE: tl.constexpr, LENS: tl.constexpr):
    """Grid (B * HKV, splits). Partial softmax-weighted values of one key slice for the G query heads of one KV
    head: o[(b*HKV + hk)*G + g, split, :] (normalised within the slice) and lse[..., split].
    WRITE: the new token's key/value (kn/vn [B, HKV, 1, D]) belong at column `slot` of k/v; the program whose slice
    holds the slot stores them there and attends to them from registers (what it loads from that column is
    replaced, so the store and the load need no ordering).
    LENS: row b attends to its first lens[b] keys only; a slice past them stores lse = -inf and zeros."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    hk = pid % HKV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + (hk * G + g)[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:   # the interpreter computes bf16 on raw bits
        q = q.to(tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, C)
    if LENS:
        end = tl.minimum(end, tl.load(lens_ptr + b).to(tl.int32))
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    if WRITE:
        k_new = tl.load(kn_ptr + b * skn_b + hk * skn_h + d, mask=dmask, other=0.0)
        v_new = tl.load(vn_ptr + b * svn_b + hk * svn_h + d, mask=dmask, other=0.0)
        own = (slot >= start) & (slot < end)
        wmask = d < tl.where(own, D, 0)   # not `dmask & own`: see cross_entropy_kernel's n_read
        tl.store(k_base + slot * sk_c + d, k_new.to(k_ptr.dtype.element_ty), mask=wmask)
        tl.store(v_base + slot * sv_c + d, v_new.to(v_ptr.dtype.element_ty), mask=wmask)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + n[:, None] * sk_c + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * sv_c + d[None, :], mask=kv_mask, other=0.0)
        if WRITE:
            at = (n == slot)[:, None]
            k = tl.where(at, k_new[None, :].to(k.dtype), k)
            v = tl.where(at, v_new[None, :].to(v.dtype), v)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    row = pid * G + g                                     # = b * HQ + query head
    tl.store(o_ptr + (row[:, None] * S_PAD + split) * BLOCK_D + d[None, :], acc / tl.maximum(l, 1e-30)[:, None],
             mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + row * S_PAD + split, m + tl.log(l), mask=gmask)


@triton.jit
def _decode_merge_kernel(o_ptr, lse_ptr, out_ptr, splits, so_b, so_h, HQ,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    """Grid (B * HQ,). out[b, 0, h, :] = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse)."""
    row = tl.program_id(0)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, BLOCK_D)
    smask = s < splits
    lse = tl.load(lse_ptr + row * S_PAD + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = tl.where(smask & (lse > float("-inf")), w, 0.0)   # empty slices (past a row's lens): weight 0
    o = tl.load(o_ptr + (row * S_PAD + s[:, None]) * BLOCK_D + d[None, :], mask=smask[:, None] & (d[None, :] < D),
                other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    b = row // HQ
    h = row % HQ
    tl.store(out_ptr + b * so_b + h * so_h + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def _plan(B: int, HKV: int, C: int, device, block_n: int = DEFAULT.block_n):
    """(keys per split, splits): about PROGRAMS_PER_SM programs per SM of ``device`` (torch.device or
    _common.Target; 4 programs under the interpreter), whole block_n steps, no empty split."""
    t = _common.target(device)
    target = PROGRAMS_PER_SM * t.sm_count if t.type == "cuda" else 4
    want = max(1, min(64, target // max(1, B * HKV)))
    per = _common.cdiv(_common.cdiv(C, want), block_n) * block_n
    return per, _common.cdiv(C, per)


_SPLIT = _launch.FastLaunch(_decode_split_kernel)
_MERGE = _launch.FastLaunch(_decode_merge_kernel)


def _decode_attention_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             lens: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
                             v_new: Optional[torch.Tensor] = None, slot: int = 0) -> torch.Tensor:
    B, HQ, _, D = q.shape
    HKV, C = k.shape[1], k.shape[2]
    out = _common.new_empty((B, 1, HQ, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    G = HQ // HKV
    block_d = max(16, _common.next_pow2(D))
    write = k_new is not None
    cfg = launch_config(block_d, q.element_size(), q.device, write)
    per, splits = _plan(B, HKV, C, q.device, cfg.block_n)
    s_pad = max(2, _common.next_pow2(splits))
    o_part = torch.empty((B * HQ, s_pad, block_d), dtype=torch.float32, device=q.device)
    lse = torch.empty((B * HQ, s_pad), dtype=torch.float32, device=q.device)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    skn, svn = (k_new.stride(), v_new.stride()) if write else ((0, 0), (0, 0))
    _SPLIT.launch(
        (B * HKV, splits),
        q, k, v, o_part, lse, C, HKV, per, scale,
        sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        k_new if write else k, v_new if write else v, slot, skn[0], skn[1], svn[0], svn[1],
        lens if lens is not None else q,
        G=G, G_PAD=max(16, _common.next_pow2(G)), D=D, BLOCK_D=block_d, S_PAD=s_pad, BLOCK_N=cfg.block_n,
        UPCAST=_common.INTERPRET, IEEE=q.dtype == torch.float32, WRITE=write, LENS=lens is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    _MERGE.launch((B * HQ,), o_part, lse, out, splits, so[0], so[2], HQ,
                  D=D, BLOCK_D=block_d, S_PAD=s_pad, num_warps=4)
    return out


@torch.library.custom_op("swift_liger::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _decode_attention_launch(q, k, v, scale, lens)


@_decode_attention_op.register_fake
def _(q, k, v, scale, lens=None):
    B, HQ, _, D = q.shape
    return q.new_empty((B, 1, HQ, D))


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                               lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference (CPU fallback and test oracle), math in float32 or wider."""
    G = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.to(acc).repeat_interleave(G, dim=1)
    vv = v.to(acc).repeat_interleave(G, dim=1)
    s = q.to(acc) @ kk.transpose(-1, -2) * scale                       # [B, Hq, 1, C]
    if lens is not None:
        cols = torch.arange(k.shape[2], device=k.device)
        s = s.masked_fill((cols[None, :] >= lens.to(k.device)[:, None])[:, None, None, :], float("-inf"))
    w = torch.softmax(s, dim=-1)
    return (w @ vv).transpose(1, 2).to(q.dtype)


def decode_attention_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                               lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    if _common.use_triton(q):
        return _common.compiled_or_eager("swift_liger::decode_attention", _decode_attention_launch)(q, k, v, scale,
                                                                                                  lens)
    return decode_attention_reference(q, k, v, scale, lens)


def decode_attention_write_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                     k_new: torch.Tensor, v_new: torch.Tensor, slot: int) -> torch.Tensor:
    """Store k_new/v_new [B, Hkv, 1, D] at column ``slot`` of k/v (in place), then attend over all of k/v: one
    launch fewer than a ring write followed by decode_attention (eager decode pays ~40 us of host time per launch
    and layer on the H200 host). No argument checks; eager only (callers keep it out of torch.compile)."""
    if _common.use_triton(q):
        return _decode_attention_launch(q, k, v, scale, None, k_new, v_new, int(slot))
    k[:, :, slot] = k_new[:, :, 0]
    v[:, :, slot] = v_new[:, :, 0]
    return decode_attention_reference(q, k, v, scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one new token per row over every cached key (no mask), or over each row's first lens[b].

    Args:
        q: [B, Hq, 1, D] (the rotated query, as transformers hands it to the attention function).
        k, v: [B, Hkv, C, D] with Hq % Hkv == 0, last dim contiguous, same dtype as q (e.g. a cache's storage).
        scale: softmax scale (head_dim ** -0.5 for Llama).
        lens: optional [B] integer tensor on k's device, 1 <= lens[b] (values above C mean C; not read on the
            host, so not checked against C or 1: a CUDA graph can replay with new values).
    Returns:
        [B, 1, Hq, D] in q's dtype (transformers' attention-output layout).
    """
    _common.check_qkv(q, k, v)
    B, HQ, T, D = q.shape
    if T != 1:
        raise ValueError(f"decode_attention takes one query token per row, got q of shape {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k and v must be [B, Hkv, C, D] = [{B}, *, *, {D}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[1] == 0 or HQ % k.shape[1]:
        raise ValueError(f"query heads ({HQ}) must be a multiple of KV heads ({k.shape[1]})")
    if k.shape[2] == 0:
        raise ValueError("decode_attention needs at least one cached key")
    _common.check_positive("scale", scale)
    if lens is not None:
        if not isinstance(lens, torch.Tensor):
            raise TypeError(f"lens must be a [B] integer tensor or None, got {type(lens).__name__}")
        if (lens.shape != (B,) or lens.dtype not in (torch.int32, torch.int64) or lens.device != k.device):
            raise ValueError(f"lens must be a [B] = [{B}] int32/int64 tensor on {k.device}, got shape "
                             f"{tuple(lens.shape)}, {lens.dtype} on {lens.device}")
    return decode_attention_unchecked(q, k, v, float(scale), lens)
