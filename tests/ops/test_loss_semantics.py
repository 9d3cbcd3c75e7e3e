"""cross_entropy and fused_linear_cross_entropy share one definition of the loss (ops/_loss.py): the same options,
label dtypes, reductions and num_items_in_batch rule give the same loss from logits and from hidden states."""
import pytest
import torch

from helpers import assert_close, randn
from swift_liger.ops.cross_entropy_kernel import cross_entropy
from swift_liger.ops.fused_linear_cross_entropy_kernel import fused_linear_cross_entropy

N, H, V = 29, 32, 257


@pytest.mark.parametrize("opts", [
    dict(reduction="mean"), dict(reduction="sum"), dict(reduction="none"),
    dict(reduction="mean", num_items_in_batch=40), dict(reduction="sum", num_items_in_batch=40),
    dict(reduction="mean", num_items_in_batch=torch.tensor(0)),
    dict(label_smoothing=1.0), dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8], ids=str)
def test_same_loss_from_logits_and_from_hidden(device, opts, label_dtype):
    hidden = randn(N, H, device=device)
    weight = randn(V, H, device=device, scale=H ** -0.5)
    labels = torch.randint(0, V if label_dtype is not torch.uint8 else 255, (N,), device=device)
    ignore = 255 if label_dtype is torch.uint8 else -100
    labels[::4] = ignore
    labels = labels.to(label_dtype)
    a = cross_entropy(hidden @ weight.t(), labels, ignore_index=ignore, **opts)
    b = fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore, chunk_size=8, **opts)
    assert a.shape == b.shape
    n_items = opts.get("num_items_in_batch")
    if isinstance(n_items, torch.Tensor) and n_items == 0:   # a mean over no tokens: NaN from both (ops/_loss.py)
        assert a.isnan() and b.isnan()
        return
    assert_close(b, a.double(), torch.float32, slack=4.0, name="loss")


@pytest.mark.parametrize("fn", ["cross_entropy", "fused_linear_cross_entropy"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(reduction="none", num_items_in_batch=3), "num_items_in_batch needs reduction 'mean' or 'sum'"),
    (dict(label_smoothing=1.5), r"label_smoothing must be a number in \[0, 1\]"),
    (dict(reduction="avg"), "reduction must be one of mean, sum, none"),
    (dict(z_loss=-1.0), "z_loss must be a number >= 0"),
])
def test_same_errors(device, fn, kwargs, match):
    hidden, weight = randn(4, H, device=device), randn(V, H, device=device)
    labels = torch.tensor([1, 2, -100, 3], device=device)
    with pytest.raises(ValueError, match=match):
        if fn == "cross_entropy":
            cross_entropy(hidden @ weight.t(), labels, **kwargs)
        else:
            fused_linear_cross_entropy(hidden, weight, labels, **kwargs)


def test_same_out_of_range_label_rule(device):
    """Checked: the same ValueError. Unchecked (validate_labels=False): NaN token loss at the same rows, zero
    gradient there, the other rows as with valid labels."""
    hidden = randn(N, H, device=device, requires_grad=True)
    weight = randn(V, H, device=device, scale=H ** -0.5)
    labels = torch.randint(0, V, (N,), device=device)
    labels[[3, 7]] = torch.tensor([V, -5], device=device)
    labels[0] = -100
    for f in (lambda **k: cross_entropy(hidden @ weight.t(), labels, **k),
              lambda **k: fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8, **k)):
        with pytest.raises(ValueError, match="labels"):
            f(validate_labels=True)
    a = cross_entropy(hidden @ weight.t(), labels, reduction="none", validate_labels=False)
    b = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8, reduction="none", validate_labels=False)
    for tok in (a, b):
        assert torch.isnan(tok[[3, 7]]).all() and tok[0] == 0
        assert torch.isfinite(tok[[i for i in range(N) if i not in (3, 7)]]).all()
    assert_close(b[[1, 2, 4]], a[[1, 2, 4]].double(), torch.float32, slack=4.0, name="valid rows")
    for tok in (a, b):
        hidden.grad = None
        tok.sum().backward(retain_graph=True)
        assert torch.isfinite(hidden.grad).all() and (hidden.grad[[3, 7]] == 0).all() and (hidden.grad[1] != 0).any()
