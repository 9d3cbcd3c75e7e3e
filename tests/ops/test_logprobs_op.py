"""Fused linear log-probs: Triton (interpreter on CPU) and the CPU reference backend vs a float64 reference."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import helpers
from helpers import assert_close, f64, inputs_unchanged, randn
from swift_liger.ops.logprobs_op import LogprobsOutput, fused_linear_logprobs, fused_linear_logprobs_reference

from swift_liger.ops import fused_linear_cross_entropy_kernel as flce_mod

# N and V are not multiples of any block or chunk; chunk 16 gives 3 token chunks and 3 vocab slices in backward.
N, H, V, CHUNK = 37, 48, 1001, 16
SLACK = helpers.REDUCTION_SLACK


def make(device, dtype=torch.float32, n=N, bias=False, w_grad=False, h_scale=1.0, ignore_every=5):
    hidden = randn(n, H, dtype=dtype, device=device, scale=h_scale, requires_grad=True)
    weight = randn(V, H, dtype=dtype, device=device, scale=H ** -0.5, requires_grad=w_grad)
    b = randn(V, dtype=dtype, device=device, scale=0.5, requires_grad=w_grad) if bias else None
    labels = torch.randint(0, V, (n,), device=device)
    if ignore_every:
        labels[1::ignore_every] = -100
    return hidden, weight, b, labels


def float64_logprobs(hidden, weight, b, labels, softcap=None, temperature=1.0):
    """Written out from the definition (not through the op's own reference): log_softmax then gather."""
    leaves = [f64(t) if t is not None else None for t in (hidden, weight, b)]
    z = leaves[0] @ leaves[1].t()
    if b is not None:
        z = z + leaves[2]
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    y = labels.cpu()
    valid = y != -100
    logp = torch.log_softmax(z, -1).gather(-1, torch.where(valid, y, 0)[:, None]).squeeze(-1)
    return torch.where(valid, logp, 0.0), z.detach().sum(-1), leaves


def check(device, dtype, *, bias=False, w_grad=False, softcap=None, temperature=1.0, **kw):
    hidden, weight, b, labels = make(device, dtype, bias=bias, w_grad=w_grad, **kw)
    g = randn(N, device=device)   # an arbitrary gradient per token
    with inputs_unchanged(*[t for t in (hidden, weight, b, labels) if t is not None]):
        out = fused_linear_logprobs(hidden, weight, labels, b, softcap=softcap, temperature=temperature,
                                    return_logit_sum=True, chunk_size=CHUNK)
        (out.logps * g).sum().backward()
    ref, ref_sum, leaves = float64_logprobs(hidden, weight, b, labels, softcap, temperature)
    assert isinstance(out, LogprobsOutput) and out.logps.dtype == out.logit_sum.dtype == torch.float32
    assert_close(out.logps, ref, dtype, name="logps")
    assert_close(out.logit_sum, ref_sum, dtype, slack=SLACK, name="logit_sum")
    assert bool((out.logps[1::5] == 0).all()) and not out.logit_sum.requires_grad
    (ref * g.cpu().double()).sum().backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, b), leaves):
        if t is not None and t.requires_grad:
            assert_close(t.grad, r.grad, dtype, slack=1.0 if name == "hidden" else SLACK, name=f"grad_{name}")
    return out


@pytest.mark.parametrize("dtype", helpers.DTYPES, ids=str)
@pytest.mark.parametrize("w_grad", [False, True], ids=["frozen_w", "trainable_w"])
def test_matches_float64(device, dtype, w_grad):
    check(device, dtype, bias=True, w_grad=w_grad)


