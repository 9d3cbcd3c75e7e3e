"""Fused linear cross-entropy: Triton (interpreter on CPU) vs a float64 HF-style reference."""

import contextlib

import pytest
import torch

import helpers
from helpers import assert_close, f64, inputs_unchanged, randn
from swift_liger.ops import _common
from swift_liger.ops import fused_linear_cross_entropy_kernel as flce_mod
from swift_liger.ops.fused_linear_cross_entropy_kernel import (FLCEOutput, fused_linear_cross_entropy,
                                                                fused_linear_cross_entropy_reference)

# N and V are not multiples of any block or chunk; chunk 16 gives 3 token chunks and 3 vocab slices.
N, H, V, CHUNK = 37, 48, 1001, 16
SLACK = helpers.REDUCTION_SLACK


def make(device, dtype=torch.float32, n=N, h=H, v=V, bias=False, w_grad=True, h_scale=1.0, ignore_every=5):
    hidden = randn(n, h, dtype=dtype, device=device, scale=h_scale, requires_grad=True)
    weight = randn(v, h, dtype=dtype, device=device, scale=h ** -0.5, requires_grad=w_grad)
    b = randn(v, dtype=dtype, device=device, scale=0.5, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (n,), device=device)
    if ignore_every:
        labels[1::ignore_every] = -100
    return hidden, weight, b, labels


def reference(hidden, weight, b, labels, **kw):
    """float64 reference: returns (output, leaf copies)."""
    leaves = [f64(t) if t is not None else None for t in (hidden, weight, b)]
    out = fused_linear_cross_entropy_reference(leaves[0], leaves[1], labels.cpu(), leaves[2], **kw)
    return out, leaves


def check_grads(tensors, leaves, dtype):
    for name, t, r in zip(("hidden", "weight", "bias"), tensors, leaves):
        if t is None or not t.requires_grad:
            continue
        slack = 1.0 if name == "hidden" else SLACK
        assert_close(t.grad, r.grad, dtype, slack=slack, name=f"grad_{name}")


def run_both(hidden, weight, b, labels, dtype, grad_out=None, **kw):
    with inputs_unchanged(*[t for t in (hidden, weight, b, labels) if t is not None]):
        out = fused_linear_cross_entropy(hidden, weight, labels, b, **kw)
    ref, leaves = reference(hidden, weight, b, labels, **{k: v for k, v in kw.items()
                                                          if k not in ("chunk_size", "dw_strategy")})
    loss, rloss = (out.loss, ref.loss) if isinstance(out, FLCEOutput) else (out, ref)
    assert loss.dtype == torch.float32
    assert_close(loss, rloss, dtype, name="loss")
    g = torch.ones_like(loss) if grad_out is None else grad_out
    loss.backward(g)
    rloss.backward(g.detach().cpu().double())
    check_grads((hidden, weight, b), leaves, dtype)
    return out, ref


@pytest.mark.parametrize("dtype", helpers.DTYPES, ids=str)
@pytest.mark.parametrize("strategy", ["accumulate", "accumulate_lowp", "recompute"])
def test_matches_reference(device, dtype, strategy):
    hidden, weight, b, labels = make(device, dtype, bias=True)
    run_both(hidden, weight, b, labels, dtype, chunk_size=CHUNK, dw_strategy=strategy)


