"""FP8 frozen weights: quantization, the FP8 forward and input-gradient GEMMs against float64 maths of the same
quantized operands, the Fp8Weight tensor's behaviour as a frozen Parameter, and lora_linear over an FP8 base.
On CPU torch._scaled_mm is torch's reference FP8 GEMM; the same tests run on an sm_89+ GPU (cuBLASLt)."""
import copy
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, f64, inputs_unchanged
from swift_liger.ops.fp8_linear_op import (FP8, FP8_MAX, Fp8Weight, fp8_device_problem, fp8_input_grad, fp8_linear,
                                           fp8_linear_reference, fp8_weight_problem, quantize_rows)
from swift_liger.ops.lora_linear_op import lora_linear

DEVICE = "cuda" if torch.cuda.is_available() and fp8_device_problem("cuda") is None else "cpu"
# e4m3 keeps 3 mantissa bits: a value's rounding error is at most 2^-4 of it (normals)
E4M3_REL = 2.0 ** -4


def weight(out=48, inp=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g) * 0.2).to(dtype).to(DEVICE)


def f64_dequant(q, scale):
    return q.double() * scale.double().reshape(-1, 1)


@pytest.mark.parametrize("fold", [False, True])
def test_quantize_rows_bounds(fold):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 48, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(torch.bfloat16).to(DEVICE)
    x[4] = 0                                                # an all-zero row quantizes to zeros
    f = (torch.rand(48, generator=g) + 0.5).to(DEVICE) if fold else None
    with inputs_unchanged(x):
        q, s = quantize_rows(x, f)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (9, 1)
    want = x.double() * (f.double() if fold else 1.0)
    got = f64_dequant(q, s)
    err = (got - want).abs()
    assert (err <= E4M3_REL * want.abs() + s.double() * 2.0 ** -9 + 1e-30).all()   # subnormals: 2^-9 steps
    nonzero = [i for i in range(9) if i != 4]
    assert torch.all(q.float().abs().amax(1)[nonzero] == FP8_MAX)   # each row's max maps to 448
    assert torch.all(q[4].float() == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(5, 7), (3,), (1, 1, 16)])
def test_forward_and_input_grad_match_float64(dtype, bias, lead):
    w = weight(dtype=dtype)
    fw = Fp8Weight.quantize(w)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*lead, 32, generator=g).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).to(DEVICE) if bias else None
    dy = torch.randn(*lead, 48, generator=g).to(dtype).to(DEVICE)
    with inputs_unchanged(w, x, dy):
        y = fp8_linear(x, fw, b)
        y.backward(dy)
    assert y.dtype == dtype and y.shape == (*lead, 48)
    assert_close(y, fp8_linear_reference(x, fw, b), dtype, name="y")
    # the input gradient: g scaled by W's row scales, quantized per row, times W_q
    gq, sg = quantize_rows(dy.reshape(-1, 48), fold=fw.scale)
    dx_ref = (f64_dequant(gq, sg) @ fw.q.double()).reshape(x.shape)
    assert_close(x.grad, dx_ref, dtype, name="dx")
    # and both within FP8 rounding of the 16-bit maths
    dense = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert ((y.double() - dense).norm() / dense.norm()) < 2 * E4M3_REL
    dx_dense = dy.double() @ w.double()
    assert ((x.grad.double() - dx_dense).norm() / dx_dense.norm()) < 2 * E4M3_REL


def test_autocast_and_no_grad():
    w = weight()
    fw = Fp8Weight.quantize(w)
    x = torch.randn(6, 32, device=DEVICE)                  # fp32 input: autocast makes it bf16
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = fp8_linear(x, fw)
    assert y.dtype == torch.bfloat16
    assert_close(y, fp8_linear_reference(x.bfloat16(), fw), torch.bfloat16, name="y")
    with torch.no_grad():
        assert torch.equal(fp8_linear(x.bfloat16(), fw), y)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fp8_linear(x, fw)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 32\]"):
        fp8_linear(torch.randn(2, 16, device=DEVICE, dtype=torch.bfloat16), fw)
    with pytest.raises(ValueError, match="Fp8Weight"):
        fp8_linear(x.bfloat16(), w)