@pytest.mark.parametrize("opts", [dict(softcap=3.0), dict(temperature=0.7), dict(softcap=5.0, temperature=1.3)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_softcap_and_temperature(device, opts):
    check(device, torch.float32, w_grad=True, **opts)


def test_reference_backend(device, monkeypatch):
    """The CPU fallback users without CUDA run (SWIFT_LIGER_BACKEND=torch there, the default on CPU)."""
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    out = check(device, torch.float32, bias=True, w_grad=True, softcap=4.0, temperature=0.9)
    assert isinstance(out, LogprobsOutput)


def float64_entropy(hidden, weight, b, softcap=None, temperature=1.0):
    z = f64(hidden).detach() @ f64(weight).detach().t()
    if b is not None:
        z = z + f64(b).detach()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("opts", [dict(), dict(softcap=4.0, temperature=0.7), dict(h_scale=40.0, temperature=1.5)],
                         ids=["plain", "softcap_temp", "peaked"])
def test_entropy(device, monkeypatch, backend, opts):
    """return_entropy: every position's entropy of the softmax the log-probs come from (ignored labels included),
    no gradient, beside unchanged log-probs and their gradient. "peaked": logits in the hundreds, most rows near
    one-hot (entropy ~0) where lse - E_p[z] cancels."""
    if backend == "torch":
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    h_scale = opts.pop("h_scale", 1.0)
    hidden, weight, b, labels = make(device, bias=True, h_scale=h_scale)
    g = randn(N, device=device)
    with inputs_unchanged(hidden, weight, b, labels):
        out = fused_linear_logprobs(hidden, weight, labels, b, return_entropy=True, chunk_size=CHUNK, **opts)
        (out.logps * g).sum().backward()
    assert isinstance(out, LogprobsOutput) and out.logit_sum is None
    assert out.entropy.shape == labels.shape and out.entropy.dtype == torch.float32 and not out.entropy.requires_grad
    ref_ent = float64_entropy(hidden, weight, b, **opts)
    assert_close(out.entropy, ref_ent, torch.float32, slack=SLACK, name="entropy")
    ref, _, leaves = float64_logprobs(hidden, weight, b, labels, **opts)
    assert_close(out.logps, ref, torch.float32, name="logps")
    (ref * g.cpu().double()).sum().backward()
    assert_close(hidden.grad, leaves[0].grad, torch.float32, name="grad_hidden")
    with torch.no_grad():   # the forward-only launch (old policy / reference passes); arg max from the same pass
        both = fused_linear_logprobs(hidden, weight, labels, b, return_entropy=True, return_logit_sum=True,
                                     return_argmax=True, chunk_size=CHUNK, **opts)
    assert_close(both.entropy, ref_ent, torch.float32, slack=SLACK, name="entropy_no_grad")
    assert both.logit_sum is not None and both.argmax.dtype == torch.int64
    z = f64(hidden).detach() @ f64(weight).t() + f64(b)
    assert torch.equal(both.argmax.cpu(), z.argmax(-1))


def test_no_grad_and_plain_return(device):
    hidden, weight, _, labels = make(device)
    with torch.no_grad():
        logps = fused_linear_logprobs(hidden, weight, labels, chunk_size=CHUNK)
    ref, _, _ = float64_logprobs(hidden, weight, None, labels)
    assert torch.is_tensor(logps) and not logps.requires_grad
    assert_close(logps, ref, torch.float32, name="logps")


def test_batched_shape_and_several_uses(device):
    """[B, T, H] in, [B, T] out; the gradient of a sequence sum plus a masked mean (DPO + an NLL term)."""
    hidden, weight, _, labels = make(device, n=2 * 19)
    hidden3 = hidden.detach().view(2, 19, H).requires_grad_(True)
    labels2 = labels.view(2, 19)
    logps = fused_linear_logprobs(hidden3, weight, labels2, chunk_size=CHUNK)
    mask = labels2 != -100
    loss = torch.nn.functional.logsigmoid(logps.sum(-1)[0] - logps.sum(-1)[1]) - logps[0][mask[0]].mean()
    loss.backward()
    ref, _, (h64, _, _) = float64_logprobs(hidden3.view(-1, H), weight, None, labels)
    ref = ref.view(2, 19)
    ref_loss = torch.nn.functional.logsigmoid(ref.sum(-1)[0] - ref.sum(-1)[1]) - ref[0][mask[0].cpu()].mean()
    ref_loss.backward()
    assert logps.shape == (2, 19)
    assert_close(hidden3.grad.view(-1, H), h64.grad, torch.float32, name="grad_hidden")


def test_frozen_weight_does_no_dw_work(device, monkeypatch):
    calls = {}
    for name in ("_gemm_logits", "_gemm_dh", "_gemm_dw", "_gemm_dw_acc"):
        fn = getattr(flce_mod, name)
        monkeypatch.setattr(flce_mod, name, lambda *a, _n=name, _f=fn, **k: (calls.__setitem__(_n, calls.get(_n, 0)
                                                                                                + 1), _f(*a, **k))[1])
    hidden, weight, _, labels = make(device)
    fused_linear_logprobs(hidden, weight, labels, chunk_size=CHUNK).sum().backward()
    assert calls == {"_gemm_logits": 3, "_gemm_dh": 3}   # 3 token chunks, no dW GEMM, no recompute
    calls.clear()
    weight.requires_grad_(True)
    fused_linear_logprobs(hidden, weight, labels, chunk_size=CHUNK).sum().backward()
    assert calls["_gemm_dw"] == calls["_gemm_logits"] - 3 > 0 and "_gemm_dw_acc" not in calls


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_never_materialises_all_logits(device):
    """No tensor with the vocabulary as last dimension over more rows than one workspace chunk, forward or backward.
    (The reference does create [N, V]: the check can see it.)"""
    hidden, weight, _, labels = make(device, w_grad=True)
    with _Shapes() as seen:
        fused_linear_logprobs(hidden, weight, labels, chunk_size=CHUNK).sum().backward()
    rows_with_v = [s for s in seen.shapes if len(s) >= 2 and s[-1] == V and s != (H, V)]   # (H, V): weight.t()
    assert rows_with_v and max(s[0] for s in rows_with_v) <= CHUNK, rows_with_v
    with _Shapes() as seen:
        fused_linear_logprobs_reference(hidden, weight, labels).sum().backward()
    assert (N, V) in seen.shapes


def test_matches_cross_entropy_op(device):
    """-logps equals the fused linear CE's per-token loss (same kernels, one shared definition)."""
    from swift_liger.ops.fused_linear_cross_entropy_kernel import fused_linear_cross_entropy
    hidden, weight, _, labels = make(device)
    with torch.no_grad():
        logps = fused_linear_logprobs(hidden, weight, labels, chunk_size=CHUNK)
        ce = fused_linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_size=CHUNK)
    assert torch.equal(-logps, ce)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(softcap=-1.0), "softcap"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_options(device, kwargs, match):
    hidden, weight, _, labels = make(device)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprobs(hidden, weight, labels, **kwargs)


def test_bad_tensors(device):
    hidden, weight, _, labels = make(device)
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_linear_logprobs(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_linear_logprobs(hidden, weight[:, :-1], labels)
    with pytest.raises(TypeError, match="labels must have dtype"):
        fused_linear_logprobs(hidden, weight, labels.float())
    bad = labels.clone()
    bad[0] = V
    if not bad.is_cuda:
        with pytest.raises(ValueError, match="labels must be in"):
            fused_linear_logprobs(hidden, weight, bad)
