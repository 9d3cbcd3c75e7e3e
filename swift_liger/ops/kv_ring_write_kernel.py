"""Ring-buffer KV cache writes and sink re-rotation (the kernels behind ``swift_liger.cache.RollingKVCache``).

Cache layout per layer: ``[B, H, C, D]`` with ``C = sinks + window``. Slots ``[0, sinks)`` hold the first ``sinks``
tokens of each row's stream (the attention sinks, kept forever); slots ``[sinks, C)`` are a ring holding the
last ``window`` tokens. Token number ``p`` of a row's stream (0-based, pads excluded) lives in

    slot(p) = p                              if p < sinks
            = sinks + (p - sinks) % window   otherwise

``kv_ring_write`` writes a batch of new tokens straight to their slots (O(tokens) bytes, no cat/roll of the
window). ``pos[b, t]`` is the stream index of token t of row b (-1 = padding, not stored) and ``end[b]`` the row's
stream length after this write; a token survives when it is a sink or among the row's last ``window`` tokens, so a
prefill chunk longer than the window writes only its last ``window`` tokens (plus the sinks), and no two surviving
tokens of a row share a slot (no write race).

Streaming caches also keep a pristine copy of each sink key (``k_sink``) and, every step, re-rotate the sink slots
the attention reads: ``k_cache[b, :, s] = R(delta_b) k_sink[b, :, s]``, the rotate-half RoPE rotation by a
per-row angle ``delta_b * inv_freq`` (cos/sin precomputed in fp32, ``[B, D/2]``), math in fp32. It always reads
the pristine copy, so rounding never accumulates from step to step. ``kv_ring_write`` does this in the same launch
as the write (``sink_cos/sink_sin/start``); ``kv_sink_rotate`` does it alone.

Pure kernel module: no transformers / ms-swift imports. Inference only (no autograd).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _launch

INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# Kernels. Work is flattened: token rows r = (b, h, t) of the write and sink rows (b, h, s) of the refresh are
# split into tiles of ROWS rows x D, so a decode step is a handful of programs (one under the interpreter) and a
# long prefill spreads over many.
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _rotate_sink_rows(src_ptr, dst_ptr, cos_ptr, sin_ptr, start_ptr, start0, r0, n_rows, H, S,
                      ss_b, ss_h, ss_s, sd_b, sd_h, sd_s, sc_b, sn_b,
                      LIMIT: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """dst[b, h, s] = R(cos[b], sin[b]) src[b, h, s] for flattened sink rows r0 .. r0 + ROWS (row = (b*H + h)*S + s).
    LIMIT: 0 = every slot, 1 = slots s < start[b], 2 = slots s < start0 (sinks stored by earlier calls)."""
    r = tl.cast(r0, tl.int64) + tl.arange(0, ROWS)
    s = r % S
    bh = r // S
    h = bh % H
    b = bh // H
    rmask = r < n_rows
    if LIMIT == 1:
        rmask = rmask & (s < tl.load(start_ptr + b, mask=rmask, other=0).to(tl.int64))
    if LIMIT == 2:
        rmask = rmask & (s < start0)
    i = tl.arange(0, BLOCK_HALF)
    mask = rmask[:, None] & (i[None, :] < HALF)
    c = tl.load(cos_ptr + b[:, None] * sc_b + i[None, :], mask=mask, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + b[:, None] * sn_b + i[None, :], mask=mask, other=0.0).to(tl.float32)
    src = src_ptr + (b * ss_b + h * ss_h + s * ss_s)[:, None] + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + (b * sd_b + h * sd_h + s * sd_s)[:, None] + i[None, :]
    tl.store(dst, (x1 * c - x2 * sn).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * sn).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["pos0"])
def _kv_ring_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, pos_ptr, end_ptr,
                          pos0, n_rows, T, H, SINKS, WINDOW,
                          sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                          skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
                          sks_b, sks_h, sks_s,
                          sp_b, sp_t,
                          D: tl.constexpr, UNIFORM: tl.constexpr, SPLIT_SINKS: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(B*H*T, ROWS),). Token row r = (b*H + h)*T + t.
    UNIFORM: every row's tokens are pos0 .. pos0 + T - 1 (no index tensors)."""
    pid = tl.program_id(0)
    r = tl.cast(pid, tl.int64) * ROWS + tl.arange(0, ROWS)
    t = r % T
    bh = r // T
    h = bh % H
    b = bh // H
    rmask = r < n_rows
    if UNIFORM:
        pos = tl.cast(pos0, tl.int64) + t
        end = tl.cast(pos0, tl.int64) + T
    else:
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=rmask, other=-1).to(tl.int64)
        end = tl.load(end_ptr + b, mask=rmask, other=0).to(tl.int64)
    is_sink = rmask & (pos >= 0) & (pos < SINKS)
    in_ring = rmask & (pos >= SINKS) & (pos >= end - WINDOW)
    # Slots of skipped rows are clamped in range, so no address is ever out of bounds, masked or not.
    # A clamp, not tl.where(is_sink, ...): Triton 3.6 on H200 failed a layout pass on that select (2026-11-29).
    sink_slot = tl.maximum(tl.minimum(pos, SINKS - 1), 0)
    slot = tl.where(is_sink, sink_slot, SINKS + tl.where(in_ring, pos - SINKS, 0) % WINDOW)
    d = tl.arange(0, BLOCK_D)
    dmask = d[None, :] < D
    m_keep = (is_sink | in_ring)[:, None] & dmask
    # A pure copy: values move bit for bit, no upcast needed.
    kv = tl.load(k_ptr + (b * sk_b + h * sk_h + t * sk_t)[:, None] + d[None, :], mask=m_keep, other=0.0)
    vv = tl.load(v_ptr + (b * sv_b + h * sv_h + t * sv_t)[:, None] + d[None, :], mask=m_keep, other=0.0)
    tl.store(kc_ptr + (b * skc_b + h * skc_h + slot * skc_s)[:, None] + d[None, :],
             kv.to(kc_ptr.dtype.element_ty), mask=m_keep)
    tl.store(vc_ptr + (b * svc_b + h * svc_h + slot * svc_s)[:, None] + d[None, :],
             vv.to(vc_ptr.dtype.element_ty), mask=m_keep)
    if SPLIT_SINKS:
        # Pristine copy of each sink key, the source of every later re-rotation.
        tl.store(ks_ptr + (b * sks_b + h * sks_h + sink_slot * sks_s)[:, None] + d[None, :],
                 kv.to(ks_ptr.dtype.element_ty), mask=is_sink[:, None] & dmask)


