"""RMSNorm kernels vs a float64 HF-style reference: forward, every gradient, layouts, dtypes, errors, compile."""

import pytest
import torch

from helpers import DTYPES, REDUCTION_SLACK, assert_close, f64, inputs_unchanged, randn

from swift_liger.ops import rms_norm_kernel as rms_mod
from swift_liger.ops._common import launch_override
RMSNormFunction, rms_norm, rms_norm_reference = rms_mod.RMSNormFunction, rms_mod.rms_norm, rms_mod.rms_norm_reference

CASTINGS = ["llama", "gemma", "none"]


def _run(x, w, r, *, eps=1e-6, offset=0.0, casting="llama", dy=None, ds=None):
    """Kernel forward + backward; returns (y, s, dy, ds) with grads left on the leaves."""
    with inputs_unchanged(*[t for t in (x, w, r) if t is not None]):
        out = rms_norm(x, w, eps, offset=offset, casting=casting, residual=r)
        y, s = out if r is not None else (out, None)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, r)):
            dy = randn(*y.shape, dtype=y.dtype, device=y.device) if dy is None else dy
            loss = (y.float() * dy.float()).sum()
            if s is not None:
                ds = randn(*s.shape, dtype=s.dtype, device=s.device) if ds is None else ds
                loss = loss + (s.float() * ds.float()).sum()
            loss.backward()
    return y, s, dy, ds


def _check(x, w, r, y, s, dy, ds, *, eps=1e-6, offset=0.0, casting="llama"):
    """Compare kernel outputs/grads with the float64 reference on the same (rounded) input values."""
    xr, wr, rr = f64(x), (f64(w) if w is not None else None), (f64(r) if r is not None else None)
    out = rms_norm_reference(xr, wr, eps, offset=offset, casting=casting, residual=rr)
    ye, se = out if r is not None else (out, None)
    # Output dtype follows HF: the reference run in the input dtypes decides it.
    out_lp = rms_norm_reference(x.detach(), None if w is None else w.detach(), eps, offset=offset, casting=casting,
                                residual=None if r is None else r.detach())
    y_lp = out_lp[0] if r is not None else out_lp
    assert y.dtype == y_lp.dtype, f"y dtype {y.dtype} != HF dtype {y_lp.dtype}"
    assert y.shape == x.shape
    dt = x.dtype
    assert_close(y, ye, dt, name="y")
    if r is not None:
        assert s.dtype == x.dtype
        assert_close(s, se, dt, name="s")
    leaves = [t for t in (xr, wr, rr) if t is not None and t.requires_grad]
    if not leaves:
        return
    loss = (ye * dy.detach().to("cpu", torch.float64)).sum()
    if r is not None:
        loss = loss + (se * ds.detach().to("cpu", torch.float64)).sum()
    loss.backward()
    for name, t, te in (("dx", x, xr), ("dweight", w, wr), ("dresidual", r, rr)):
        if t is None:
            continue
        if not t.requires_grad:
            assert t.grad is None
            continue
        assert t.grad is not None, f"{name} missing"
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        slack = REDUCTION_SLACK if name == "dweight" else 1.0
        # Tolerance of the activation dtype: every gradient involves x-dtype-rounded values.
        assert_close(t.grad, te.grad, dt, slack=slack, name=name)


def _inputs(shape, dtype, device, *, weight=True, residual=False, w_dtype=None, requires_grad=True):
    H = shape[-1]
    x = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)
    w = None
    if weight:
        w = (torch.randn(H) * 0.5 + 1.0).to(device=device, dtype=w_dtype or dtype).requires_grad_(requires_grad)
    r = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad) if residual else None
    return x, w, r


@pytest.mark.parametrize("H", [96, 127, 320])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", CASTINGS)
def test_forward_backward(device, H, dtype, casting):
    for offset, residual in ((0.0, False), (1.0, False), (0.0, True), (1.0, True)):
        x, w, r = _inputs((3, 7, H), dtype, device, residual=residual)
        y, s, dy, ds = _run(x, w, r, offset=offset, casting=casting)
        _check(x, w, r, y, s, dy, ds, offset=offset, casting=casting)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("residual", [False, True])