@pytest.mark.parametrize("opts", [
    dict(label_smoothing=0.1),
    dict(z_loss=1e-2),
    dict(softcap=3.0),
    dict(label_smoothing=0.2, z_loss=1e-3, softcap=5.0, ignore_index=7),
    dict(reduction="sum"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options(device, opts):
    hidden, weight, b, labels = make(device, bias=True)
    if opts.get("ignore_index") == 7:
        labels[labels == -100] = 11
        labels[::4] = 7
    run_both(hidden, weight, b, labels, torch.float32, chunk_size=CHUNK, **opts)


@pytest.mark.parametrize("strategy", ["accumulate", "recompute"])
def test_reduction_none_and_token_loss_grad(device, strategy):
    hidden, weight, b, labels = make(device, bias=True)
    g = randn(N, device=device)
    out, ref = run_both(hidden, weight, b, labels, torch.float32, grad_out=g, reduction="none", chunk_size=CHUNK,
                        dw_strategy=strategy, label_smoothing=0.1)
    assert out.shape == (N,) and bool((out[1::5] == 0).all())

    # A gradient through token_loss on top of the mean (log-prob style losses): per-row scales + accumulated dW.
    hidden, weight, b, labels = make(device, bias=True)
    out = fused_linear_cross_entropy(hidden, weight, labels, b, chunk_size=CHUNK, dw_strategy=strategy,
                                     return_token_loss=True, return_lse=True)
    ref, leaves = reference(hidden, weight, b, labels, return_token_loss=True, return_lse=True)
    assert_close(out.token_loss, ref.token_loss, torch.float32, name="token_loss")
    assert_close(out.lse, ref.lse, torch.float32, name="lse")
    assert not out.lse.requires_grad
    (out.loss + (out.token_loss * g).sum()).backward()
    (ref.loss + (ref.token_loss * g.cpu().double()).sum()).backward()
    check_grads((hidden, weight, b), leaves, torch.float32)


def test_token_loss_and_lse_values(device):
    hidden, weight, _, labels = make(device, dtype=torch.bfloat16)
    out = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, return_token_loss=True,
                                     return_lse=True)
    ref, _ = reference(hidden, weight, None, labels, return_token_loss=True, return_lse=True)
    for name in ("loss", "token_loss", "lse"):
        assert_close(getattr(out, name), getattr(ref, name), torch.bfloat16, name=name)
    assert bool((out.token_loss[1::5] == 0).all())
    # log p[label] = z[label] - lse, the quantity preference losses need
    z = (hidden.detach().double() @ weight.detach().double().t()).cpu()
    valid = labels.cpu() != -100
    logp = z[valid].gather(1, labels.cpu()[valid][:, None]).squeeze(1) - out.lse.cpu().double()[valid]
    assert_close(-logp, out.token_loss.cpu().double()[valid], torch.bfloat16, name="logp")
    only_lse = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, return_lse=True)
    assert only_lse.token_loss is None and only_lse.lse is not None


def test_single_token_and_one_valid_label(device):
    hidden, weight, b, labels = make(device, n=1, bias=True, ignore_every=0)
    run_both(hidden, weight, b, labels, torch.float32)
    hidden, weight, b, labels = make(device, bias=True)
    labels.fill_(-100)
    labels[20] = 3
    run_both(hidden, weight, b, labels, torch.float32, chunk_size=CHUNK)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored(device, reduction):
    hidden, weight, b, labels = make(device, bias=True)
    labels.fill_(-100)
    kw = dict(num_items_in_batch=torch.tensor(0, device=device)) if reduction == "mean" else {}
    for extra in ({}, kw):
        for t in (hidden, weight, b):
            t.grad = None
        loss = fused_linear_cross_entropy(hidden, weight, labels, b, chunk_size=CHUNK, reduction=reduction, **extra)
        loss.backward()
        # as torch / transformers: a mean (or a division by num_items 0) over no tokens is NaN, a sum 0; the
        # gradients are 0 either way
        assert loss.isnan() if (reduction == "mean" or extra) else loss.item() == 0.0
        for t in (hidden, weight, b):
            assert not torch.isnan(t.grad).any() and bool((t.grad == 0).all())


def test_no_tokens(device):
    hidden, weight, _, labels = make(device, n=0)
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()   # the mean over no tokens: NaN, as F.cross_entropy's
    assert loss.isnan() and bool((weight.grad == 0).all()) and hidden.grad.shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_huge_logits(device, dtype, softcap):
    # |z| ~ 1e4: a naive exp overflows, the online max must not.
    hidden, weight, _, labels = make(device, dtype, h_scale=1500.0)
    out, _ = run_both(hidden, weight, None, labels, dtype, chunk_size=CHUNK, softcap=softcap,
                      return_token_loss=True, return_lse=True)
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(hidden.grad).all()


def test_micro_batches_equal_one_batch(device):
    hidden, weight, b, labels = make(device, n=40, bias=True)
    labels[:10] = -100   # uneven valid counts per micro-batch
    n_items = int((labels != -100).sum())
    big = fused_linear_cross_entropy(hidden, weight, labels, b, chunk_size=CHUNK)
    big.backward()
    grads = [t.grad.clone() for t in (hidden, weight, b)]
    for t in (hidden, weight, b):
        t.grad = None
    total = 0.0
    for i in range(4):
        sl = slice(10 * i, 10 * i + 10)
        nib = n_items if i % 2 else torch.tensor(n_items, device=device)
        loss = fused_linear_cross_entropy(hidden[sl], weight, labels[sl], b, chunk_size=4, num_items_in_batch=nib)
        loss.backward()
        total = total + loss.detach()
    assert_close(total, big.detach().cpu().double(), torch.float32, name="loss")
    for name, t, g in zip(("hidden", "weight", "bias"), (hidden, weight, b), grads):
        assert_close(t.grad, g.cpu().double(), torch.float32, slack=SLACK, name=name)


class GemmCounter:
    def __init__(self, monkeypatch):
        self.calls = {}
        for name in ("_gemm_logits", "_gemm_dh", "_gemm_dw", "_gemm_dw_acc"):
            monkeypatch.setattr(flce_mod, name, self._wrap(name, getattr(flce_mod, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("strategy,expected", [
    ("frozen", {"_gemm_logits": 3, "_gemm_dh": 3}),
    ("accumulate", {"_gemm_logits": 3, "_gemm_dh": 3, "_gemm_dw_acc": 3}),
    ("accumulate_lowp", {"_gemm_logits": 3, "_gemm_dh": 3, "_gemm_dw_acc": 3}),
    ("recompute", {"_gemm_logits": 3 + 3, "_gemm_dh": 3, "_gemm_dw": 3}),
])
def test_gemm_count(device, monkeypatch, strategy, expected):
    counter = GemmCounter(monkeypatch)
    hidden, weight, _, labels = make(device, w_grad=strategy != "frozen")
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK,
                                      dw_strategy="auto" if strategy == "frozen" else strategy)
    loss.backward()
    assert counter.calls == expected
    assert (weight.grad is None) == (strategy == "frozen")
    ref, leaves = reference(hidden, weight, None, labels)
    ref.backward()
    check_grads((hidden, weight), leaves, torch.float32)


def test_auto_and_hybrid_dw(device, monkeypatch):
    hidden, weight, b, labels = make(device, bias=True)
    assert flce_mod._resolve_dw_rows("auto", V, H, "mean") == V   # small head: accumulate
    assert flce_mod._resolve_dw_rows("auto", 128256, 4096, "mean") == 0
    # Accumulate the first 300 vocab rows, recompute the rest.
    monkeypatch.setattr(flce_mod, "_resolve_dw_rows", lambda *a: 300)
    run_both(hidden, weight, b, labels, torch.float32, chunk_size=CHUNK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_accumulate_lowp_grad_is_the_buffer_in_the_weight_dtype(device, dtype, monkeypatch):
    """accumulate_lowp keeps one [V, H] buffer in the weight's dtype through pass 1 and hands it back, scaled in
    place, as the weight's gradient (no second [V, H] allocation in backward, no fp32 buffer)."""
    made = []
    new_empty = flce_mod._common.new_empty

    def spy(shape, *args, **kwargs):
        t = new_empty(shape, *args, **kwargs)
        made.append((tuple(shape), t.dtype, t.data_ptr()))
        return t
    monkeypatch.setattr(flce_mod._common, "new_empty", spy)
    hidden, weight, _, labels = make(device, dtype)
    fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, dw_strategy="accumulate_lowp").backward(
        torch.tensor(0.5, device=device))
    vh = [m for m in made if m[0] == (V, H)]
    assert [(m[1]) for m in vh] == [dtype], made    # one [V, H] buffer, in the weight's dtype
    assert weight.grad.dtype == dtype and weight.grad.data_ptr() == vh[0][2]
    ref, leaves = reference(hidden, weight, None, labels)
    (ref * 0.5).backward()
    assert_close(weight.grad, leaves[1].grad, dtype, slack=SLACK, name="grad_weight")


def test_strategies_agree(device):
    grads = []
    for strategy in ("accumulate", "recompute", "accumulate_lowp"):
        torch.manual_seed(7)
        hidden, weight, b, labels = make(device, torch.bfloat16, bias=True)
        fused_linear_cross_entropy(hidden, weight, labels, b, chunk_size=CHUNK, dw_strategy=strategy,
                                   z_loss=1e-3).backward()
        grads.append((hidden.grad, weight.grad, b.grad))
    for other in grads[1:]:   # recompute and accumulate_lowp against the fp32 accumulator
        for a, r in zip(other, grads[0]):
            assert_close(a, r.double(), torch.bfloat16, slack=SLACK)


def test_batched_shape_no_grad_and_default_chunk(device):
    hidden = randn(2, 9, H, device=device, requires_grad=True)
    weight = randn(V, H, device=device, scale=H ** -0.5, requires_grad=True)
    labels = torch.randint(0, V, (2, 9), device=device)
    labels[0, :3] = -100
    out = fused_linear_cross_entropy(hidden, weight, labels, reduction="none", return_lse=True)
    ref, leaves = reference(hidden, weight, None, labels, reduction="none", return_lse=True)
    assert out.loss.shape == (2, 9) and out.lse.shape == (2, 9)
    assert_close(out.loss, ref.loss, torch.float32)
    out.loss.sum().backward()
    ref.loss.sum().backward()
    check_grads((hidden, weight), leaves, torch.float32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad
    assert_close(loss, ref.loss.sum() / 15, torch.float32)


def test_autocast_casts_like_linear(device):
    hidden, weight, _, labels = make(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK)
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    ref, leaves = reference(hidden, weight, None, labels)
    assert_close(loss, ref, torch.bfloat16)


def test_backward_twice_raises(device):
    hidden, weight, _, labels = make(device)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_out_of_range_labels(device):
    hidden, weight, _, labels = make(device)
    labels[4] = V
    with pytest.raises(ValueError, match="labels"):
        fused_linear_cross_entropy(hidden, weight, labels, validate_labels=True)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="labels"):
            fused_linear_cross_entropy(hidden, weight, labels)
    # Unchecked: never reads out of bounds; the token's loss is NaN and it gets no gradient.
    out = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, validate_labels=False,
                                     reduction="sum", return_token_loss=True)
    assert torch.isnan(out.loss) and torch.isnan(out.token_loss[4])
    assert torch.isfinite(out.token_loss[torch.arange(N, device=device) != 4]).all()
    out.loss.backward()
    assert torch.isfinite(hidden.grad).all() and bool((hidden.grad[4] == 0).all())


def test_bad_inputs(device):
    hidden, weight, b, labels = make(device, bias=True)
    f = fused_linear_cross_entropy
    cases = [
        (ValueError, "hidden", lambda: f(hidden[0], weight, labels[0])),
        (ValueError, "weight", lambda: f(hidden, weight[:, :-1], labels)),
        (ValueError, "weight", lambda: f(hidden, weight[:0], labels)),
        (ValueError, "labels", lambda: f(hidden, weight, labels[:-1])),
        (TypeError, "labels", lambda: f(hidden, weight, labels.float())),
        (ValueError, "bias", lambda: f(hidden, weight, labels, b[:-1])),
        (TypeError, "weight", lambda: f(hidden, weight.double(), labels)),
        (TypeError, "weight", lambda: f(hidden, weight.half(), labels)),
        (TypeError, "bias", lambda: f(hidden, weight, labels, b.half())),
        (ValueError, "reduction", lambda: f(hidden, weight, labels, reduction="avg")),
        (ValueError, "chunk_size", lambda: f(hidden, weight, labels, chunk_size=0)),
        (ValueError, "chunk_size", lambda: f(hidden, weight, labels, chunk_size=-3)),
        (ValueError, "dw_strategy", lambda: f(hidden, weight, labels, dw_strategy="fast")),
        (ValueError, "label_smoothing", lambda: f(hidden, weight, labels, label_smoothing=1.5)),
        (ValueError, "softcap", lambda: f(hidden, weight, labels, softcap=0.0)),
        (ValueError, "z_loss", lambda: f(hidden, weight, labels, z_loss=-1.0)),
        (ValueError, "num_items_in_batch", lambda: f(hidden, weight, labels, reduction="none", num_items_in_batch=3)),
        (TypeError, "ignore_index", lambda: f(hidden, weight, labels, ignore_index=1.5)),
    ]
    for exc, name, call in cases:
        with pytest.raises(exc, match=name):
            call()


@pytest.mark.parametrize("trainable", [True, False], ids=["W+bias", "frozen W"])
def test_torch_compile_fullgraph(device, trainable):
    hidden, weight, b, labels = make(device, bias=trainable, w_grad=trainable)
    leaves = [t for t in (hidden, weight, b) if t is not None and t.requires_grad]

    def fn(h, w, bb, y):
        return fused_linear_cross_entropy(h * 1.0, w, y, bb, chunk_size=CHUNK, label_smoothing=0.1)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss = compiled(hidden, weight, b, labels)
    loss.backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref = fn(hidden, weight, b, labels)
    ref.backward()
    assert_close(loss, ref.detach().double(), torch.float32)
    for g, t in zip(got, leaves):
        assert_close(g, t.grad.double(), torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("block_v", [None, 128], ids=["one_block", "8_blocks"])
def test_return_argmax(device, monkeypatch, backend, block_v):
    """return_argmax: every position's arg max over the logits (ignored labels included), as torch.argmax of the
    float64 logits, from the same pass; the loss and gradients are unchanged. Ties (duplicated weight rows, in
    the same block and across blocks) take the first column, as torch does. 8_blocks: BLOCK_V 128 over V=1001."""
    if backend == "torch":
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    hidden, weight, b, labels = make(device, bias=True, w_grad=False)
    with torch.no_grad():
        best = (hidden @ weight.t() + b).argmax(-1)
        for k, col in enumerate(best[:6].tolist()):   # copy each winner to a later column: an exact tie
            other = (col + 1 + 300 * (k % 3)) % V
            weight[other] = weight[col]
            b[other] = b[col]
    ctx = (_common.launch_override(flce_mod, "rows", block_v=block_v) if block_v else contextlib.nullcontext())
    with ctx, inputs_unchanged(hidden, weight, b, labels):
        out = fused_linear_cross_entropy(hidden, weight, labels, b, return_argmax=True, chunk_size=CHUNK)
        out.loss.backward()
    ref, leaves = reference(hidden, weight, b, labels)
    z = leaves[0].detach() @ leaves[1].t() + leaves[2]
    assert isinstance(out, FLCEOutput) and out.token_loss is None and out.lse is None
    assert out.argmax.dtype == torch.int64 and out.argmax.shape == labels.shape
    if hidden.is_cuda:   # a GPU GEMM may round two equal columns apart: ties only need the maximal value there
        picked = z.gather(-1, out.argmax.cpu()[:, None]).squeeze(-1)
        assert bool(((z.max(-1).values - picked) <= 1e-5).all()), (out.argmax, z.argmax(-1))
    else:
        assert torch.equal(out.argmax.cpu(), z.argmax(-1)), (out.argmax, z.argmax(-1))
    assert_close(out.loss, ref, torch.float32, slack=SLACK, name="loss")
    ref.backward()
    check_grads((hidden, weight, b), leaves, torch.float32)