def test_weight_problems():
    assert fp8_weight_problem(weight()) is None
    assert "multiples of 16" in fp8_weight_problem(weight(out=40))
    assert "bfloat16 or float16" in fp8_weight_problem(weight(dtype=torch.float32))
    assert "frozen" in fp8_weight_problem(weight().requires_grad_())
    assert "[out, in]" in fp8_weight_problem(torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Weight.quantize(weight(out=40))
    assert fp8_device_problem("cpu") is None
    assert "CUDA" in fp8_device_problem("meta")


def test_fp8_weight_is_a_frozen_parameter_with_exact_reads(tmp_path):
    w = weight()
    snapshot = w.clone()
    fw = Fp8Weight.quantize(w)
    assert torch.equal(w, snapshot)                         # the user's weight is not changed
    assert fw.dtype == w.dtype and fw.shape == w.shape and fw.device == w.device and not fw.requires_grad
    assert fw.q.dtype == FP8 and fw.scale.shape == (48,) and fw.original.device.type == "cpu"
    assert fw.nbytes_on_device() == 48 * 32 + 48 * 4 + 32 * 4
    lin = torch.nn.Linear(32, 48, bias=False, device=DEVICE, dtype=w.dtype).requires_grad_(False)
    lin._parameters["weight"] = torch.nn.Parameter(fw, requires_grad=False)
    assert isinstance(lin.weight, torch.nn.Parameter) and isinstance(lin.weight, Fp8Weight)
    # reads outside the FP8 matmuls see the exact loaded values
    assert torch.equal(lin.weight.clone(), w) and type(lin.weight.clone()) is torch.Tensor
    assert torch.equal(lin.weight.float(), w.float())
    assert torch.equal(F.linear(torch.eye(32, device=DEVICE, dtype=w.dtype), lin.weight), w.t())
    assert isinstance(lin.weight.detach(), Fp8Weight) and isinstance(lin.weight.data, Fp8Weight)
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)["weight"]
    assert type(saved) is torch.Tensor and torch.equal(saved.to(w.device), w)
    twin = copy.deepcopy(lin)
    assert isinstance(twin.weight, Fp8Weight) and isinstance(twin.weight, torch.nn.Parameter)
    assert torch.equal(twin.weight.q.float(), fw.q.float()) and twin.weight.q.data_ptr() != fw.q.data_ptr()
    lin.to(DEVICE)                                          # a move to where it is: nothing happens
    assert isinstance(lin.weight, Fp8Weight)
    with pytest.raises(RuntimeError, match="frozen FP8 base weight"):
        lin.weight.add_(1)
    with pytest.raises(RuntimeError, match="frozen FP8 base weight"):
        lin.weight.data.mul_(2)
    with pytest.raises(RuntimeError, match="cannot be moved or cast"):
        lin.to(torch.float32)
    assert torch.equal(lin.weight.clone(), w)
    assert "Fp8Weight(shape=(48, 32)" in repr(fw)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_linear_over_fp8_base(dropout):
    """Adapter gradients do not depend on the base weight: equal to the 16-bit base's; the output and the input
    gradient carry the base's FP8 GEMMs."""
    w = weight()
    fw = Fp8Weight.quantize(w)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 5, 32, generator=g).bfloat16().to(DEVICE)
    a = (torch.randn(4, 32, generator=g) * 0.3).bfloat16().to(DEVICE)
    b = (torch.randn(48, 4, generator=g) * 0.3).bfloat16().to(DEVICE)
    bias = torch.randn(48, generator=g).bfloat16().to(DEVICE)
    dy = torch.randn(4, 5, 48, generator=g).bfloat16().to(DEVICE)
    outs = []
    for base in (fw, w):
        xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
        torch.manual_seed(7)                                # the same dropout draws for both
        y = lora_linear(xs, None, base, bias, as_, bs, 2.0, dropout)
        y.backward(dy)
        outs.append((y, xs.grad, as_.grad, bs.grad))
    (y8, dx8, da8, db8), (y16, dx16, da16, db16) = outs
    assert torch.equal(da8, da16) and torch.equal(db8, db16)
    lora_y = y16.double() - (x.double() @ w.double().t() + bias.double())   # the LoRA branch (same dropout)
    assert_close(y8, fp8_linear_reference(x, fw, bias) + lora_y, torch.bfloat16, slack=2, name="y")
    lora_dx = dx16.double() - dy.double() @ w.double()
    assert_close(dx8, fp8_input_grad(dy, fw, torch.bfloat16).double() + lora_dx,
                 torch.bfloat16, slack=2, name="dx")
    with torch.no_grad():                                    # the no-autograd path (checkpoint first pass)
        torch.manual_seed(7)
        assert_close(lora_linear(x, None, fw, bias, a, b, 2.0, dropout), y8, torch.bfloat16, name="y no_grad")