def test_weight_none(device, dtype, casting, residual):
    x, w, r = _inputs((3, 7, 127), dtype, device, weight=False, residual=residual)
    y, s, dy, ds = _run(x, None, r, offset=1.0, casting=casting)  # offset is ignored without a weight
    _check(x, None, r, y, s, dy, ds, offset=1.0, casting=casting)


@pytest.mark.parametrize("block_m", [1, 4, None])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_many_programs_and_tails(device, block_m, residual, prefetch):
    """69 rows over several persistent programs and partial tiles (dW partials from uneven programs)."""
    forced = dict(prefetch=prefetch) if block_m is None else dict(prefetch=prefetch, block_m=block_m, programs=4)
    with launch_override(rms_mod, "fwd", **forced), launch_override(rms_mod, "bwd", **forced):
        x, w, r = _inputs((3, 23, 96), torch.float32, device, residual=residual)
        y, s, dy, ds = _run(x, w, r, offset=0.5)
        _check(x, w, r, y, s, dy, ds, offset=0.5)


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_mixed_weight_dtype(device, casting):
    """bf16 activations with an fp32 weight: llama promotes the output to fp32 (as HF does), gemma keeps bf16."""
    x, w, r = _inputs((3, 7, 96), torch.bfloat16, device, w_dtype=torch.float32, residual=True)
    y, s, dy, ds = _run(x, w, r, casting=casting)
    assert y.dtype == (torch.float32 if casting == "llama" else torch.bfloat16)
    _check(x, w, r, y, s, dy, ds, casting=casting)


def _view(kind, device, dtype, H):
    """A leaf tensor with the strides of a view: grads then land on it with its own shape."""
    if kind == "transposed":    # (3, 7, H): two leading stride groups, addressed in-kernel without a copy
        v = randn(7, 3, H, dtype=dtype, device=device).transpose(0, 1)
    elif kind == "sliced":      # (21, H) with row stride 2H (e.g. a slice of a fused projection)
        v = randn(21, 2 * H, dtype=dtype, device=device)[:, :H]
    elif kind == "permuted3":   # (5, 3, 2, H): three non-mergeable stride groups -> one copy
        v = randn(2, 3, 5, H, dtype=dtype, device=device).permute(2, 1, 0, 3)
    else:                       # a single row
        v = randn(H, dtype=dtype, device=device)
    return v.detach().requires_grad_(True)


