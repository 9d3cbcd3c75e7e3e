"""SwiGLU / GeGLU: Triton kernels (interpreter on CPU, compiled on GPU) against float64 references."""
import pytest
import torch
import torch.nn.functional as F

from helpers import DTYPES, TOL, assert_close, f64, inputs_unchanged, randn
from swift_liger.ops import swiglu_kernel as sw

# The interpreter evaluates sigmoid(-x) = 1 / (1 + exp(x)) in numpy: exp overflows to inf harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

OPS = {"swiglu": (sw.swiglu, sw.swiglu_reference), "geglu": (sw.geglu, sw.geglu_reference)}


def _run(fn, gate, up, d_out):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    with inputs_unchanged(gate, up, d_out):
        out = fn(gate, up)
        out.backward(d_out)
    return out, gate.grad, up.grad


def _check_vs_f64(name, gate, up, d_out, dtype):
    fn, ref = OPS[name]
    out, dg, du = _run(fn, gate, up, d_out)
    g64, u64 = f64(gate, True), f64(up, True)
    ref_out = ref(g64, u64)
    ref_out.backward(f64(d_out))
    assert out.dtype == dtype and out.is_contiguous() and out.device == gate.device
    assert_close(out, ref_out, dtype, name=f"{name} out")
    assert_close(dg, g64.grad, dtype, name=f"{name} d_gate")
    assert_close(du, u64.grad, dtype, name=f"{name} d_up")


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 320), (2, 5, 127), (3, 2500), (1, 96)])
def test_matches_float64(device, name, dtype, shape):
    gate = randn(*shape, dtype=dtype, device=device, scale=2.0)
    up = randn(*shape, dtype=dtype, device=device)
    d_out = randn(*shape, dtype=dtype, device=device)
    _check_vs_f64(name, gate, up, d_out, dtype)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [127, 2500])
def test_fused_gate_up_views(device, name, dtype, inter):
    """gate/up = halves of a fused [.., 2I] projection: strided rows, read in place, grads land in the fused grad."""
    fn, ref = OPS[name]
    gu = randn(2, 3, 2 * inter, dtype=dtype, device=device, scale=2.0, requires_grad=True)
    d_out = randn(2, 3, inter, dtype=dtype, device=device)
    gate, up = gu.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    with inputs_unchanged(gu):
        out = fn(gate, up)
        out.backward(d_out)
    gu64 = f64(gu, True)
    g64, u64 = gu64.chunk(2, dim=-1)
    ref_out = ref(g64, u64)
    ref_out.backward(f64(d_out))
    assert out.is_contiguous()
    assert_close(out, ref_out, dtype, name=f"{name} out")
    assert_close(gu.grad, gu64.grad, dtype, name=f"{name} d_gate_up")


@pytest.mark.parametrize("name", list(OPS))
def test_broadcast_grad_and_extreme_values(device, name):
    """out.sum().backward() gives a stride-0 d_out; |gate| up to 60 must not overflow to NaN."""
    fn, ref = OPS[name]
    gate = (torch.linspace(-60, 60, 7 * 130, dtype=torch.float64).reshape(7, 130)).float().to(device)
    up = randn(7, 130, device=device)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    fn(g, u).sum().backward()
    g64, u64 = f64(gate, True), f64(up, True)
    ref(g64, u64).sum().backward()
    assert_close(g.grad, g64.grad, torch.float32, name="d_gate")
    assert_close(u.grad, u64.grad, torch.float32, name="d_up")


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_close_to_hf_rounding(device, name, dtype):
    """The HF eager computation (activation rounded to dtype before the multiply) is within tolerance."""
    fn, ref = OPS[name]
    gate = randn(33, 200, dtype=dtype, device=device, scale=2.0)
    up = randn(33, 200, dtype=dtype, device=device)
    out = fn(gate, up)
    assert_close(out.float(), ref(gate, up).float(), dtype, slack=2.0, name="vs HF dtype")


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("fused", [False, True])
def test_inplace_backward(device, name, fused):
    """inplace_backward writes d_gate / d_up into the gate / up buffers; gradients match the default path."""
    fn, _ = OPS[name]
    dtype = torch.bfloat16
    x = randn(2, 5, 24, dtype=dtype, device=device)
    w = randn(24, 2 * 130, dtype=dtype, device=device, scale=0.3)
    d_out = randn(2, 5, 130, dtype=dtype, device=device)
    grads, d_gate = [], None
    for inplace in (False, True):
        w_ = w.clone().requires_grad_()
        if fused:
            gate, up = (x @ w_).chunk(2, dim=-1)
        else:
            gate, up = x @ w_[:, :130], x @ w_[:, 130:]
            gate.retain_grad()
        out = fn(gate, up, inplace_backward=inplace)
        out.backward(d_out)
        grads.append(w_.grad)
        if not fused and not inplace:
            d_gate = gate.grad
        if not fused and inplace:
            assert torch.equal(gate.detach(), d_gate)  # the gate buffer now holds d_gate
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)