def test_lora_linear_fp8_base_upcast_path():
    """fp32 adapters on a bf16 input without autocast (LoRALinearUpcastFunction) over an FP8 base."""
    w = weight()
    fw = Fp8Weight.quantize(w)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g).bfloat16().to(DEVICE).requires_grad_()
    a = (torch.randn(4, 32, generator=g) * 0.3).to(DEVICE).requires_grad_()
    b = (torch.randn(48, 4, generator=g) * 0.3).to(DEVICE).requires_grad_()
    dy = torch.randn(6, 48, generator=g).bfloat16().to(DEVICE)
    y = lora_linear(x, None, fw, None, a, b, 0.5)
    y.backward(dy)
    want = f64(fp8_linear_reference(x, fw)) + 0.5 * (f64(x) @ f64(a).t()) @ f64(b).t()
    assert_close(y, want, torch.bfloat16, name="y")
    lora_dx = 0.5 * (f64(dy) @ f64(b)) @ f64(a)
    assert_close(x.grad, f64(fp8_input_grad(dy, fw, torch.bfloat16)) + lora_dx, torch.bfloat16, slack=2,
                 name="dx")


def _count_quantizations(monkeypatch):
    from swift_liger.ops import fp8_linear_op as m
    calls = []
    real = m.quantize_rows

    def counted(x2, fold=None):
        calls.append(fold is None)
        return real(x2, fold)
    monkeypatch.setattr(m, "quantize_rows", counted)
    return calls


def test_members_of_an_input_group_quantize_their_input_once(monkeypatch):
    """Weights of one InputGroup (gate/up, q/k/v) read one quantization of the same x: outputs equal, bit for bit,
    to each quantizing x itself; a new version of x, another input between members, or a backward in between
    quantize again; nothing is kept once every member has read it."""
    from swift_liger.ops import fp8_linear_op as m
    ws = [Fp8Weight.quantize(weight(48, 32, seed=s)) for s in (1, 2, 3)]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 32, generator=g).bfloat16().to(DEVICE)
    other = torch.randn(7, 32, generator=g).bfloat16().to(DEVICE)
    solo = [m.fp8_matmul(x, w, torch.bfloat16) for w in ws]
    group = m.InputGroup(3)
    for w in ws:
        w.input_group = group
    assert ws[0].detach().input_group is group and copy.deepcopy(ws[0]).input_group is None
    calls = _count_quantizations(monkeypatch)
    with inputs_unchanged(x):
        ys = [m.fp8_matmul(x, w, torch.bfloat16) for w in ws]
    assert len(calls) == 1 and m._SHARED[0] is None
    assert all(torch.equal(y, want) for y, want in zip(ys, solo))
    m.fp8_matmul(x, ws[0], torch.bfloat16)
    x.mul_(2)                                            # a new version: the first member's copy is stale
    y = m.fp8_matmul(x, ws[1], torch.bfloat16)
    assert torch.equal(y, m.fp8_matmul(x.clone(), ws[1], torch.bfloat16))
    x.div_(2)
    assert len(calls) == 4
    m.fp8_matmul(x, ws[0], torch.bfloat16)
    m.fp8_matmul(other, ws[1], torch.bfloat16)           # another input drops the shared copy
    assert torch.equal(m.fp8_matmul(x, ws[2], torch.bfloat16), solo[2]) and len(calls) == 7
    m.fp8_matmul(x, ws[0], torch.bfloat16)
    fp8_input_grad(torch.randn(7, 48, generator=g).bfloat16().to(DEVICE), ws[0], torch.bfloat16)
    assert m._SHARED[0] is None
    calls.clear()
    for w in ws:
        w.input_group = None                              # no group: each quantizes its own
    assert all(torch.equal(m.fp8_matmul(x, w, torch.bfloat16), want) for w, want in zip(ws, solo))
    assert len(calls) == 3 and m._SHARED[0] is None


