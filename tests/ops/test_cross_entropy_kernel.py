"""Cross-entropy on logits: Triton kernels (interpreter on CPU, compiled on GPU) against a float64 reference."""
import pytest
import torch
import torch.nn.functional as F

from helpers import DTYPES, TOL, assert_close, f64, inputs_unchanged, randn
from swift_liger.ops import cross_entropy_kernel as ce

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
IGNORE = -100
F32 = torch.float32


def _labels(n, v, device, ignore_every=3, dtype=torch.int64):
    y = torch.randint(0, v, (n,), dtype=dtype)
    if ignore_every:
        y[::ignore_every] = IGNORE
    return y.to(device)


def _run(logits, labels, grad=None, **kw):
    """Kernel loss and dlogits; checks the inputs are unchanged."""
    x = logits.detach().clone().requires_grad_()
    with inputs_unchanged(x, labels):
        out = ce.cross_entropy(x, labels, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward(grad)
    return out, x.grad


def _ref(logits, labels, grad=None, **kw):
    x = f64(logits, True)
    out = ce.cross_entropy_reference(x, labels.cpu(), **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(None if grad is None else f64(grad))
    return out, x.grad


def _compare(logits, labels, dtype, grad=None, loss_slack=1.0, **kw):
    (loss, dx), (ref_loss, ref_dx) = _run(logits, labels, grad, **kw), _ref(logits, labels, grad, **kw)
    assert loss.dtype == F32
    # The loss is fp32 arithmetic on exact inputs, whatever the logits dtype.
    assert_close(loss, ref_loss, F32, slack=loss_slack, name="loss")
    assert dx.dtype == dtype and dx.shape == logits.shape
    assert_close(dx, ref_dx, dtype, name="dlogits")
    return loss, dx


CASES = {
    "plain": {},
    "smooth": {"label_smoothing": 0.1},
    "softcap": {"softcap": 30.0},
    "zloss": {"z_loss": 1e-3},
    "all": {"label_smoothing": 0.1, "softcap": 30.0, "z_loss": 1e-3},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(37, 1000), (9, 4099)])
def test_matches_float64(device, case, dtype, n, v):
    logits = randn(n, v, dtype=dtype, device=device, scale=3.0)
    labels = _labels(n, v, device)
    # "sum" keeps dlogits O(softmax), so the tolerance is not dominated by a 1/N factor.
    _compare(logits, labels, dtype, reduction="sum", **CASES[case])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(device, reduction):
    n, v = 37, 1000
    logits = randn(n, v, device=device, scale=2.0)
    labels = _labels(n, v, device)
    grad = randn(n, device=device) if reduction == "none" else None
    loss, _ = _compare(logits, labels, F32, grad=grad, reduction=reduction, label_smoothing=0.1, z_loss=1e-4)
    if reduction == "none":
        assert loss.shape == (n,)
        assert torch.all(loss[::3] == 0)
    else:
        assert loss.dim() == 0


def test_large_vocab_several_blocks(device):
    """V > MAX_BLOCK_V so the online logsumexp merges several blocks, also on the GPU."""
    n, v = 4, 2 * ce.MAX_BLOCK_V + 123
    logits = randn(n, v, dtype=torch.bfloat16, device=device, scale=4.0)
    _compare(logits, _labels(n, v, device, ignore_every=0), torch.bfloat16, reduction="sum", label_smoothing=0.1,
             softcap=20.0)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_huge_logits(device, softcap):
    """Logits at +-1e4 (fp32): no overflow / NaN, with and without softcap."""
    n, v = 8, 1000
    logits = randn(n, v, device=device, scale=1e4)
    labels = _labels(n, v, device)
    loss, dx = _compare(logits, labels, F32, reduction="sum", softcap=softcap, z_loss=1e-4, label_smoothing=0.1)
    assert torch.isfinite(loss) and torch.isfinite(dx).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(device, reduction):
    n, v = 5, 300
    logits = randn(n, v, dtype=torch.bfloat16, device=device)
    labels = torch.full((n,), IGNORE, device=device)
    for kw in ({}, {"label_smoothing": 0.1, "softcap": 10.0, "z_loss": 1e-3}):
        grad = torch.ones(n, device=device) if reduction == "none" else None
        (loss, lse), dx = _run(logits, labels, grad, reduction=reduction, return_lse=True, **kw)
        # as F.cross_entropy: the mean over no tokens is NaN, the sum 0; the gradients 0 either way
        want = F.cross_entropy(logits.float().cpu(), labels.cpu(), reduction=reduction)
        assert torch.equal(loss.isnan().cpu(), want.isnan()) and bool((loss[~loss.isnan()] == 0).all()), (loss, kw)
        assert torch.all(dx == 0) and not dx.isnan().any(), kw
        assert torch.isfinite(lse).all()
    if reduction != "none":
        for nit in (0, torch.tensor(0, device=device)):   # transformers divides the sum by num_items: 0 / 0
            loss, dx = _run(logits, labels, reduction=reduction, num_items_in_batch=nit)
            assert loss.isnan() and torch.all(dx == 0) and not dx.isnan().any()


def test_single_row_and_single_valid(device):
    v = 777
    _compare(randn(1, v, device=device), torch.tensor([5], device=device), F32)
    labels = torch.full((11,), IGNORE, device=device)
    labels[7] = 42
    loss, dx = _compare(randn(11, v, device=device, scale=2.0), labels, F32, label_smoothing=0.1)
    assert torch.all(dx[torch.arange(11, device=device) != 7] == 0)


def test_micro_batches_with_num_items(device):
    """4 micro-batches of sum / num_items_in_batch add up to the mean over the whole batch (loss and grads)."""
    n, v = 36, 500
    logits = randn(n, v, device=device, scale=2.0)
    labels = _labels(n, v, device, ignore_every=4)
    labels[9:18] = IGNORE  # one micro-batch entirely ignored
    kw = {"label_smoothing": 0.05, "z_loss": 1e-4}
    full, full_dx = _run(logits, labels, **kw)
    n_items = int((labels != IGNORE).sum())
    for nit in (n_items, torch.tensor(n_items, device=device)):
        x = logits.clone().requires_grad_()
        total = sum(ce.cross_entropy(x[i:i + 9], labels[i:i + 9], reduction="sum", num_items_in_batch=nit, **kw)
                    for i in range(0, n, 9))
        total.backward()
        assert_close(total, full.detach(), F32, name="micro-batch loss")
        assert_close(x.grad, full_dx, F32, name="micro-batch grad")
    # num_items with reduction "mean" also means sum / num_items.
    loss, _ = _run(logits, labels, num_items_in_batch=2 * n_items, **kw)
    assert_close(loss, full.detach() / 2, F32, name="mean with num_items")


def test_return_lse_strided_and_3d(device):
    """Row-strided logits (a slice of a wider buffer), [B, T, V] with [B, T] labels, int32 labels, lse output."""
    b, t, v = 2, 7, 1001
    wide = randn(b, t, v + 13, dtype=torch.float16, device=device, scale=2.0)
    logits = wide[..., :v]
    labels = _labels(b * t, v, device, dtype=torch.int32).view(b, t)
    grad = randn(b, t, device=device)
    (loss, lse), dx = _run(logits, labels, grad, reduction="none", return_lse=True, softcap=15.0)
    (ref_loss, ref_lse), ref_dx = _ref(logits, labels, grad, reduction="none", return_lse=True, softcap=15.0)
    assert loss.shape == (b, t) and lse.shape == (b, t) and lse.dtype == F32 and not lse.requires_grad
    assert_close(loss, ref_loss, F32, name="loss")
    assert_close(lse, ref_lse, F32, name="lse (every row, ignored included)")
    assert_close(dx, ref_dx, torch.float16, name="dlogits")


def test_inplace_backward(device):
    n, v = 13, 640
    logits = randn(n, v, dtype=torch.bfloat16, device=device, scale=2.0)
    labels = _labels(n, v, device)
    _, ref_dx = _run(logits, labels, softcap=30.0, label_smoothing=0.1)
    w = torch.ones((), dtype=torch.bfloat16, device=device, requires_grad=True)
    base = logits.clone().requires_grad_()
    x = base * w  # a non-leaf buffer that nothing else reads afterwards
    ce.cross_entropy(x, labels, softcap=30.0, label_smoothing=0.1, inplace_backward=True).backward()
    assert_close(base.grad, ref_dx.float(), torch.bfloat16, name="inplace dlogits")
    assert torch.equal(x.detach(), base.grad * w.detach())  # the logits buffer now holds the gradient


def test_out_of_range_labels_unvalidated_give_nan_loss_and_no_gradient(device):
    """Unchecked out-of-range labels are never read out of bounds: token loss NaN (as the fused linear CE), zero
    gradient; ignored rows 0. Checked (CPU always, CUDA with validate_labels=True): a ValueError."""
    n, v = 6, 200
    logits = randn(n, v, device=device, requires_grad=True)
    labels = torch.tensor([3, v, -7, 10 * v, IGNORE, 199], device=device)
    loss, _ = ce.CrossEntropyFunction.apply(logits, labels, IGNORE, 0.0, None, 0.0, False, False)
    loss.sum().backward()
    assert torch.isnan(loss[1:4]).all() and loss[4] == 0 and torch.all(logits.grad[1:5] == 0)
    with pytest.raises(ValueError, match="labels"):
        ce.cross_entropy(logits, labels, validate_labels=True)
    mean = ce.cross_entropy(logits, labels, validate_labels=False) if device.type == "cuda" else None
    assert mean is None or torch.isnan(mean)
    ref = ce.cross_entropy_reference(f64(logits)[[0, 5]], labels[[0, 5]].cpu(), reduction="none")
    assert_close(loss[[0, 5]], ref[[0, 1]], F32)


def test_bad_inputs(device):
    logits = randn(4, 10, device=device)
    labels = torch.tensor([1, 2, IGNORE, 3], device=device)
    bad = [
        # out of range: checked by default on CPU only (a host sync on CUDA), so asked for here
        (ValueError, "labels", dict(labels=torch.tensor([1, 2, 10, 3], device=device), validate_labels=True)),
        (ValueError, "labels", dict(labels=torch.tensor([1, -2, 0, 3], device=device), validate_labels=True)),
        (TypeError, "labels", dict(labels=labels.float())),
        (ValueError, "labels", dict(labels=labels[:3])),
        (ValueError, "logits", dict(logits=randn(10, device=device), labels=labels[:1].reshape(()))),
        (TypeError, "logits", dict(logits=logits.long())),
        (ValueError, "logits", dict(logits=randn(10, 4, device=device).t())),
        (ValueError, "reduction", dict(reduction="avg")),
        (ValueError, "label_smoothing", dict(label_smoothing=1.5)),
        (ValueError, "label_smoothing", dict(label_smoothing=-0.1)),
        (ValueError, "softcap", dict(softcap=0.0)),
        (ValueError, "softcap", dict(softcap=-5.0)),
        (ValueError, "z_loss", dict(z_loss=-1.0)),
        (ValueError, "num_items_in_batch", dict(reduction="none", num_items_in_batch=3)),
        (ValueError, "num_items_in_batch", dict(num_items_in_batch=-1)),
        (TypeError, "ignore_index", dict(ignore_index=1.5)),
    ]
    for exc, word, override in bad:
        kw = {"logits": logits, "labels": labels, **override}
        with pytest.raises(exc, match=word):
            ce.cross_entropy(kw.pop("logits"), kw.pop("labels"), **kw)


def _recording_backend(seen):
    """aot_eager that records the ops of the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=record, bw_compiler=record)


def test_torch_compile_no_graph_break(device):
    n, v = 12, 300
    labels = _labels(n, v, device)
    nit = torch.tensor(7, device=device)

    def f(h, w, y):
        logits = (h @ w).to(torch.bfloat16)
        return ce.cross_entropy(logits, y, label_smoothing=0.1, softcap=30.0, z_loss=1e-4, num_items_in_batch=nit)

    h = randn(n, 16, device=device)
    w = randn(16, v, device=device, requires_grad=True)
    seen = []
    compiled = torch.compile(f, fullgraph=True, backend=_recording_backend(seen))
    loss_c = compiled(h, w, labels)
    loss_c.backward()
    grad_c = w.grad.clone()
    w.grad = None
    loss_e = f(h, w, labels)
    loss_e.backward()
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(loss_c, loss_e, atol=TOL[F32][0], rtol=TOL[F32][1])
    torch.testing.assert_close(grad_c, w.grad, atol=atol, rtol=rtol)
    # The kernels stay single opaque nodes in both graphs.
    assert "swift_liger.cross_entropy_fwd.default" in seen and "swift_liger.cross_entropy_bwd.default" in seen, seen