def test_inplace_backward_detects_other_readers(device):
    """A second node that saved gate raises instead of silently reading the overwritten buffer."""
    w = randn(8, 16, device=device, requires_grad=True)
    gate = randn(4, 8, device=device) @ w
    up = randn(4, 16, device=device)
    other = (gate * gate).sum()  # created first, so its backward runs after swiglu's
    loss = sw.swiglu(gate, up, inplace_backward=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_one_input_needs_grad_and_no_grad(device):
    gate = randn(5, 64, device=device)
    up = randn(5, 64, device=device, requires_grad=True)
    sw.swiglu(gate, up).sum().backward()
    assert_close(up.grad, F.silu(f64(gate)), torch.float32, name="d_up")
    with torch.no_grad():
        out = sw.swiglu(gate, up)
    assert not out.requires_grad


def test_empty(device):
    gate = torch.empty(0, 64, device=device, requires_grad=True)
    up = torch.empty(0, 64, device=device, requires_grad=True)
    out = sw.swiglu(gate, up)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert gate.grad.shape == (0, 64)


def test_bad_inputs(device):
    g = randn(4, 8, device=device)
    with pytest.raises(TypeError, match="gate"):
        sw.swiglu(g.numpy() if device.type == "cpu" else [1.0], g)
    with pytest.raises(ValueError, match="up"):
        sw.swiglu(g, randn(4, 9, device=device))
    with pytest.raises(TypeError, match="up"):
        sw.geglu(g, g.half())
    with pytest.raises(TypeError, match="gate"):
        sw.swiglu(g.long(), g.long())
    with pytest.raises(ValueError, match="gate"):
        sw.swiglu(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))
    t = randn(8, 4, device=device).t()
    with pytest.raises(ValueError, match="gate"):
        sw.swiglu(t, t.contiguous())
    with pytest.raises(ValueError, match="up"):
        sw.swiglu(t.contiguous(), t)


def _recording_backend(seen):
    """aot_eager that records the ops of the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=record, bw_compiler=record)


@pytest.mark.parametrize("name", list(OPS))
def test_torch_compile_no_graph_break(device, name):
    fn, _ = OPS[name]

    def mlp(x, w):
        gu = x @ w
        gate, up = gu.chunk(2, dim=-1)
        return fn(gate, up).sum()

    x = randn(6, 16, device=device)
    w = randn(16, 2 * 40, device=device, requires_grad=True)
    seen = []
    compiled = torch.compile(mlp, fullgraph=True, backend=_recording_backend(seen))
    loss_c = compiled(x, w)
    loss_c.backward()
    grad_c = w.grad.clone()
    w.grad = None
    loss_e = mlp(x, w)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
    torch.testing.assert_close(grad_c, w.grad, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
    # The kernels stay single opaque nodes in both graphs.
    assert "swift_liger.glu_fwd.default" in seen and "swift_liger.glu_bwd.default" in seen, seen
