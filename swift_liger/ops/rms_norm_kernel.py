"""RMSNorm (optionally fused with the residual add) as two bandwidth-bound Triton kernels.

    y = scale * x / sqrt(mean(x^2, -1) + eps),   scale = offset + weight

Forward: one pass over x (whole row in registers), writes y (and s = x + residual) plus rstd (fp32, one per row).
Backward: a persistent grid; every program walks rows with a stride, writes dx and keeps its dW partial in fp32
registers; the partials ([programs, H] fp32) are summed and cast by one small kernel (``_reduce``). No atomics.

Casting modes (``casting``), matching Hugging Face eager code:
* ``"llama"`` (LlamaRMSNorm, Qwen, Mistral, ...): ``xhat = (x.float() * rstd).to(x.dtype)``, then
  ``y = (offset + weight) * xhat`` in torch type promotion of (weight.dtype, x.dtype); ``offset + weight`` is
  rounded to weight.dtype as torch would. Output dtype: ``promote_types(weight.dtype, x.dtype)``.
* ``"gemma"`` (Gemma/Gemma2/Gemma3RMSNorm): everything in fp32, ``y = (xhat_fp32 * (offset + weight.float()))``,
  cast to x.dtype once at the end. Output dtype: x.dtype.
* ``"none"``: no intermediate cast at all: fp32 compute, one cast to x.dtype at the end. Numerically this is the
  same as ``"gemma"``; the name exists for parity with Liger-Kernel's casting modes (whose "none" computes in the
  input dtype; ours stays in fp32, which is more accurate at the same speed since the op is memory-bound).

Backward is computed in fp32 for every mode (treating the llama intermediate rounding as identity, i.e. the
straight-through gradient HF's autograd also produces), so gradients are at least as accurate as HF eager.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from . import _common, _launch, _reduce

__all__ = ["rms_norm", "rms_norm_reference", "RMSNormFunction", "launch_config", "LaunchConfig",
           "LAUNCH_CONFIGS"]

CASTING_MODES = ("llama", "gemma", "none")
_CASTING_CODE = {"llama": 0, "gemma": 1, "none": 2}

# Wider rows run the PyTorch reference. Rows keep the whole hidden dim in registers: past H = 8192 (bf16 backward)
# the compiled kernels start to spill; still correct and fused, but a column-chunked variant would be faster.
MAX_FUSED_H = 65536

# Backward grid from occupancy: at most this many programs per SM (each adds an fp32 [H] dW partial), and the
# count used when the compiled kernel's registers cannot be read.
BWD_MAX_PROGRAMS_PER_SM = 8
BWD_FALLBACK_PROGRAMS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch of the forward or backward kernel for an [n_rows, H] problem."""
    block_m: int                 # BLOCK_M, rows per tile (power of 2)
    block_h: int                 # BLOCK_H, columns per tile: next_pow2(H), the whole row
    num_warps: int
    programs: Optional[int]      # grid size; None: the backward's occupancy grid, resolved by the launcher
    prefetch: bool               # PREFETCH, load the next tile of a persistent loop before reducing this one


LAUNCH_CONFIGS = {"fwd": LaunchConfig, "bwd": LaunchConfig}


def launch_config(kind: str, n_rows: int, H: int, device) -> LaunchConfig:
    """Launch parameters for ``kind`` in ("fwd", "bwd") on ``device`` (torch.device or _common.Target).

    BLOCK_H = next_pow2(H) (whole row in registers; loads vectorise to 16 bytes when H is a multiple of 8 for
    bf16), tiles of ~4096 elements (at most 64 rows). Forward: one tile per program. Backward: persistent (grid
    resolved by the launcher, ``_bwd_programs``); up to 1024 columns 4 warps, up to 2048 8, both with register
    prefetch; wider rows ~8 elements per thread (64 registers), prefetch while a thread holds at most 8 elements.
    Interpreter: 16384-element tiles, at most 4 programs, 4 warps.
    """
    if kind not in LAUNCH_CONFIGS:
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    return _common.apply_override(__name__, kind, _base_config(kind, int(n_rows), int(H), device.type == "cuda"))


