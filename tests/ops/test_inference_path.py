"""Inputs autograd does not record (no_grad, or nothing requires grad): the ops call their forward launchers
directly, no torch.autograd.Function, with outputs bit-equal to the recorded path's (the same kernel runs)."""
import pytest
import torch

from swift_liger.ops import qk_norm_rope_kernel, rms_norm_kernel, rope_kernel as rope, swiglu_kernel

BF16 = torch.bfloat16


def _no_function(monkeypatch, *functions):
    """Make every listed autograd.Function fail if applied; returns the call log."""
    calls = []
    for fn in functions:
        monkeypatch.setattr(fn, "apply", lambda *a, fn=fn: calls.append(fn.__name__) or (_ for _ in ()).throw(
            AssertionError(f"{fn.__name__}.apply ran for inputs autograd does not record")))
    return calls


def _rope_inputs(device, b=2, t=5, hq=4, hk=2, d=16):
    q = torch.randn(b, t, hq, d, device=device, dtype=BF16).transpose(1, 2)
    k = torch.randn(b, t, hk, d, device=device, dtype=BF16).transpose(1, 2)
    ang = torch.randn(b, t, d // 2, device=device).repeat(1, 1, 2)
    return q, k, ang.cos().to(BF16), ang.sin().to(BF16)


CASES = {
    "rms_norm": (lambda dev: (torch.randn(3, 7, 40, device=dev, dtype=BF16),
                              1 + 0.1 * torch.randn(40, device=dev, dtype=BF16)),
                 lambda x, w: rms_norm_kernel.rms_norm(x, w, 1e-6), [rms_norm_kernel.RMSNormFunction]),
    "rms_norm_residual": (lambda dev: (torch.randn(3, 7, 40, device=dev, dtype=BF16),
                                       1 + 0.1 * torch.randn(40, device=dev, dtype=BF16),
                                       torch.randn(3, 7, 40, device=dev, dtype=BF16)),
                          lambda x, w, r: rms_norm_kernel.rms_norm(x, w, 1e-6, residual=r),
                          [rms_norm_kernel.RMSNormFunction]),
    "rope": (_rope_inputs, lambda q, k, c, s: rope.apply_rope(q, k, c, s), [rope.RoPEFunction]),
    "qk_norm_rope": (lambda dev: (*_rope_inputs(dev)[:2], 1 + 0.1 * torch.randn(16, device=dev, dtype=BF16),
                                  1 + 0.1 * torch.randn(16, device=dev, dtype=BF16), *_rope_inputs(dev)[2:]),
                     lambda q, k, wq, wk, c, s: qk_norm_rope_kernel.qk_norm_rope(q, k, wq, wk, c, s),
                     [qk_norm_rope_kernel.QKNormRoPEFunction]),
    "swiglu": (lambda dev: (torch.randn(6, 48, device=dev, dtype=BF16), torch.randn(6, 48, device=dev, dtype=BF16)),
               lambda a, b: swiglu_kernel.swiglu(a, b, inplace_backward=True), [swiglu_kernel.SwiGLUFunction]),
    "geglu": (lambda dev: (torch.randn(6, 48, device=dev, dtype=BF16), torch.randn(6, 48, device=dev, dtype=BF16)),
              lambda a, b: swiglu_kernel.geglu(a, b), [swiglu_kernel.GeGLUFunction]),
}


def _leaves(name, inputs):
    """Copies of the inputs, those autograd differentiates requiring grad (not RoPE's cos/sin: HF builds them
    under no_grad, and with a gradient the ops take the reference path)."""
    n = 2 if name == "rope" else 4 if name == "qk_norm_rope" else len(inputs)
    return [t.detach().clone().requires_grad_(i < n) for i, t in enumerate(inputs)]


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_forward_without_autograd_equals_the_recorded_path(device, name, mode, monkeypatch):
    make, op, functions = CASES[name]
    inputs = make(device)
    # the recorded path: inputs that require grad (copies, so the op sees the same values)
    leaves = _leaves(name, inputs)
    want = [o.detach() for o in _flat(op(*leaves))]
    assert all(o.grad_fn is not None for o in _flat(op(*leaves)))
    pristine = [t.clone() for t in inputs]
    calls = _no_function(monkeypatch, *functions)
    if mode == "no_grad":
        with torch.no_grad():
            got = _flat(op(*_leaves(name, inputs)))
    else:
        got = _flat(op(*inputs))
    assert calls == []
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.grad_fn is None and not g.requires_grad
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
        assert torch.equal(g, w), name
    for t, p in zip(inputs, pristine):   # inputs untouched
        assert torch.equal(t, p)
