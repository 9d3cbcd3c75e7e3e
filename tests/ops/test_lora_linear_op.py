"""lora_linear: same values and gradients as the autograd composition (PEFT's maths), fewer saved bytes than
PEFT's fp32-adapter path under autocast."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, f64, inputs_unchanged
from swift_liger.ops.lora_linear_op import lora_linear, lora_linear_reference
from swift_liger.ops import _common, lora_dropout_kernel


def make(n=(3, 5), d_in=24, d_out=40, r=4, dtype=torch.float32, adapter_dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, d_in, generator=g).to(dtype).requires_grad_()
    w = torch.randn(d_out, d_in, generator=g).to(dtype)
    b = torch.randn(d_out, generator=g).to(dtype) if bias else None
    a = (torch.randn(r, d_in, generator=g) * 0.3).to(adapter_dtype).requires_grad_()
    bb = (torch.randn(d_out, r, generator=g) * 0.3).to(adapter_dtype).requires_grad_()
    return x, w, b, a, bb


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("separate_lora_input", [False, True])
def test_matches_float64_reference(bias, separate_lora_input):
    x, w, b, a, bb = make(bias=bias)
    x_lora = (x * 0.5 + 1.0) if separate_lora_input else None      # e.g. dropout(x): its own graph
    dy = torch.randn(3, 5, 40)
    with inputs_unchanged(w, a, bb):
        y = lora_linear(x, x_lora, w, b, a, bb, 2.0)
    y.backward(dy)
    xr, ar, br = f64(x), f64(a), f64(bb)
    x_lora_r = (xr * 0.5 + 1.0) if separate_lora_input else xr
    yr = lora_linear_reference(xr, x_lora_r, f64(w), None if b is None else f64(b), ar, br, 2.0)
    yr.backward(dy.double())
    assert_close(y, yr, torch.float32, name="y")
    for name, got, want in (("dx", x.grad, xr.grad), ("dA", a.grad, ar.grad), ("dB", bb.grad, br.grad)):
        assert_close(got, want, torch.float32, slack=4, name=name)
    assert w.grad is None


def _saved_bytes(fn):
    """Bytes of distinct storages autograd keeps for backward while running fn (parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_autocast_bf16_with_fp32_adapters_matches_peft_and_saves_less():
    """The PEFT set-up: bf16 base, fp32 adapters, bf16 autocast. Same output and gradients as PEFT's
    cast-to-fp32-then-autocast path, and less saved for backward."""
    x, w, b, a, bb = make(dtype=torch.bfloat16, adapter_dtype=torch.float32, bias=False)
    P = torch.nn.Parameter
    w, a, bb = P(w, requires_grad=False), P(a.detach()), P(bb.detach())
    a_peft, b_peft = P(a.detach().clone()), P(bb.detach().clone())
    x_peft = x.detach().clone().requires_grad_()
    dy = torch.randn(3, 5, 40).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ours = _saved_bytes(lambda: lora_linear(x, None, w, None, a, bb, 2.0))

        def peft_forward():   # peft.tuners.lora.Linear.forward, one adapter, no dropout
            result = F.linear(x_peft, w)
            xa = x_peft.to(a_peft.dtype)
            return result + F.linear(F.linear(xa, a_peft), b_peft) * 2.0
        y_peft, theirs = _saved_bytes(peft_forward)
    assert y.dtype == y_peft.dtype == torch.bfloat16
    y.backward(dy), y_peft.backward(dy)
    assert_close(y, y_peft.float(), torch.bfloat16, name="y")
    assert_close(x.grad, x_peft.grad.float(), torch.bfloat16, name="dx")
    assert a.grad.dtype == torch.float32 and bb.grad.dtype == torch.float32
    assert_close(a.grad, a_peft.grad, torch.bfloat16, slack=2, name="dA")
    assert_close(bb.grad, b_peft.grad, torch.bfloat16, slack=2, name="dB")
    assert ours < theirs, (ours, theirs)


def test_bad_inputs():
    x, w, b, a, bb = make()
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, None, w.requires_grad_(), b, a, bb, 1.0)
    x, w, b, a, bb = make()
    with pytest.raises(ValueError, match="lora_b"):
        lora_linear(x, None, w, b, a, bb[:, :2], 1.0)
    with pytest.raises(ValueError, match="x_lora"):
        lora_linear(x, x[..., :3], w, b, a, bb, 1.0)
    x16, w16, b16, _, _ = make(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute in"):   # no autocast, x_lora given: an fp32 branch on bf16
        lora_linear(x16, x16 * 2, w16, b16, a, bb, 1.0)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16 but x has torch.float32"):
        lora_linear(x, None, w.bfloat16(), b, a.detach().bfloat16(), bb.detach().bfloat16(), 1.0)


def drawn_mask(x, a, p, seed):
    """The keep mask lora_linear draws for x after torch.manual_seed(seed), on the CPU."""
    torch.manual_seed(seed)
    if lora_dropout_kernel.applies(x, a):
        s = lora_dropout_kernel.dropout_seed(x.device)
        return lora_dropout_kernel.keep_mask(x.numel() // x.shape[-1], x.shape[-1], s, p, x.device).view(x.shape).cpu()
    return torch.native_dropout(x, p, True)[1].cpu()


def test_seeded_dropout_keeps_no_mask(device):
    """16-bit x under autocast with fp32 adapters (ms-swift's set-up): the dropout is re-drawn from a seed in the
    backward, so autograd keeps x, the seed and the rank-r activation, no mask bits and no dropped-out copy."""
    x, w, b, a, bb = (None if t is None else t.detach().to(device).requires_grad_(t.requires_grad)
                      for t in make(n=(6, 11), d_in=64, d_out=48, dtype=torch.bfloat16, bias=False))
    assert lora_dropout_kernel.applies(x, a)
    with torch.autocast(device.type if isinstance(device, torch.device) else device, dtype=torch.bfloat16):
        y, saved = _saved_bytes(lambda: lora_linear(x, None, w, None, a, bb, 2.0, dropout_p=0.1))
    y.float().sum().backward()
    casts = (a.numel() + bb.numel()) * 2                                 # the adapters in bf16, kept for the backward
    assert saved <= w.numel() * 2 + x.numel() * 2 + 8 + 66 * 4 * 2 + casts, saved   # w, x, seed, rank-r activation
    assert x.grad is not None and a.grad is not None and torch.isfinite(a.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_inside_matches_reference_with_the_same_mask(device, dtype):
    """dropout_p > 0: the mask is the one lora_dropout_kernel draws from a seed taken from the generator (16-bit x,
    in % 8 == 0), else the one torch.native_dropout (nn.Dropout's CUDA path, and the same random stream on CPU)
    draws after the same seed; values and every gradient match the float64 composition."""
    x, w, b, a, bb = (t.detach().to(device).requires_grad_(t.requires_grad)
                      for t in make(n=(4, 7), d_in=40, dtype=dtype, adapter_dtype=dtype))
    p = 0.25
    dy = torch.randn(4, 7, 40).to(device, dtype)
    torch.manual_seed(11)
    with inputs_unchanged(x, w, a, bb):
        y = lora_linear(x, None, w, b, a, bb, 0.5, dropout_p=p)
    y.backward(dy)
    mask = drawn_mask(x.detach(), a, p, seed=11)
    assert 0 < (~mask).sum() < mask.numel()
    xr, ar, br = f64(x), f64(a), f64(bb)
    yr = lora_linear_reference(xr, xr * mask / (1 - p), f64(w), f64(b), ar, br, 0.5)
    yr.backward(dy.cpu().double())
    assert_close(y, yr, dtype, name="y")
    for name, got, want in (("dx", x.grad, xr.grad), ("dA", a.grad, ar.grad), ("dB", bb.grad, br.grad)):
        assert_close(got, want, dtype, slack=4, name=name)


def test_dropout_inside_matches_nn_dropout_and_saves_less(device):
    """Same numbers as dropout(x) outside (the PEFT order: one nn.Dropout call on x), and autograd keeps x plus
    bits instead of a bool mask plus the dropped-out copy."""
    x, w, b, a, bb = (None if t is None else t.detach().to(device).requires_grad_(t.requires_grad)
                      for t in make(n=(16, 8), d_in=64, d_out=48, bias=False))
    x_ref = x.detach().clone().requires_grad_()
    a_ref, b_ref = a.detach().clone().requires_grad_(), bb.detach().clone().requires_grad_()
    dy = torch.randn(16, 8, 48, device=device)
    torch.manual_seed(2)
    y, ours = _saved_bytes(lambda: lora_linear(x, None, w, None, a, bb, 2.0, dropout_p=0.05))
    torch.manual_seed(2)
    y_ref, theirs = _saved_bytes(
        lambda: lora_linear(x_ref, torch.nn.Dropout(0.05)(x_ref), w, None, a_ref, b_ref, 2.0))
    y.backward(dy), y_ref.backward(dy)
    assert torch.equal(y, y_ref)
    for name, got, want in (("dx", x.grad, x_ref.grad), ("dA", a.grad, a_ref.grad), ("dB", bb.grad, b_ref.grad)):
        assert_close(got, want, torch.float32, name=name)
    x_bytes = x.numel() * 4
    fixed = sum(t.numel() * 4 for t in (w, a, bb))                      # plain tensors here, not Parameters
    assert ours <= fixed + x_bytes + x.numel() // 8 + 16 * 8 * 4 * 4, ours   # x, bits, the rank-r activation
    assert theirs >= fixed + x_bytes + x.numel(), theirs                # x_lora and the mask


def test_dropout_p_errors():
    x, w, b, a, bb = make()
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        lora_linear(x, None, w, b, a, bb, 1.0, dropout_p=1.0)
    with pytest.raises(ValueError, match="x_lora must be None"):
        lora_linear(x, x, w, b, a, bb, 1.0, dropout_p=0.1)
    with pytest.raises(ValueError, match="x must be contiguous"):
        lora_linear(x.transpose(0, 1), None, w, b, a, bb, 1.0, dropout_p=0.1)


def _peft_upcast(x, w, b, a, bb, s, mask=None, p=0.0):
    """peft.tuners.lora.Linear.forward without autocast: the LoRA branch on an fp32 copy of x, the sum rounded
    back to x's dtype (mask: the dropout's keep mask, applied to the fp32 copy)."""
    xa = x.to(a.dtype)
    if mask is not None:
        xa = xa * mask * (1 / (1 - p))      # as torch's dropout kernels: times the reciprocal
    return (F.linear(x, w, b) + F.linear(F.linear(xa, a), bb) * s).to(x.dtype)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_upcast_fp32_adapters_without_autocast(device, p, monkeypatch):
    """bf16 x and base weight, fp32 adapters, no autocast (a plain PyTorch loop): same values and gradients as
    PEFT's fp32 branch, in row chunks (a small CHUNK_BYTES makes 5 of them, the last one partial), keeping x and
    the bits instead of fp32 copies."""
    from swift_liger.ops import lora_linear_op as LL
    monkeypatch.setattr(LL, "CHUNK_BYTES", 8 * 48 * 4)          # 8 rows per chunk
    x, w, b, a, bb = (t.detach().to(device).requires_grad_(t.requires_grad)
                      for t in make(n=(37,), d_in=40, d_out=48, dtype=torch.bfloat16, adapter_dtype=torch.float32))
    x_ref, a_ref, b_ref = (t.detach().clone().requires_grad_() for t in (x, a, bb))
    dy = torch.randn(37, 48).to(device, torch.bfloat16)
    torch.manual_seed(3)
    with inputs_unchanged(x, w, b, a, bb):
        y, ours = _saved_bytes(lambda: lora_linear(x, None, w, b, a, bb, 1.5, dropout_p=p))
    mask = None
    if p:
        torch.manual_seed(3)
        mask = torch.native_dropout(x.detach(), p, True)[1]      # the draw the op makes
    y_ref, theirs = _saved_bytes(lambda: _peft_upcast(x_ref, w, b, a_ref, b_ref, 1.5, mask, p))
    assert y.dtype == torch.bfloat16
    y.backward(dy), y_ref.backward(dy)
    if device.type == "cpu":   # on the GPU, cuBLAS may pick another kernel for a chunk: fp32 ulps, bf16 rounding
        assert torch.equal(y, y_ref)
        assert torch.equal(x.grad, x_ref.grad)
    assert_close(y, y_ref.double(), torch.bfloat16, name="y")
    assert_close(x.grad, x_ref.grad.double(), torch.bfloat16, name="dx")
    assert a.grad.dtype == bb.grad.dtype == torch.float32
    torch.testing.assert_close(a.grad, a_ref.grad, atol=1e-5, rtol=1e-5)   # chunked fp32 sums
    torch.testing.assert_close(bb.grad, b_ref.grad, atol=1e-5, rtol=1e-5)
    assert ours < theirs, (ours, theirs)


def test_upcast_dropout_is_nn_dropout_on_cpu():
    """On CPU the bf16 draw and PEFT's draw on the fp32 copy are the same random stream: equal to PEFT exactly."""
    x, w, b, a, bb = make(n=(16, 5), d_in=32, d_out=24, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    torch.manual_seed(9)
    y = lora_linear(x, None, w, b, a, bb, 2.0, dropout_p=0.2)
    torch.manual_seed(9)
    xa = torch.nn.Dropout(0.2)(x.detach().float())
    y_ref = (F.linear(x.detach(), w, b) + F.linear(F.linear(xa, a.detach()), bb.detach()) * 2.0).to(torch.bfloat16)
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize("dropout_p,upcast", [(0.0, False), (0.25, False), (0.0, True), (0.25, True)])
def test_dequantized_weight_made_per_matmul_and_never_saved(dropout_p, upcast):
    """A DequantizedWeight base (QLoRA): the same values and gradients as the dense weight it stands for; get() runs
    once in the forward and once in the backward's input gradient, and no tensor it returned is saved for the
    backward. upcast: fp32 adapters on a bf16 x without autocast (LoRALinearUpcastFunction)."""
    from swift_liger.ops.lora_linear_op import DequantizedWeight
    dtype = torch.bfloat16 if upcast else torch.float32
    x, w, b, a, bb = make(dtype=dtype, adapter_dtype=torch.float32, bias=not upcast, seed=4)
    made = []

    def get():
        made.append(w.clone())
        return made[-1]
    qw = DequantizedWeight(get, w.shape, w.dtype, w.device)
    x2 = x.detach().clone().requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), bb.detach().clone().requires_grad_()
    dy = torch.randn(3, 5, 40).to(dtype)
    torch.manual_seed(9)
    y_dense = lora_linear(x, None, w, b, a, bb, 2.0, dropout_p)
    saved = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.add(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        torch.manual_seed(9)
        y = lora_linear(x2, None, qw, b, a2, b2, 2.0, dropout_p)
    assert len(made) == 1 and made[0].untyped_storage().data_ptr() not in saved
    y_dense.backward(dy), y.backward(dy)
    assert len(made) == 2
    torch.testing.assert_close(y, y_dense, atol=0, rtol=0)
    for got, want in ((x2.grad, x.grad), (a2.grad, a.grad), (b2.grad, bb.grad)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dequantized_weight_checked_like_a_tensor():
    from swift_liger.ops.lora_linear_op import DequantizedWeight
    x, w, b, a, bb = make()
    qw = DequantizedWeight(lambda: w, (40, 23), w.dtype, w.device)
    with pytest.raises(ValueError, match=r"weight must be \[out, 24\]"):
        lora_linear(x, None, qw, b, a, bb, 2.0)
    qw = DequantizedWeight(lambda: w, w.shape, torch.bfloat16, w.device)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16"):
        lora_linear(x, None, qw, b, a, bb, 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_no_grad_forward_is_the_training_forward(device, dtype, p):
    """Autograd off (a reentrant checkpoint's first pass): the op skips the mask bits and the autograd record but
    draws the same dropout, so after the same seed it returns exactly what the training forward returns (the
    recompute of a checkpointed layer sees the values its first pass produced), matching float64."""
    x, w, b, a, bb = (t.detach().to(device) for t in make(n=(4, 9), d_in=40, dtype=dtype, adapter_dtype=dtype))
    a.requires_grad_(), bb.requires_grad_()
    torch.manual_seed(5)
    y_train = lora_linear(x, None, w, b, a, bb, 0.75, dropout_p=p)
    assert y_train.requires_grad
    torch.manual_seed(5)
    with torch.no_grad(), inputs_unchanged(x, w, a, bb):
        y_eval = lora_linear(x, None, w, b, a, bb, 0.75, dropout_p=p)
    assert not y_eval.requires_grad
    assert torch.equal(y_eval, y_train.detach())
    keep = drawn_mask(x, a, p, seed=5) if p else torch.ones(x.shape, dtype=torch.bool)
    xr = f64(x)
    yr = lora_linear_reference(xr, xr * keep / (1 - p), f64(w), f64(b), f64(a), f64(bb), 0.75)
    assert_close(y_eval, yr, dtype, name="y")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_under_reentrant_checkpointing(device, dtype):
    """ms-swift's set-up: the first pass runs with autograd off, the recompute re-draws the dropout after the
    checkpoint restores the RNG state: the same values and gradients as one pass with autograd on."""
    import torch.utils.checkpoint as cp
    x, w, b, a, bb = (t.detach().to(device).requires_grad_(t.requires_grad)
                      for t in make(n=(5, 9), d_in=48, dtype=dtype, adapter_dtype=dtype))
    dy = torch.randn(5, 9, 40).to(device, dtype)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(21)
        f = lambda t: lora_linear(t, None, w, b, a, bb, 0.5, dropout_p=0.2)   # noqa: E731
        y = cp.checkpoint(f, x, use_reentrant=True) if checkpointed else f(x)
        y.backward(dy)
        grads.append((y.detach().clone(), x.grad.clone(), a.grad.clone(), bb.grad.clone()))
        x.grad = a.grad = bb.grad = None
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)


_FIRST_BACKWARD_NODE = """
import warnings, torch
from swift_liger.ops.lora_linear_op import lora_linear
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
a = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(128, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = lora_linear(x, None, w, None, a, b, 2.0, {p})
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    y.backward(torch.ones_like(y))   # the LoRA node is the first the autograd thread runs: its first op is cuBLAS
    torch.cuda.synchronize()
print("WARNINGS", [str(r.message)[:80] for r in rec])
"""


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_backward_binds_the_cuda_context_quietly(device, p):
    """Autograd's CUDA thread starts without a current context; the LoRA backward (first op: a cuBLAS product) binds
    it before cuBLAS would warn about it. A fresh process each time: torch warns once per process."""
    if device.type != "cuda":
        pytest.skip("a CUDA backward thread (CPU: bind_cuda_context does nothing, checked below)")
    out = subprocess.run([sys.executable, "-c", _FIRST_BACKWARD_NODE.replace("{p}", str(p))], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNINGS []" in out.stdout, out.stdout[-1000:]


def test_bind_cuda_context_ignores_cpu_tensors():
    before = set(_common._CONTEXT_THREADS)
    _common.bind_cuda_context(torch.ones(1))
    assert _common._CONTEXT_THREADS == before


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("quantized", [False, True])
def test_base_epilogue_switch_matches_reference(device, monkeypatch, bias, dtype, p, quantized):
    """BASE_EPILOGUE (the LoRA output first, the base GEMM adding into it): float64 values and gradients with and
    without autograd, the same dropout draws as the default order, a DequantizedWeight made once per matmul."""
    from swift_liger.ops import lora_linear_op
    x, w, b, a, bb = (None if t is None else t.detach().to(device)
                      for t in make(n=(2, 7), d_in=40, d_out=24, dtype=dtype, adapter_dtype=dtype, bias=bias, seed=6))
    made = []
    base = lora_linear_op.DequantizedWeight(lambda: made.append(1) or w, w.shape, w.dtype, w.device) \
        if quantized else w
    dy = torch.randn(2, 7, 24, device=device).to(dtype)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(lora_linear_op, "BASE_EPILOGUE", on)
        xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, bb))
        torch.manual_seed(3)
        with torch.no_grad():
            y0 = lora_linear(xs, None, base, b, as_, bs, 1.5, dropout_p=p)
        torch.manual_seed(3)
        with inputs_unchanged(w, a, bb):
            y = lora_linear(xs, None, base, b, as_, bs, 1.5, dropout_p=p)
        y.backward(dy)
        assert y.shape == (2, 7, 24) and y.dtype == dtype and y0.dtype == dtype
        runs[on] = (y0, y, xs.grad, as_.grad, bs.grad)
    if quantized:
        assert len(made) == 6   # per order: the no-grad forward, the forward and the input gradient
    keep = drawn_mask(x, a, p, seed=3) if p else torch.ones(x.shape, dtype=torch.bool)   # on the CPU, as drawn_mask
    xr, ar, br = (f64(t).requires_grad_() for t in (x, a, bb))
    yr = lora_linear_reference(xr, xr * keep / (1 - p), f64(w), None if b is None else f64(b), ar, br, 1.5)
    yr.backward(f64(dy))
    y0, y, dx, da, db = runs[True]
    assert_close(y0, yr, dtype, name="y, autograd off")
    assert_close(y, yr, dtype, name="y")
    for name, got, want in (("dx", dx, xr.grad), ("dA", da, ar.grad), ("dB", db, br.grad)):
        assert_close(got, want, dtype, slack=4, name=name)
    for got, want in zip(runs[True][2:], runs[False][2:]):   # the backward is the same code: same dropout draws
        assert_close(got, want, dtype, slack=4)


def test_base_epilogue_under_autocast_with_an_fp32_base(monkeypatch):
    """Under bf16 autocast an fp32 base weight and bias are cast for the base product as F.linear's autocast
    would: the same output as the default order."""
    from swift_liger.ops import lora_linear_op
    x, w, b, a, bb = make(n=(3, 4), d_in=32, d_out=16, dtype=torch.float32, adapter_dtype=torch.float32, seed=8)
    xb = x.detach().to(torch.bfloat16)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(lora_linear_op, "BASE_EPILOGUE", on)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            out[on] = lora_linear(xb, None, w, b, a.detach().bfloat16(), bb.detach().bfloat16(), 2.0)
    assert out[True].dtype == torch.bfloat16
    assert_close(out[True], out[False], torch.bfloat16, slack=2)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_base_epilogue_follows_its_environment_variable(value, on):
    """BASE_EPILOGUE is on by default; SWIFT_LIGER_LORA_BASE_EPILOGUE=0 turns it off at import (the CLI bench's
    swift_liger_no_base_epilogue variant)."""
    env = {k: v for k, v in os.environ.items() if k != "SWIFT_LIGER_LORA_BASE_EPILOGUE"}
    if value is not None:
        env["SWIFT_LIGER_LORA_BASE_EPILOGUE"] = value
    out = subprocess.run([sys.executable, "-c", "from swift_liger.ops import lora_linear_op as m; "
                          "print(m.BASE_EPILOGUE)"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(on)