def test_lora_linear_members_share_the_quantized_input(monkeypatch):
    """Two LoRA projections over FP8 bases of one InputGroup, called on the same x (a gated MLP's gate and up):
    one quantization of x in the forward, values and gradients equal to ungrouped weights'."""
    from swift_liger.ops import fp8_linear_op as m
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, 32, generator=g).bfloat16().to(DEVICE)
    ab = [((torch.randn(4, 32, generator=g) * 0.3).bfloat16().to(DEVICE),
           (torch.randn(48, 4, generator=g) * 0.3).bfloat16().to(DEVICE)) for _ in range(2)]
    dys = [torch.randn(3, 5, 48, generator=g).bfloat16().to(DEVICE) for _ in range(2)]
    results = []
    for grouped in (False, True):
        ws = [Fp8Weight.quantize(weight(48, 32, seed=s)) for s in (1, 2)]
        group = m.InputGroup(2) if grouped else None
        for w in ws:
            w.input_group = group
        calls = _count_quantizations(monkeypatch)
        xs = x.clone().requires_grad_()
        params = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in ab]
        ys = [lora_linear(xs, xs, w, None, a, b, 2.0) for w, (a, b) in zip(ws, params)]
        forward_quantizations = calls.count(True)
        torch.autograd.backward(ys, dys)
        results.append((forward_quantizations, ys, xs.grad, [t.grad for p in params for t in p]))
    (n0, ys0, dx0, g0), (n1, ys1, dx1, g1) = results
    assert (n0, n1) == (2, 1)
    assert all(torch.equal(a, b) for a, b in zip(ys0 + [dx0] + g0, ys1 + [dx1] + g1))


@pytest.mark.parametrize("r, c", [(5, 48), (33, 70), (64, 128), (130, 16)])
def test_transpose_kernel_equals_torch(r, c):
    """The FP8 codes' transpose (the input gradient's K-major operand) is torch's, for tiles cut at both edges."""
    from swift_liger.ops.fp8_transpose_kernel import transpose_kernel
    g = torch.Generator().manual_seed(r * c)
    q = torch.randint(0, 256, (r, c), generator=g, dtype=torch.uint8).to(DEVICE).view(FP8)
    with inputs_unchanged(q.view(torch.uint8)):
        t = transpose_kernel(q)
    assert t.dtype == FP8 and t.shape == (c, r) and t.is_contiguous()
    assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_quantization_leaves_its_input_alone(dtype, monkeypatch):
    """The torch paths (the reference backend, and the kernels' test references) on fp32 rows too, where
    ``.float()`` would return the rows themselves: whole, in chunks, with and without a fold, reciprocal or not."""
    import swift_liger.ops.fp8_linear_op as op
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(11, 40, generator=g) * 5).to(dtype).to(DEVICE)
    f = (torch.rand(40, generator=g) + 0.5).to(DEVICE)
    for chunk in (op.CHUNK_BYTES, 3 * 40 * 4):
        monkeypatch.setattr(op, "CHUNK_BYTES", chunk)
        for fold in (None, f):
            with inputs_unchanged(x, f):
                op.quantize_rows_torch(x, fold)
                op.quantize_rows_fast_torch(x, fold)