@pytest.mark.parametrize("kind", ["transposed", "sliced", "permuted3", "1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, kind, dtype):
    H = 127
    xv = _view(kind, device, dtype, H)
    # A contiguous residual (layout differs from x) and a contiguous dy.
    r = randn(*xv.shape, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(H) * 0.5 + 1.0).to(device=device, dtype=dtype).requires_grad_(True)
    y, s, dy, ds = _run(xv, w, r, casting="gemma", offset=1.0)
    _check(xv, w, r, y, s, dy, ds, casting="gemma", offset=1.0)
    # Residual with x's own (strided) layout.
    xv.grad = w.grad = None
    r2 = _view(kind, device, dtype, H)
    y, s, dy, ds = _run(xv, w, r2)
    _check(xv, w, r2, y, s, dy, ds)
    # Same view without residual, y.sum() backward: dy is an expanded tensor (all strides 0).
    xv.grad = w.grad = None
    with inputs_unchanged(xv, w):
        y = rms_norm(xv, w)
        y.float().sum().backward()
    xr, wr = f64(xv), f64(w)
    rms_norm_reference(xr, wr).sum().backward()
    assert_close(xv.grad, xr.grad, dtype, name="dx (expanded dy)")
    assert_close(w.grad, wr.grad, dtype, slack=REDUCTION_SLACK, name="dweight (expanded dy)")


def test_row_layout_avoids_copies():
    """Two leading stride groups are addressed in-kernel (same storage); three fall back to one copy."""
    for kind, copied in (("transposed", False), ("sliced", False), ("1d", False), ("permuted3", True)):
        v = _view(kind, "cpu", torch.float32, 16)
        t, n_inner, s_outer, s_inner = rms_mod._row_layout(v)
        assert (t.data_ptr() != v.data_ptr()) == copied, kind
        rows = v.numel() // 16
        flat = v.reshape(rows, 16)
        base = t.detach().as_strided((t.untyped_storage().nbytes() // 4,), (1,), 0)
        for row in range(rows):  # the kernel's addressing reproduces every row
            start = t.storage_offset() + (row // n_inner) * s_outer + (row % n_inner) * s_inner
            assert torch.equal(base[start:start + 16], flat[row].detach()), (kind, row)


def test_transposed_dy(device):
    """Upstream gradient given as a non-contiguous (transposed leading dims) view."""
    x, w, r = _inputs((3, 7, 96), torch.float32, device)
    dy = randn(7, 3, 96, device=device).transpose(0, 1)
    y, s, dy, ds = _run(x, w, None, dy=dy)
    _check(x, w, None, y, s, dy, ds)


@pytest.mark.parametrize("which", ["x", "weight", "residual", "none"])
def test_partial_requires_grad(device, which):
    x, w, r = _inputs((3, 7, 96), torch.bfloat16, device, residual=True, requires_grad=False)
    for name, t in (("x", x), ("weight", w), ("residual", r)):
        t.requires_grad_(name == which)
    y, s, dy, ds = _run(x, w, r, casting="llama")
    assert y.requires_grad == (which != "none")
    _check(x, w, r, y, s, dy, ds, casting="llama")


def test_no_grad_inference(device):
    x, w, r = _inputs((3, 7, 320), torch.float16, device, residual=True)
    with torch.no_grad():
        y, s, _, _ = _run(x, w, r)
    assert not y.requires_grad
    _check(x.detach(), w.detach(), r.detach(), y, s, None, None)


def test_empty_rows(device):
    x = randn(0, 96, device=device, requires_grad=True)
    w = randn(96, device=device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 96)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert x.grad.shape == (0, 96)


@pytest.mark.parametrize("used", ["y", "s"])
def test_only_one_output_used(device, used):
    """An unused output reaches backward as None (no materialised zeros): the other still gets exact grads."""
    x, w, r = _inputs((3, 7, 96), torch.float32, device, residual=True)
    y, s = rms_norm(x, w, residual=r)
    ((y if used == "y" else s) * 1.5).sum().backward()
    xr, wr, rr = f64(x), f64(w), f64(r)
    ye, se = rms_norm_reference(xr, wr, residual=rr)
    ((ye if used == "y" else se) * 1.5).sum().backward()
    for name, t, te in (("dx", x, xr), ("dweight", w, wr), ("dresidual", r, rr)):
        if te.grad is None:  # s does not depend on the weight
            assert t.grad is None, name
            continue
        assert_close(t.grad, te.grad, torch.float32, slack=REDUCTION_SLACK, name=name)


def test_residual_grads_not_aliased(device):
    """x and residual receive the same gradient values, but as independent tensors."""
    x, w, r = _inputs((3, 7, 96), torch.float32, device, residual=True)
    y, s = rms_norm(x, w, residual=r)
    (y.sum() + 2 * s.sum()).backward()
    assert torch.equal(x.grad, r.grad)
    x.grad.add_(1.0)
    assert not torch.equal(x.grad, r.grad)


def test_matches_hf_modules(device):
    """Same-dtype comparison with the HF-eager formulas (the reference run in bf16)."""
    x, w, r = _inputs((3, 7, 320), torch.bfloat16, device, residual=True, requires_grad=False)
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        y, s = rms_norm(x, w, 1e-5, offset=offset, casting=casting, residual=r)
        ye, se = rms_norm_reference(x, w, 1e-5, offset=offset, casting=casting, residual=r)
        # Compiled kernels round to nearest like torch; interpreter casts truncate: allow 1-2 bf16 ulps there.
        if device.type == "cuda":
            assert torch.equal(s, se)
        torch.testing.assert_close(s.float(), se.float(), atol=0, rtol=2 ** -7)
        # y: sum order may flip one rounding (1 ulp) on GPU; up to three truncations stack in the interpreter.
        ulps = 2 if device.type == "cuda" else 3
        torch.testing.assert_close(y.float(), ye.float(), atol=1e-6, rtol=ulps * 2 ** -7)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------

def _bad_cases(device):
    x = randn(3, 7, 96, device=device)
    w = randn(96, device=device)
    return [
        ("x 0-d", lambda: rms_norm(torch.tensor(1.0, device=device)), ValueError, "x"),
        ("x not tensor", lambda: rms_norm([1.0, 2.0]), TypeError, "x"),
        ("x int", lambda: rms_norm(torch.ones(3, 96, dtype=torch.int64, device=device)), TypeError, "x"),
        ("x empty H", lambda: rms_norm(randn(3, 0, device=device)), ValueError, "x"),
        ("weight shape", lambda: rms_norm(x, randn(95, device=device)), ValueError, "weight"),
        ("weight 2-d", lambda: rms_norm(x, randn(1, 96, device=device)), ValueError, "weight"),
        ("residual dtype", lambda: rms_norm(x, w, residual=x.to(torch.bfloat16)), TypeError, "residual"),
        ("residual shape", lambda: rms_norm(x, w, residual=x[:, :6]), ValueError, "residual"),
        ("x last stride", lambda: rms_norm(randn(96, 3, 7, device=device).permute(1, 2, 0), w), ValueError, "x"),
        ("residual last stride", lambda: rms_norm(x, w, residual=randn(3, 96, 7, device=device).transpose(1, 2)),
         ValueError, "residual"),
        ("eps 0", lambda: rms_norm(x, w, 0.0), ValueError, "eps"),
        ("eps negative", lambda: rms_norm(x, w, -1e-6), ValueError, "eps"),
        ("casting", lambda: rms_norm(x, w, casting="fp32"), ValueError, "casting"),
        ("offset", lambda: rms_norm(x, w, offset="1"), TypeError, "offset"),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_inputs(device, case):
    name, fn, exc, arg = _bad_cases(device)[case]
    with pytest.raises(exc, match=arg):
        fn()


def test_bad_inputs_reference_too():
    x = randn(3, 96)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_reference(x, randn(96), 0.0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_reference(x, randn(95))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a CPU/CUDA mix")
def test_device_mix():
    x = randn(3, 96, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(96))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, randn(96, device="cuda"), residual=randn(3, 96))


# ---------------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------------

def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def layer(x, w, r):
        y, s = rms_norm(x, w, 1e-6, offset=1.0, casting="gemma", residual=r)
        return rms_norm(y * 2.0, w) + s

    x, w, r = _inputs((3, 7, 96), torch.float32, device, residual=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out_c = compiled(x, w, r)
    out_c.sum().backward()
    grads_c = [t.grad.clone() for t in (x, w, r)]
    for t in (x, w, r):
        t.grad = None
    out_e = layer(x, w, r)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e)
    for gc, t in zip(grads_c, (x, w, r)):
        torch.testing.assert_close(gc, t.grad)


def test_custom_ops_opcheck(device):
    """Schema, fake-tensor and AOT-dispatch checks of the registered launchers."""
    x, w, r = _inputs((3, 7, 96), torch.bfloat16, device, residual=True, requires_grad=False)
    torch.library.opcheck(torch.ops.swift_liger.rms_norm_fwd.default, (x, w, r, 1e-6, 1.0, 1, True))
    torch.library.opcheck(torch.ops.swift_liger.rms_norm_fwd.default, (x, None, None, 1e-6, 0.0, 0, False))
    _, s, rstd = torch.ops.swift_liger.rms_norm_fwd(x, w, r, 1e-6, 0.0, 0, True)
    dy = randn(3, 7, 96, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.swift_liger.rms_norm_bwd.default, (dy, s, w, rstd, dy, 0.0, 0, True, True))
    torch.library.opcheck(torch.ops.swift_liger.rms_norm_bwd.default, (dy, s, None, rstd, None, 0.0, 2, True, False))


def test_launch_config_gpu_shapes():
    """The GPU launch rules (no GPU needed): whole row per block, power-of-2 tiles, bounded grids."""
    cuda = torch.device("cuda", 0)
    for H in (96, 127, 320, 2048, 4096, 5120, 8192, 16384):
        for kind in ("fwd", "bwd"):
            cfg = rms_mod.launch_config(kind, 16384, H, cuda)
            assert cfg.block_h >= H and cfg.block_h & (cfg.block_h - 1) == 0
            assert cfg.block_m & (cfg.block_m - 1) == 0 and cfg.num_warps in (4, 8, 16, 32)
            if kind == "fwd":
                assert cfg.programs == -(-16384 // cfg.block_m) and not cfg.prefetch
            else:
                assert cfg.programs is None  # resolved from the compiled kernel's occupancy
    with launch_override(rms_mod, "bwd", programs=396):
        assert rms_mod.launch_config("bwd", 16384, 4096, cuda).programs == 396
    assert rms_mod.launch_config("bwd", 16384, 4096, cuda).programs is None


def test_function_direct(device):
    """RMSNormFunction.apply is the raw autograd Function (codes: 0 llama, 1 gemma, 2 none)."""
    x, w, _ = _inputs((3, 7, 96), torch.float32, device)
    y = RMSNormFunction.apply(x, w, None, 1e-6, 0.0, 0)
    assert_close(y, rms_norm_reference(f64(x), f64(w)), torch.float32, name="y")


# ---------------------------------------------------------------------------------------------------------------
# GPU only: the benchmark hidden size and the tuning knobs (compiled kernels)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [4096, 5120, 8192])
def test_gpu_large_hidden(device, dtype, H):
    if device.type != "cuda":
        pytest.skip("GPU-only shape")
    for casting, residual in (("llama", False), ("gemma", True)):
        x, w, r = _inputs((2, 1031, H), dtype, device, residual=residual)
        y, s, dy, ds = _run(x, w, r, casting=casting, offset=1.0 if casting == "gemma" else 0.0)
        _check(x, w, r, y, s, dy, ds, casting=casting, offset=1.0 if casting == "gemma" else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd,bwd", [
    (dict(block_m=1, num_warps=4), dict(block_m=1, num_warps=16, sms_x=1, prefetch=True)),
    (dict(block_m=4, num_warps=16, sms_x=1, prefetch=True), dict(block_m=2, num_warps=8, sms_x=8, prefetch=False)),
])
def test_gpu_forced_configs(device, fwd, bwd):
    """Forced tiles, warps and grids (programs = sms_x programs per SM) through launch_override."""
    if device.type != "cuda":
        pytest.skip("GPU-only launch configurations")
    sms = rms_mod._common.sm_count(device.index or 0)
    fwd, bwd = dict(fwd), dict(bwd)
    for d in (fwd, bwd):
        if "sms_x" in d:
            d["programs"] = sms * d.pop("sms_x")
    with launch_override(rms_mod, "fwd", **fwd), launch_override(rms_mod, "bwd", **bwd):
        x, w, r = _inputs((3, 333, 4096), torch.bfloat16, device, residual=True)
        y, s, dy, ds = _run(x, w, r)
        _check(x, w, r, y, s, dy, ds)


@pytest.mark.gpu
def test_gpu_occupancy_probe(device):
    """The persistent backward grid comes from the compiled kernel's register count, not the fallback."""
    if device.type != "cuda":
        pytest.skip("GPU-only")
    x, w, _ = _inputs((4096, 4096), torch.bfloat16, device)
    rms_norm(x, w).sum().backward()
    assert rms_mod._OCCUPANCY_ERROR is None, repr(rms_mod._OCCUPANCY_ERROR)
    assert rms_mod._OCCUPANCY and all(1 <= v <= rms_mod.BWD_MAX_PROGRAMS_PER_SM for v in rms_mod._OCCUPANCY.values())