@functools.lru_cache(maxsize=1024)
def _base_config(kind: str, n_rows: int, H: int, cuda: bool) -> LaunchConfig:
    """launch_config before overrides; cached (a decode step asks for the same shape every layer)."""
    block_h = max(16, _common.next_pow2(H))
    n_rows = max(n_rows, 1)
    if not cuda:
        block_m = min(64, max(1, 16384 // block_h), _common.next_pow2(n_rows))
        cfg = LaunchConfig(block_m, block_h, 4, min(_common.cdiv(n_rows, block_m), 4), True)
    else:
        block_m = min(64, max(1, 4096 // block_h), _common.next_pow2(n_rows))
        if kind == "fwd":
            cfg = LaunchConfig(block_m, block_h, _common.num_warps_for(block_m * block_h),
                               _common.cdiv(n_rows, block_m), False)
        elif block_h <= 2048:
            # Measured on the H200 (docs/benchmarks/rms_lab_h200.md): at 1024-2048 columns 4 / 8 warps with
            # register prefetch beat 16 warps by 7-30% at 1k-16k rows.
            cfg = LaunchConfig(block_m, block_h, 4 if block_h <= 1024 else 8, None, True)
        else:
            num_warps = min(32, max(4, _common.next_pow2(block_m * block_h // (32 * 8))))
            cfg = LaunchConfig(block_m, block_h, num_warps, None, block_m * block_h <= 32 * num_warps * 8)
    return cfg


_OCCUPANCY: dict = {}
_OCCUPANCY_ERROR: Optional[BaseException] = None  # last failure to read the register count (tests check it)


def _programs_by_occupancy(kernel, args, kwargs, num_warps: int, tiles: int, device: torch.device) -> int:
    """#SMs * (programs of this compiled kernel that fit on one SM), capped; cached per specialisation."""
    global _OCCUPANCY_ERROR
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, num_warps, tuple(sorted(kwargs.items())),
           tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        per_sm = BWD_FALLBACK_PROGRAMS_PER_SM
        try:
            compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **kwargs)
            compiled._init_handles()  # loads the binary, which fills n_regs
            props = torch.cuda.get_device_properties(index)
            regs_sm = getattr(props, "regs_per_multiprocessor", 65536) or 65536
            threads_sm = getattr(props, "max_threads_per_multi_processor", 2048) or 2048
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 0
            regs_warp = _common.cdiv(int(compiled.n_regs) * 32, 256) * 256  # allocation granularity
            by_regs = regs_sm // max(1, regs_warp * num_warps)
            by_threads = threads_sm // (32 * num_warps)
            shared = int(getattr(compiled.metadata, "shared", 0) or 0)
            by_smem = smem_sm // shared if (shared and smem_sm) else by_threads
            per_sm = max(1, min(by_regs, by_threads, by_smem, BWD_MAX_PROGRAMS_PER_SM))
        except Exception as err:  # noqa: BLE001 (Triton internals differ across versions: keep the fallback)
            _OCCUPANCY_ERROR = err
        _OCCUPANCY[key] = per_sm
    return min(tiles, _common.sm_count(index) * per_sm)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
# Rows are addressed through two leading strides so that views like x.transpose(0, 1) (last dim contiguous) run
# without a copy: row r lives at (r // n_inner) * s_outer + (r % n_inner) * s_inner. Outputs are contiguous.
# Persistent loops optionally double-buffer in registers (PREFETCH): the next tile's loads are issued before the
# current tile's reduction, so their latency overlaps with compute and the barrier of the cross-warp sum.

@triton.jit
def _tile_rows(tile, n_rows, n_inner, s_outer, s_inner, BLOCK_M: tl.constexpr):
    """Rows of a tile -> (rows [BLOCK_M] int32, row mask, int64 element offsets of the row starts)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    outer = rows // n_inner
    inner = rows - outer * n_inner
    offs = outer.to(tl.int64) * s_outer + inner.to(tl.int64) * s_inner
    return rows, rows < n_rows, offs


@triton.jit
def _load_tile(PTR, tile, n_rows, n_inner, s_outer, s_inner, cols, col_mask, BLOCK_M: tl.constexpr):
    """[BLOCK_M, BLOCK_H] tile in the pointer's dtype (zeros outside the problem)."""
    _, row_mask, offs = _tile_rows(tile, n_rows, n_inner, s_outer, s_inner, BLOCK_M)
    return tl.load(PTR + offs[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit(do_not_specialize=["n_rows", "n_inner"])
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD,
    n_rows, n_inner, H,
    sx_outer, sx_inner, sr_outer, sr_inner,
    eps, offset, inv_h,
    HAS_W: tl.constexpr, HAS_RES: tl.constexpr, STORE_RSTD: tl.constexpr, CASTING: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    if HAS_W:
        scale = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        if CASTING == 0:
            # HF llama: offset + weight is a tensor op in weight's dtype, so it is rounded there.
            scale = scale.to(W.dtype.element_ty).to(tl.float32)
    if PREFETCH:
        x_next = _load_tile(X, pid, n_rows, n_inner, sx_outer, sx_inner, cols, col_mask, BLOCK_M)
        if HAS_RES:
            r_next = _load_tile(R, pid, n_rows, n_inner, sr_outer, sr_inner, cols, col_mask, BLOCK_M)
    for tile in range(pid, n_tiles, n_prog):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        if PREFETCH:
            x = x_next
            x_next = _load_tile(X, tile + n_prog, n_rows, n_inner, sx_outer, sx_inner, cols, col_mask, BLOCK_M)
            if HAS_RES:
                r = r_next
                r_next = _load_tile(R, tile + n_prog, n_rows, n_inner, sr_outer, sr_inner, cols, col_mask, BLOCK_M)
        else:
            x = _load_tile(X, tile, n_rows, n_inner, sx_outer, sx_inner, cols, col_mask, BLOCK_M)
            if HAS_RES:
                r = _load_tile(R, tile, n_rows, n_inner, sr_outer, sr_inner, cols, col_mask, BLOCK_M)
        x = x.to(tl.float32)
        out_offs = (rows.to(tl.int64) * H)[:, None] + cols[None, :]
        if HAS_RES:
            # HF adds residual + hidden in x's dtype: round the sum before normalising it.
            s = (x + r.to(tl.float32)).to(S.dtype.element_ty)
            tl.store(S + out_offs, s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) * inv_h + eps)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)
        xhat = x * rstd[:, None]
        if CASTING == 0:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        if HAS_W:
            y = xhat * scale[None, :]
        else:
            y = xhat
        tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=mask)


# Backward building blocks of the persistent kernel below.

@triton.jit
def _bwd_scale(W, cols, col_mask, offset, HAS_W: tl.constexpr, CASTING: tl.constexpr):
    """fp32 [BLOCK_H] scale = offset + weight (rounded to weight's dtype for llama, as HF); unused without W."""
    if HAS_W:
        scale = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        if CASTING == 0:
            scale = scale.to(W.dtype.element_ty).to(tl.float32)
    else:
        scale = cols.to(tl.float32)  # placeholder, never read
    return scale


@triton.jit
def _bwd_load(X, DY, DS, RSTD, tile, n_rows, n_inner, sx_outer, sx_inner, sdy_outer, sdy_inner, sds_outer,
              sds_inner, cols, col_mask, HAS_DS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Raw (x, dy, ds, rstd) of a tile; rows >= n_rows read as zeros. ds is dy (not loaded again) without DS."""
    x = _load_tile(X, tile, n_rows, n_inner, sx_outer, sx_inner, cols, col_mask, BLOCK_M)
    dy = _load_tile(DY, tile, n_rows, n_inner, sdy_outer, sdy_inner, cols, col_mask, BLOCK_M)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
    if HAS_DS:
        ds = _load_tile(DS, tile, n_rows, n_inner, sds_outer, sds_inner, cols, col_mask, BLOCK_M)
    else:
        ds = dy
    return x, dy, ds, rstd


@triton.jit
def _bwd_tile(X, DX, x, dy, ds, rstd, scale, acc, tile, n_rows, H, cols, col_mask, inv_h,
              HAS_W: tl.constexpr, HAS_DS: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
              CASTING: tl.constexpr, BLOCK_M: tl.constexpr):
    """Backward of one tile: stores dx (contiguous rows), returns acc + the tile's dW contribution.

    acc is [BLOCK_M, BLOCK_H] (rows summed once at the end, no per-tile shuffles).
    """
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    xhat = x * rstd[:, None]
    if COMPUTE_DW:
        if CASTING == 0:
            part = dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        else:
            part = dy * xhat
        acc += part
    if COMPUTE_DX:
        if HAS_W:
            g = dy * scale[None, :]
        else:
            g = dy
        c = tl.sum(g * xhat, axis=1) * inv_h
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += ds.to(tl.float32)
        tl.store(DX + (rows.to(tl.int64) * H)[:, None] + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    return acc


@triton.jit(do_not_specialize=["n_rows", "n_inner"])
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DS, DX, DW_PART,
    n_rows, n_inner, H,
    sx_outer, sx_inner, sdy_outer, sdy_inner, sds_outer, sds_inner,
    offset, inv_h,
    HAS_W: tl.constexpr, HAS_DS: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Persistent schedule: program p takes tiles p, p + programs, ...; one dW partial row per program."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    scale = _bwd_scale(W, cols, col_mask, offset, HAS_W, CASTING)
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    if PREFETCH:
        x_next, dy_next, ds_next, rstd_next = _bwd_load(
            X, DY, DS, RSTD, pid, n_rows, n_inner, sx_outer, sx_inner, sdy_outer, sdy_inner, sds_outer, sds_inner,
            cols, col_mask, HAS_DS, BLOCK_M)
    for tile in range(pid, n_tiles, n_prog):
        if PREFETCH:
            x, dy, ds, rstd = x_next, dy_next, ds_next, rstd_next
            x_next, dy_next, ds_next, rstd_next = _bwd_load(
                X, DY, DS, RSTD, tile + n_prog, n_rows, n_inner, sx_outer, sx_inner, sdy_outer, sdy_inner,
                sds_outer, sds_inner, cols, col_mask, HAS_DS, BLOCK_M)
        else:
            x, dy, ds, rstd = _bwd_load(
                X, DY, DS, RSTD, tile, n_rows, n_inner, sx_outer, sx_inner, sdy_outer, sdy_inner, sds_outer,
                sds_inner, cols, col_mask, HAS_DS, BLOCK_M)
        acc = _bwd_tile(X, DX, x, dy, ds, rstd, scale, acc, tile, n_rows, H, cols, col_mask, inv_h,
                        HAS_W, HAS_DS, COMPUTE_DX, COMPUTE_DW, CASTING, BLOCK_M)
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * H + cols, tl.sum(acc, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------

def _row_layout(t: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """[..., H] -> (t or a contiguous copy, n_inner, s_outer, s_inner).

    Leading dims are merged where their strides allow; up to two non-mergeable groups are addressed in-kernel,
    more (rare: e.g. a 3-way permuted view) costs one .contiguous() copy.
    """
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    groups = []  # (size, stride), outermost first
    for n, s in zip(t.shape[:-1], t.stride()[:-1]):
        if n == 1:
            continue
        if groups and groups[-1][1] == n * s:
            groups[-1] = (groups[-1][0] * n, s)
        else:
            groups.append((n, s))
    if not groups:
        return t, 1, 0, 0
    if len(groups) == 1:
        return t, groups[0][0], 0, groups[0][1]
    if len(groups) == 2:
        return t, groups[1][0], groups[0][1], groups[1][1]
    t = t.contiguous()
    return t, max(1, t.numel() // max(1, t.shape[-1])), 0, t.shape[-1]


def _same_grouping(*tensors: Optional[torch.Tensor]) -> list:
    """Row layouts for tensors that share a shape; if their n_inner differ, all become plain row-major."""
    layouts = [None if t is None else _row_layout(t) for t in tensors]
    inners = {lay[1] for lay in layouts if lay is not None}
    if len(inners) > 1:
        layouts = [None if t is None else _row_layout(t.contiguous()) for t in tensors]
    return layouts


def _out_dtype(x_dtype: torch.dtype, w_dtype: Optional[torch.dtype], casting: int) -> torch.dtype:
    if casting == 0 and w_dtype is not None:
        return torch.promote_types(w_dtype, x_dtype)
    return x_dtype


_FWD = _launch.FastLaunch(_rms_norm_fwd_kernel)
_BWD = _launch.FastLaunch(_rms_norm_bwd_kernel)


def _rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], residual: Optional[torch.Tensor], eps: float,
                  offset: float, casting: int, store_rstd: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [..., H]; weight: [H] or None -> (y [..., H], s [..., H] or [0], rstd [rows] fp32 or [0])."""
    H = x.shape[-1]
    n_rows = x.numel() // H
    y_dtype = _out_dtype(x.dtype, None if weight is None else weight.dtype, casting)
    contiguous = x.is_contiguous()
    if contiguous:   # empty_like: ~2 us less host time than empty(shape, dtype=, device=)
        y = _common.new_empty_like(x, y_dtype)
        s = _common.new_empty_like(x) if residual is not None else x.new_empty(0)
    else:
        y = _common.new_empty(x.shape, dtype=y_dtype, device=x.device)
        s = _common.new_empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x.new_empty(0)
    rstd = (_common.new_empty((n_rows,), dtype=torch.float32, device=x.device) if store_rstd
            else x.new_empty(0, dtype=torch.float32))
    if n_rows == 0:
        return y, s, rstd
    if contiguous and (residual is None or residual.is_contiguous()):   # without the stride walk
        n_inner, sx_o, sx_i = (n_rows, 0, H) if n_rows > 1 else (1, 0, 0)
        sr_o, sr_i = sx_o, sx_i
    else:
        (x, n_inner, sx_o, sx_i), lay_r = _same_grouping(x, residual)
        residual, _, sr_o, sr_i = lay_r if lay_r is not None else (None, 0, 0, 0)
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    cfg = launch_config("fwd", n_rows, H, x.device)
    _FWD.launch(
        (cfg.programs,),
        x, residual if residual is not None else x, weight if weight is not None else x, y,
        s if residual is not None else y, rstd if store_rstd else y,
        n_rows, n_inner, H, sx_o, sx_i, sr_o, sr_i, float(eps), float(offset), 1.0 / H,
        HAS_W=weight is not None, HAS_RES=residual is not None, STORE_RSTD=store_rstd, CASTING=casting,
        PREFETCH=cfg.prefetch, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps)
    return y, s, rstd


def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                  ds: Optional[torch.Tensor], offset: float, casting: int, need_dx: bool,
                  need_dw: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """dy: [..., H] (y's grad), x: [..., H] the normalised input (s when fused), rstd: [rows] fp32,
    ds: [..., H] grad of s or None -> (dx [..., H] in x.dtype or [0], dW [H] in weight.dtype or [0])."""
    H = x.shape[-1]
    n_rows = x.numel() // H
    need_dw = need_dw and weight is not None
    dx = _common.new_empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else x.new_empty(0)
    if n_rows == 0 or not (need_dx or need_dw):
        dw = torch.zeros_like(weight) if need_dw else x.new_empty(0)
        return dx, dw
    ds = ds if need_dx else None
    (x, n_inner, sx_o, sx_i), (dy, _, sdy_o, sdy_i), lay_ds = _same_grouping(x, dy, ds)
    ds, _, sds_o, sds_i = lay_ds if lay_ds is not None else (None, 0, 0, 0)
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    cfg = launch_config("bwd", n_rows, H, x.device)
    args = (dy, x, weight if weight is not None else x, rstd, ds if ds is not None else dy,
            dx if need_dx else x, None,
            n_rows, n_inner, H, sx_o, sx_i, sdy_o, sdy_i, sds_o, sds_i, float(offset), 1.0 / H)
    kwargs = dict(HAS_W=weight is not None, HAS_DS=ds is not None, COMPUTE_DX=need_dx, COMPUTE_DW=need_dw,
                  CASTING=casting, PREFETCH=cfg.prefetch, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h)
    programs = cfg.programs
    if programs is None:
        tiles = _common.cdiv(n_rows, cfg.block_m)
        probe = args[:6] + (rstd,) + args[7:]  # any fp32 buffer stands in for the dW partials while compiling
        programs = _bwd_programs(
            _programs_by_occupancy(_rms_norm_bwd_kernel, probe, kwargs, cfg.num_warps, tiles, x.device), tiles,
            x.device)
    dw_part = _common.new_empty((programs, H), dtype=torch.float32, device=x.device) if need_dw else rstd
    _BWD.launch((programs,), *args[:6], dw_part, *args[7:], num_warps=cfg.num_warps, **kwargs)
    if need_dw:
        dw = _common.new_empty((H,), dtype=weight.dtype, device=x.device)
        _reduce.column_sums(dw_part, dw)
    else:
        dw = x.new_empty(0)
    return dx, dw


def _bwd_programs(by_occupancy: int, tiles: int, device: torch.device) -> int:
    """Backward grid: at least ~4 tiles per program (fewer dW partial rows to write and sum; prefetch overlaps a
    program's tiles) but never fewer programs than SMs, and at most what fits (``by_occupancy``). Measured on the
    H200 (docs/benchmarks/rms_lab_h200.md): 1024 rows x 1024 best at 128 programs of 256 tiles (18.3 against
    19.8 µs at 256 programs), 4096 x 1024 at 256 of 1024 tiles, 16384 x 1024 at 1024 of 4096."""
    return max(1, min(by_occupancy, max(_common.target(device).sm_count, _common.cdiv(tiles, 4))))


# torch.compile: the launchers as opaque custom ops (no graph break); eager calls bypass the dispatcher.
@torch.library.custom_op("swift_liger::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], residual: Optional[torch.Tensor], eps: float,
                     offset: float, casting: int, store_rstd: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rms_norm_fwd(x, weight, residual, eps, offset, casting, store_rstd)


@_rms_norm_fwd_op.register_fake
def _(x, weight, residual, eps, offset, casting, store_rstd):
    H = x.shape[-1]
    y = x.new_empty(x.shape, dtype=_out_dtype(x.dtype, None if weight is None else weight.dtype, casting))
    s = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    rstd = x.new_empty((x.numel() // H,) if store_rstd else (0,), dtype=torch.float32)
    return y, s, rstd


@torch.library.custom_op("swift_liger::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                     ds: Optional[torch.Tensor], offset: float, casting: int, need_dx: bool,
                     need_dw: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_bwd(dy, x, weight, rstd, ds, offset, casting, need_dx, need_dw)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, ds, offset, casting, need_dx, need_dw):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if (need_dw and weight is not None) else x.new_empty(0)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """apply(x, weight, residual, eps, offset, casting_code) -> y, or (y, s) when residual is given.

    x, residual: [..., H]; weight: [H] or None; casting_code: 0 llama, 1 gemma, 2 none. Saves (x or s) and rstd
    [rows] fp32; backward recomputes xhat from them. Use `rms_norm` (validates arguments) rather than this.
    """

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset, casting):
        need = ctx.needs_input_grad
        store_rstd = bool(need[0] or need[1] or need[2])
        fwd = _common.compiled_or_eager("swift_liger::rms_norm_fwd", _rms_norm_fwd)
        y, s, rstd = fwd(x, weight, residual, eps, offset, casting, store_rstd)
        ctx.has_res = residual is not None
        ctx.offset, ctx.casting = offset, casting
        ctx.save_for_backward(s if ctx.has_res else x, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused y or s arrives as None: no zero tensor is built and read
        if ctx.has_res:
            return y, s
        return y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_dx = bool(need[0] or need[2])
        need_dw = bool(need[1]) and weight is not None
        if dy is None:  # only s was used: its gradient passes straight through; weight gets none (as in HF)
            return (ds if need[0] else None, None, ds if need[2] else None, None, None, None)
        bwd = _common.compiled_or_eager("swift_liger::rms_norm_bwd", _rms_norm_bwd)
        dx, dw = bwd(dy, x, weight, rstd, ds if ctx.has_res else None, ctx.offset, ctx.casting, need_dx, need_dw)
        return (dx if need[0] else None, dw if need_dw else None, dx if need[2] else None, None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def _validate(x, weight, eps, offset, casting, residual, dtypes=_common.FLOAT_DTYPES) -> None:
    if (residual is None and isinstance(x, torch.Tensor) and x.dtype in dtypes and x.dim() >= 1 and x.shape[-1] > 0
            and (x.stride(-1) == 1 or x.shape[-1] == 1) and type(eps) is float and eps > 0
            and type(offset) is float and casting in CASTING_MODES
            and (weight is None or (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype in dtypes
                                    and weight.shape[0] == x.shape[-1] and weight.device == x.device))):
        return   # the common call, accepted in one expression (host time per layer); anything else is checked below
    _common.check_tensor("x", x, min_ndim=1, dtypes=dtypes)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    _common.check_last_dim_contiguous("x", x)
    H = x.shape[-1]
    if weight is not None:
        _common.check_tensor("weight", weight, ndim=1, dtypes=dtypes)
        if weight.shape[0] != H:
            raise ValueError(f"weight must have shape ({H},) to match x's last dimension, got {tuple(weight.shape)}")
    if residual is not None:
        _common.check_tensor("residual", residual, dtypes=dtypes)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        _common.check_same_dtype(x=x, residual=residual)
        _common.check_last_dim_contiguous("residual", residual)
    _common.check_same_device(x=x, weight=weight, residual=residual)
    if isinstance(eps, bool):
        raise ValueError(f"eps must be a number > 0, got {eps!r}")
    _common.check_positive("eps", eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {', '.join(CASTING_MODES)}; got {casting!r}")


_Out = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def rms_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *,
                       offset: float = 0.0, casting: str = "llama", residual: Optional[torch.Tensor] = None) -> _Out:
    """PyTorch RMSNorm computed the way Hugging Face eager modules do (same signature/semantics as `rms_norm`).

    Also the CPU fallback and the "eager" peer in benchmarks. float64 inputs are accepted (computed in float64,
    for test references); otherwise the statistics are computed in fp32 exactly like HF.
    """
    _validate(x, weight, eps, offset, casting, residual, dtypes=_common.FLOAT_DTYPES + (torch.float64,))
    s = None
    if residual is not None:
        x = residual + x  # HF: hidden_states = residual + hidden_states, in x's dtype
        s = x
    input_dtype = x.dtype
    compute = torch.promote_types(input_dtype, torch.float32)
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        out = h.to(input_dtype)
        if weight is not None:
            out = (weight + offset if offset else weight) * out
    else:
        if weight is not None:
            out = h * (offset + weight.to(compute))
        else:
            out = h
        out = out.to(input_dtype)
    return (out, s) if residual is not None else out


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting: str = "llama", residual: Optional[torch.Tensor] = None) -> _Out:
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    x:        [..., H] fp32/fp16/bf16; last dim contiguous, leading strides arbitrary (transposed views run
              without a copy; three or more non-mergeable leading stride groups are copied once).
    weight:   [H] or None (None: no scale, ``offset`` is ignored).
    eps:      > 0, added to mean(x^2).
    offset:   scale = offset + weight (Gemma: 1.0).
    casting:  "llama" | "gemma" | "none" (see module docstring); output dtype is promote(weight, x) for "llama"
              with a weight, else x.dtype.
    residual: [..., H], x's shape and dtype, or None. When given, s = x + residual (rounded to x.dtype as HF's
              ``residual + hidden_states``) is normalised and ``(y, s)`` is returned; gradients reaching s from
              both y and s flow to x and residual.
    Returns y [..., H], or (y, s).
    """
    _validate(x, weight, eps, offset, casting, residual)
    if x.shape[-1] > MAX_FUSED_H or not _common.use_triton(x):
        return rms_norm_reference(x, weight, eps, offset=offset, casting=casting, residual=residual)
    if not _common.records_grad(x, weight, residual):
        y, s, _ = _common.compiled_or_eager("swift_liger::rms_norm_fwd", _rms_norm_fwd)(
            x, weight, residual, float(eps), float(offset), _CASTING_CODE[casting], False)
        return (y, s) if residual is not None else y
    return RMSNormFunction.apply(x, weight, residual, float(eps), float(offset), _CASTING_CODE[casting])