def test_quantize_rows_in_chunks_equals_whole(monkeypatch):
    import swift_liger.ops.fp8_linear_op as op
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 48, generator=g).bfloat16().to(DEVICE)
    f = (torch.rand(48, generator=g) + 0.5).to(DEVICE)
    whole = [op.quantize_rows(x), op.quantize_rows(x, f)]
    monkeypatch.setattr(op, "CHUNK_BYTES", 5 * 48 * 4)      # 5 rows per chunk: 8 chunks, the last of 2 rows
    for (q, s), (q1, s1) in zip(whole, [op.quantize_rows(x), op.quantize_rows(x, f)]):
        assert torch.equal(q.float(), q1.float()) and torch.equal(s, s1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,rows", [(5, 48, 1), (3, 4100, 1), (7, 33, 1), (1, 16, 1), (7, 33, 4), (5, 48, 2)])
def test_quant_kernel_equals_torch_bit_for_bit(dtype, n, k, rows):
    """The Triton kernel's division path (run here: the interpreter on CPU, compiled on a GPU, where hw_cvt is the
    default) against the torch ops: the same scales and the same e4m3 codes, zeros, signed zeros, subnormals and ties
    included; strided rows too; several rows per program with the last program's rows cut short."""
    from swift_liger.ops import fp8_quant_kernel
    from swift_liger.ops._common import launch_override
    from swift_liger.ops.fp8_linear_op import quantize_rows_torch
    g = torch.Generator().manual_seed(n * k)
    x = (torch.randn(n, k + 3, generator=g) * torch.logspace(-4, 4, n)[:, None]).to(dtype)[:, :k].to(DEVICE)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 3.0])
    f = (torch.rand(k, generator=g) + 0.5).to(DEVICE)
    for fold in (None, f):
        with inputs_unchanged(x), launch_override(fp8_quant_kernel, None, rows=rows, hw_cvt=False):
            q, s = fp8_quant_kernel.quantize_rows_kernel(x, fold)
        q_ref, s_ref = quantize_rows_torch(x, fold)
        assert q.dtype == FP8 and q.shape == (n, k) and s.shape == (n, 1)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quant_kernel_rounds_every_e4m3_boundary_like_torch():
    """Every finite e4m3 value, every midpoint between neighbours (ties to even) and the floats just beside each
    midpoint, as one row whose max is 448 (scale 1): the kernel's codes are torch's conversion's."""
    from swift_liger.ops import fp8_quant_kernel
    from swift_liger.ops._common import launch_override
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)].sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    y = torch.cat([vals, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    y = torch.cat([y[y.abs() <= FP8_MAX], torch.tensor([FP8_MAX])]).to(DEVICE)
    with launch_override(fp8_quant_kernel, None, hw_cvt=False):   # the division path (hw_cvt has its own test)
        q, s = fp8_quant_kernel.quantize_rows_kernel(y[None, :])
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8)[0], y.to(FP8).view(torch.uint8))


def test_without_a_rowwise_fp8_gemm_the_product_comes_from_bf16(monkeypatch):
    """A torch build without a row-wise scaled FP8 GEMM for the device (probed when the first weight is quantized):
    warned once, and fp8_linear computes the same product from bf16 copies of the FP8 operands."""
    import swift_liger.ops.fp8_linear_op as op
    w = weight()
    x = torch.randn(6, 32, device=DEVICE).bfloat16().requires_grad_()
    fw = Fp8Weight.quantize(w)
    y_fp8 = fp8_linear(x, fw)
    y_fp8.backward(torch.ones_like(y_fp8))
    dx_fp8 = x.grad.clone()
    x.grad = None

    def no_rowwise(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration (simulated)")
    monkeypatch.setattr(op, "_ROWWISE", {})
    monkeypatch.setattr(torch, "_scaled_mm", no_rowwise)
    with pytest.warns(UserWarning, match="no row-wise scaled FP8 GEMM .* multiply through bf16"):
        fw2 = Fp8Weight.quantize(w)
    y = fp8_linear(x, fw2)
    y.backward(torch.ones_like(y))
    assert_close(y, y_fp8.double(), torch.bfloat16, name="y")
    assert_close(x.grad, dx_fp8.double(), torch.bfloat16, name="dx")
    assert_close(y, fp8_linear_reference(x, fw2), torch.bfloat16, name="y vs float64")


def _hw_cvt_or_skip():
    from swift_liger.ops import fp8_quant_kernel
    if not fp8_quant_kernel.hw_cvt_supported(torch.device(DEVICE)):
        pytest.skip("Fp8QuantConfig.hw_cvt runs compiled on an sm_89+ GPU only")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,rows", [(5, 48, 1), (3, 4100, 1), (7, 33, 4), (9, 3584, 2)])
def test_quant_kernel_hw_cvt_equals_its_torch_reference(dtype, n, k, rows):
    """hw_cvt (GPU only): the same scales as the default path, and codes equal to quantize_rows_fast_torch's
    (reciprocal multiply, round-to-nearest-even conversion), strided rows and several rows per program included."""
    _hw_cvt_or_skip()
    from swift_liger.ops import fp8_quant_kernel
    from swift_liger.ops._common import launch_override
    from swift_liger.ops.fp8_linear_op import quantize_rows_fast_torch, quantize_rows_torch
    g = torch.Generator().manual_seed(n * k + 1)
    x = (torch.randn(n, k + 3, generator=g) * torch.logspace(-4, 4, n)[:, None]).to(dtype)[:, :k].to(DEVICE)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 3.0])
    f = (torch.rand(k, generator=g) + 0.5).to(DEVICE)
    for fold in (None, f):
        with inputs_unchanged(x), launch_override(fp8_quant_kernel, None, rows=rows, hw_cvt=True):
            q, s = fp8_quant_kernel.quantize_rows_kernel(x, fold)
        q_ref, s_ref = quantize_rows_fast_torch(x, fold)
        assert torch.equal(s, s_ref) and torch.equal(s, quantize_rows_torch(x, fold)[1])
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quant_kernel_hw_cvt_rounds_every_e4m3_boundary_like_torch():
    """hw_cvt (GPU only) at scale 1: every finite e4m3 value, midpoint and its neighbours converts as torch's."""
    _hw_cvt_or_skip()
    from swift_liger.ops import fp8_quant_kernel
    from swift_liger.ops._common import launch_override
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)].sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    y = torch.cat([vals, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    y = torch.cat([y[y.abs() <= FP8_MAX], torch.tensor([FP8_MAX])]).to(DEVICE)
    with launch_override(fp8_quant_kernel, None, hw_cvt=True):
        q, s = fp8_quant_kernel.quantize_rows_kernel(y[None, :])
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8)[0], y.to(FP8).view(torch.uint8))