@triton.jit(do_not_specialize=["start0"])
def _kv_sink_refresh_kernel(src_ptr, dst_ptr, cos_ptr, sin_ptr, start_ptr, start0, n_rows, S, H,
                            ss_b, ss_h, ss_s, sd_b, sd_h, sd_s, sc_b, sn_b,
                            LIMIT: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Grid (cdiv(B*H*S, ROWS),): re-rotate the sinks stored by earlier calls (LIMIT 1: s < start[b]; 2: s < start0).
    A launch of its own: fused into the write kernel, Triton 3.6's layout pass crashed on H200 (seen 2026-11-29)."""
    _rotate_sink_rows(src_ptr, dst_ptr, cos_ptr, sin_ptr, start_ptr, start0, tl.program_id(0) * ROWS, n_rows, H, S,
                      ss_b, ss_h, ss_s, sd_b, sd_h, sd_s, sc_b, sn_b, LIMIT, HALF, ROWS, BLOCK_HALF)


@triton.jit
def _kv_sink_rotate_kernel(src_ptr, dst_ptr, cos_ptr, sin_ptr, n_rows, S, H,
                           ss_b, ss_h, ss_s, sd_b, sd_h, sd_s, sc_b, sn_b,
                           HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Grid (cdiv(B*H*S, ROWS),)."""
    _rotate_sink_rows(src_ptr, dst_ptr, cos_ptr, sin_ptr, src_ptr, 0, tl.program_id(0) * ROWS, n_rows, H, S,
                      ss_b, ss_h, ss_s, sd_b, sd_h, sd_s, sc_b, sn_b, 0, HALF, ROWS, BLOCK_HALF)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (custom ops so a compiled region keeps each launch as one node)
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KVWriteConfig:
    """Launch of _kv_ring_write_kernel: rows (ROWS) [row, D] rows per program, block_d (BLOCK_D) = next_pow2(D)."""
    rows: int
    block_d: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class KVSinkConfig:
    """Launch of _kv_sink_refresh_kernel / _kv_sink_rotate_kernel: rows (ROWS) sink rows per program, block_half
    (BLOCK_HALF) = next_pow2(D / 2), at least 2."""
    rows: int
    block_half: int
    num_warps: int


LAUNCH_CONFIGS = {"write": KVWriteConfig, "refresh": KVSinkConfig, "rotate": KVSinkConfig}


def _rows_per_tile(n_rows: int, width: int) -> int:
    """Fill ~4096-element tiles, no more rows than there are (power of 2, at least 2)."""
    return max(2, min(_common.next_pow2(n_rows), max(2, 4096 // width)))


def launch_config(kind: str, n_rows: int, D: int, device):
    """``kind`` "write" (n_rows = B * H * T new rows), "refresh" or "rotate" (n_rows = B * H * sinks): tiles of
    ~4096 elements; the ring write uses 4 warps from 2048 elements a tile, else 2; the sink kernels 2. Every
    device."""
    if kind == "write":
        block_d = _common.next_pow2(D)
        rows = _rows_per_tile(n_rows, block_d)
        cfg = KVWriteConfig(rows, block_d, 4 if rows * block_d >= 2048 else 2)
    elif kind in ("refresh", "rotate"):
        block_half = max(2, _common.next_pow2(D // 2))
        cfg = KVSinkConfig(_rows_per_tile(n_rows, 2 * block_half), block_half, 2)
    else:
        raise ValueError(f"kind must be 'write', 'refresh' or 'rotate', got {kind!r}")
    return _common.apply_override(__name__, kind, cfg)


_WRITE = _launch.FastLaunch(_kv_ring_write_kernel)
_REFRESH = _launch.FastLaunch(_kv_sink_refresh_kernel)
_ROTATE = _launch.FastLaunch(_kv_sink_rotate_kernel)


def _kv_ring_write_launch(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          pos: Optional[torch.Tensor], end: Optional[torch.Tensor], pos0: int, sinks: int,
                          window: int, k_sink: Optional[torch.Tensor], sink_cos: Optional[torch.Tensor],
                          sink_sin: Optional[torch.Tensor], start: Optional[torch.Tensor]) -> None:
    """pos None: uniform rows starting at pos0 (end and start implied)."""
    B, H, T, D = k.shape
    if B == 0 or H == 0 or T == 0 or D == 0:
        return
    uniform = pos is None
    split = k_sink is not None and sinks > 0
    rotate = split and sink_cos is not None
    ks = k_sink if split else k_cache
    pos_t = k if uniform else pos        # unused pointers get any tensor
    end_t = k if uniform else end
    start_t = start if (rotate and not uniform) else pos_t
    cos = sink_cos if rotate else k
    sin = sink_sin if rotate else k
    n_rows = B * H * T
    cfg = launch_config("write", n_rows, D, k.device)
    grid = _common.cdiv(n_rows, cfg.rows)
    if rotate:
        # Sinks stored by earlier calls (slots < start) never overlap the slots this call writes: order-free.
        n_sink = B * H * sinks
        sc = launch_config("refresh", n_sink, D, k.device)
        _REFRESH.launch(
            (_common.cdiv(n_sink, sc.rows),),
            ks, k_cache, cos, sin, start_t, pos0, n_sink, sinks, H,
            ks.stride(0), ks.stride(1), ks.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            cos.stride(0), sin.stride(0),
            LIMIT=2 if uniform else 1, HALF=D // 2, ROWS=sc.rows, BLOCK_HALF=sc.block_half, num_warps=sc.num_warps)
    sk, sv, skc, svc, sks = k.stride(), v.stride(), k_cache.stride(), v_cache.stride(), ks.stride()
    _WRITE.launch(
        (grid,),
        k, v, k_cache, v_cache, ks, pos_t, end_t,
        pos0, n_rows, T, H, sinks, window,
        sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], skc[0], skc[1], skc[2], svc[0], svc[1], svc[2],
        sks[0], sks[1], sks[2],
        0 if uniform else pos.stride(0), 0 if uniform else pos.stride(1),
        D=D, UNIFORM=uniform, SPLIT_SINKS=split, ROWS=cfg.rows, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps)


def _kv_sink_rotate_launch(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    B, H, S, D = src.shape
    if B == 0 or H == 0 or S == 0 or D == 0:
        return
    n_rows = B * H * S
    cfg = launch_config("rotate", n_rows, D, src.device)
    _ROTATE.launch(
        (_common.cdiv(n_rows, cfg.rows),),
        src, dst, cos, sin, n_rows, S, H,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        cos.stride(0), sin.stride(0),
        HALF=D // 2, ROWS=cfg.rows, BLOCK_HALF=cfg.block_half, num_warps=cfg.num_warps)


@torch.library.custom_op("swift_liger::kv_ring_write", mutates_args=("k_cache", "v_cache", "k_sink"))
def _kv_ring_write_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      pos: Optional[torch.Tensor], end: Optional[torch.Tensor], pos0: int, sinks: int, window: int,
                      k_sink: Optional[torch.Tensor], sink_cos: Optional[torch.Tensor],
                      sink_sin: Optional[torch.Tensor], start: Optional[torch.Tensor]) -> None:
    _kv_ring_write_launch(k_cache, v_cache, k, v, pos, end, pos0, sinks, window, k_sink, sink_cos, sink_sin, start)


@_kv_ring_write_op.register_fake
def _(k_cache, v_cache, k, v, pos, end, pos0, sinks, window, k_sink, sink_cos, sink_sin, start):
    return None


@torch.library.custom_op("swift_liger::kv_sink_rotate", mutates_args=("dst",))
def _kv_sink_rotate_op(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _kv_sink_rotate_launch(dst, src, cos, sin)


@_kv_sink_rotate_op.register_fake
def _(dst, src, cos, sin):
    return None


# ---------------------------------------------------------------------------------------------------------------
# References (CPU fallback and test oracle)
# ---------------------------------------------------------------------------------------------------------------

def ring_slots(pos: torch.Tensor, end: torch.Tensor, sinks: int, window: int):
    """(keep, is_sink, slot) for stream indices ``pos`` [B, T] given the rows' stream lengths ``end`` [B]."""
    pos = pos.long()
    end = end.long()[:, None]
    is_sink = (pos >= 0) & (pos < sinks)
    in_ring = (pos >= sinks) & (pos >= end - window)
    slot = torch.where(is_sink, pos, sinks + torch.remainder(pos - sinks, window))
    return is_sink | in_ring, is_sink, slot


def _uniform_indices(p0: int, B: int, T: int, device):
    pos = (torch.arange(T, device=device) + p0).expand(B, T)
    full = torch.full((B,), p0, dtype=torch.long, device=device)
    return pos, full + T, full


def kv_ring_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            pos, end: Optional[torch.Tensor], sinks: int, window: int,
                            k_sink: Optional[torch.Tensor] = None, sink_cos: Optional[torch.Tensor] = None,
                            sink_sin: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None) -> None:
    """Same contract as ``kv_ring_write``, with index_put (PyTorch)."""
    if not isinstance(pos, torch.Tensor) and k.shape[2] == 1:
        # One token at stream index p in every row: always kept, one slot, plain slice copies.
        p = int(pos)
        slot = p if p < sinks else sinks + (p - sinks) % window
        old = min(p, sinks)          # sinks stored by earlier calls
        if sink_cos is not None and k_sink is not None and old > 0:
            kv_sink_rotate_reference(k_cache[:, :, :old], k_sink[:, :, :old], sink_cos, sink_sin)
        k_cache[:, :, slot:slot + 1].copy_(k)
        v_cache[:, :, slot:slot + 1].copy_(v)
        if k_sink is not None and slot < sinks:
            k_sink[:, :, slot:slot + 1].copy_(k)
        return
    if not isinstance(pos, torch.Tensor):
        pos, end, start = _uniform_indices(int(pos), k.shape[0], k.shape[2], k.device)
    if sink_cos is not None and k_sink is not None and sinks > 0:
        old = torch.arange(sinks, device=k_cache.device)[None, :] < start.long()[:, None]   # [B, S]
        rotated = torch.empty_like(k_sink)
        kv_sink_rotate_reference(rotated, k_sink, sink_cos, sink_sin)
        k_cache[:, :, :sinks] = torch.where(old[:, None, :, None], rotated, k_cache[:, :, :sinks])
    keep, is_sink, slot = ring_slots(pos, end, sinks, window)
    bi, ti = keep.nonzero(as_tuple=True)
    si = slot[bi, ti]
    k_cache[bi, :, si] = k[bi, :, ti].to(k_cache.dtype)
    v_cache[bi, :, si] = v[bi, :, ti].to(v_cache.dtype)
    if k_sink is not None:
        sel = is_sink[bi, ti]
        k_sink[bi[sel], :, si[sel]] = k[bi[sel], :, ti[sel]].to(k_sink.dtype)


def kv_sink_rotate_reference(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Same contract as ``kv_sink_rotate`` (rotate-half, fp32 math)."""
    half = src.shape[-1] // 2
    x = src.float()
    x1, x2 = x[..., :half], x[..., half:]
    c = cos.float()[:, None, None, :]
    s = sin.float()[:, None, None, :]
    dst.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dst.dtype))


# ---------------------------------------------------------------------------------------------------------------
# Validation and public functions
# ---------------------------------------------------------------------------------------------------------------

def _check_window(sinks, window):
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be an int > 0, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")


def check_kv_ring_write_args(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink, sink_cos, sink_sin, start):
    _check_window(sinks, window)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        _common.check_tensor(name, t, ndim=4)
        _common.check_last_dim_contiguous(name, t)
    _common.check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, k_sink=k_sink)
    _common.check_same_dtype(k_cache=k_cache, v_cache=v_cache, k=k, v=v, k_sink=k_sink)
    B, H, C, D = k_cache.shape
    if tuple(v_cache.shape) != (B, H, C, D):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if C != sinks + window:
        raise ValueError(f"k_cache must hold sinks + window = {sinks + window} slots (dim 2), got shape "
                         f"{tuple(k_cache.shape)}")
    T = k.shape[2]
    if tuple(k.shape) != (B, H, T, D) or tuple(v.shape) != (B, H, T, D):
        raise ValueError(f"k and v must be [B={B}, H={H}, T, D={D}] like the cache, got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if isinstance(pos, bool) or not isinstance(pos, (int, torch.Tensor)):
        raise TypeError(f"pos must be a [B, T] index tensor or an int, got {type(pos).__name__}")
    if isinstance(pos, int):
        if pos < 0:
            raise ValueError(f"pos as an int (every row's first stream index) must be >= 0, got {pos}")
        if end is not None or start is not None:
            raise ValueError("with an int pos, end and start are implied (pos + T and pos): pass None")
    else:
        _common.check_tensor("pos", pos, ndim=2, dtypes=INDEX_DTYPES)
        _common.check_tensor("end", end, ndim=1, dtypes=INDEX_DTYPES)
        _common.check_same_device(k=k, pos=pos, end=end)
        if tuple(pos.shape) != (B, T):
            raise ValueError(f"pos must be [B, T] = [{B}, {T}], got {tuple(pos.shape)}")
        if tuple(end.shape) != (B,):
            raise ValueError(f"end must be [B] = [{B}], got {tuple(end.shape)}")
    if k_sink is not None:
        _common.check_tensor("k_sink", k_sink, ndim=4)
        _common.check_last_dim_contiguous("k_sink", k_sink)
        if tuple(k_sink.shape) != (B, H, sinks, D):
            raise ValueError(f"k_sink must be [B, H, sinks, D] = {(B, H, sinks, D)}, got {tuple(k_sink.shape)}")
    if sink_cos is not None or sink_sin is not None or start is not None:
        if k_sink is None or sink_cos is None or sink_sin is None or (start is None and not isinstance(pos, int)):
            raise ValueError("sink_cos, sink_sin (and start, with a pos tensor) go together, and need k_sink")
        _check_cos_sin(sink_cos, sink_sin, B, D, "sink_cos", "sink_sin")
        _common.check_same_device(k=k, sink_cos=sink_cos, sink_sin=sink_sin)
        if start is not None:
            _common.check_tensor("start", start, ndim=1, dtypes=INDEX_DTYPES)
            _common.check_same_device(k=k, start=start)
            if start.shape[0] != B:
                raise ValueError(f"start must be [B] = [{B}], got {tuple(start.shape)}")


def kv_ring_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  pos, end: Optional[torch.Tensor], sinks: int, window: int,
                  k_sink: Optional[torch.Tensor] = None, sink_cos: Optional[torch.Tensor] = None,
                  sink_sin: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None) -> None:
    """Write new tokens into a sinks + ring KV cache, in place (one launch).

    Args:
        k_cache, v_cache: [B, H, sinks + window, D] cache storage (last dim contiguous).
        k, v: [B, H, T, D] new keys / values, same dtype (any strides, last dim contiguous: the transposed
            [B, T, H, D] projections HF attention produces are read in place).
        pos: [B, T] int32/int64 stream index of each token in its row (pads excluded), -1 = do not store; the
            indices of one row must be distinct and < end[b]. Or an int p: every row's tokens are p .. p+T-1
            (no index tensors, the decode fast path; end and start are then implied and must be None).
        end: [B] int32/int64 each row's stream length after this write (None with an int pos). Tokens with
            sinks <= pos < end - window are dropped (they would be overwritten within this same write).
        sinks, window: the layout (see module docstring).
        k_sink: optional [B, H, sinks, D]: also keep a pristine copy of each sink key here (streaming mode).
        sink_cos, sink_sin, start: optional (need k_sink) [B, D/2] float32 and [B] int: also refresh the sink slots
            stored by earlier calls (slots < start[b], the row's stream length before this call) with
            k_cache[b, :, s] = R(sink_cos[b], sink_sin[b]) k_sink[b, :, s] (rotate-half RoPE, fp32 math). Sinks
            written by this call are stored unrotated, so a row receiving sinks must be given a zero angle.
    """
    check_kv_ring_write_args(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink, sink_cos, sink_sin, start)
    kv_ring_write_unchecked(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink, sink_cos, sink_sin, start)


def kv_ring_write_unchecked(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink=None, sink_cos=None,
                            sink_sin=None, start=None) -> None:
    """``kv_ring_write`` without argument checks, for callers that validated once (the cache, every layer)."""
    if _common.use_triton(k_cache):
        uniform = not isinstance(pos, torch.Tensor)
        _common.compiled_or_eager("swift_liger::kv_ring_write", _kv_ring_write_launch)(
            k_cache, v_cache, k, v, None if uniform else pos, end, int(pos) if uniform else 0, sinks, window,
            k_sink, sink_cos, sink_sin, start)
    else:
        kv_ring_write_reference(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink, sink_cos, sink_sin, start)


def _check_cos_sin(cos, sin, B, D, cos_name="cos", sin_name="sin"):
    _common.check_tensor(cos_name, cos, ndim=2, dtypes=(torch.float32,))
    _common.check_tensor(sin_name, sin, ndim=2, dtypes=(torch.float32,))
    _common.check_last_dim_contiguous(cos_name, cos)
    _common.check_last_dim_contiguous(sin_name, sin)
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    if tuple(cos.shape) != (B, D // 2) or tuple(sin.shape) != (B, D // 2):
        raise ValueError(f"{cos_name} and {sin_name} must be [B, D/2] = [{B}, {D // 2}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")


def kv_sink_rotate_unchecked(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``kv_sink_rotate`` without argument checks, for callers that built the arguments themselves."""
    if _common.use_triton(src):
        _common.compiled_or_eager("swift_liger::kv_sink_rotate", _kv_sink_rotate_launch)(dst, src, cos, sin)
    else:
        kv_sink_rotate_reference(dst, src, cos, sin)


def kv_sink_rotate(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: dst[b] = src[b] * cos[b] + rotate_half(src[b]) * sin[b] (rotate-half RoPE by per-row angles).

    Args:
        dst, src: [B, H, S, D] (last dim contiguous, D even), same dtype; dst may be a view into a cache.
        cos, sin: [B, D/2] float32 (one angle per frequency and row; the two halves of HF's cos/sin are equal).
    """
    _common.check_tensor("dst", dst, ndim=4)
    _common.check_tensor("src", src, ndim=4)
    _common.check_same_device(dst=dst, src=src, cos=cos, sin=sin)
    _common.check_same_dtype(dst=dst, src=src)
    _common.check_last_dim_contiguous("dst", dst)
    _common.check_last_dim_contiguous("src", src)
    if dst.shape != src.shape:
        raise ValueError(f"dst and src must have the same shape, got {tuple(dst.shape)} and {tuple(src.shape)}")
    _check_cos_sin(cos, sin, src.shape[0], src.shape[-1])
    if _common.use_triton(src):
        _common.compiled_or_eager("swift_liger::kv_sink_rotate", _kv_sink_rotate_launch)(dst, src, cos, sin)
    else:
        kv_sink_rotate_reference(dst, src, cos, sin)