def test_quant_hw_cvt_refused_where_it_cannot_run():
    """On CPU (the interpreter rounds float8 stores wrongly) a forced hw_cvt is refused by name, before any work."""
    from swift_liger.ops import fp8_quant_kernel
    from swift_liger.ops._common import launch_override
    if fp8_quant_kernel.hw_cvt_supported(torch.device(DEVICE)):
        pytest.skip("hw_cvt runs on this device")
    with launch_override(fp8_quant_kernel, None, hw_cvt=True), pytest.raises(ValueError, match="hw_cvt needs"):
        fp8_quant_kernel.quantize_rows_kernel(torch.randn(3, 40, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_hw_cvt_follows_its_environment_variable_where_it_runs(value, on):
    """hw_cvt is on by default in the launch config of every device that can run it (an sm_89+ GPU, compiled);
    SWIFT_LIGER_FP8_HW_CVT=0 (read at import) turns it off. On CPU it is off either way: the reference backend and the
    interpreter keep the division."""
    env = {k: v for k, v in os.environ.items() if k != "SWIFT_LIGER_FP8_HW_CVT"}
    if value is not None:
        env["SWIFT_LIGER_FP8_HW_CVT"] = value
    code = ("import torch; from swift_liger.ops import fp8_quant_kernel as m; d = torch.device(%r); "
            "print(m.HW_CVT, m.launch_config(3584, d).hw_cvt, m.hw_cvt_supported(d))" % DEVICE)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    switch, cfg, supported = out.stdout.split()
    assert switch == str(on)
    assert cfg == str(on and supported == "True")


def test_quant_fast_reference_is_within_one_code_of_the_division():
    """quantize_rows_fast_torch (hw_cvt's reference) against the default rounding of v / scale: the same scales,
    and codes that differ by at most one step, rarely (only where v / scale and v * (1 / scale) round apart)."""
    from swift_liger.ops.fp8_linear_op import quantize_rows_torch
    from swift_liger.ops.fp8_linear_op import quantize_rows_fast_torch
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    q, s = quantize_rows_torch(x)
    q2, s2 = quantize_rows_fast_torch(x)
    assert torch.equal(s, s2)
    a, b = q.view(torch.uint8).int(), q2.view(torch.uint8).int()
    assert (a - b).abs().max() <= 1 and (a != b).float().mean() < 1e-3
