"""LoRA dropout inside the rank-r products (ops/lora_dropout_kernel.py): the keep decisions (rate, seeds, repeats)
and the three products against float64 references built from those decisions, on odd shapes, both 16-bit dtypes,
every output element written (outputs start poisoned), inputs untouched."""
import pytest
import torch

from swift_liger.ops import _common
from swift_liger.ops import lora_dropout_kernel as K
from helpers import inputs_unchanged

SHAPES = [(37, 48, 5), (1, 8, 1), (130, 200, 16), (65, 136, 64)]   # (rows, in, rank): tails, 1 row, rank padding


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty hands out NaN (floats) or 7 (ints): an element a kernel forgets to write shows."""
    real = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 7)
    monkeypatch.setattr(torch, "empty", empty)


def _seed(value: int, device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def test_keep_rate_and_seeds(device, poisoned_empty):
    n, n_in = 64, 512
    for p in (0.05, 0.3):
        keep = K.keep_mask(n, n_in, _seed(12345, device), p, device)
        assert keep.dtype == torch.bool and keep.shape == (n, n_in)
        frac = 1 - keep.float().mean().item()
        sigma = (p * (1 - p) / (n * n_in)) ** 0.5
        assert abs(frac - p) < 5 * sigma, (p, frac)
        assert torch.equal(keep, K.keep_mask(n, n_in, _seed(12345, device), p, device))   # a seed's decisions repeat
    a, b = K.keep_mask(n, n_in, _seed(1, device), 0.5, device), K.keep_mask(n, n_in, _seed(2, device), 0.5, device)
    assert 0.4 < (a != b).float().mean().item() < 0.6   # another seed: independent decisions
    assert 0.4 < (a[0] != a[1]).float().mean().item() < 0.6   # rows do not repeat
    # the 8 elements sharing one Philox call are not alike: adjacent pairs agree about as often as chance says
    assert 0.4 < (a[:, 0::2] == a[:, 1::2]).float().mean().item() < 0.6
    # a row's decisions depend on its flat index only: the first rows of a longer batch draw the same
    assert torch.equal(K.keep_mask(n + 30, n_in, _seed(1, device), 0.5, device)[:n], a)


def test_seed_comes_from_the_generator(device):
    torch.manual_seed(3)
    a = K.dropout_seed(torch.device(device))
    torch.manual_seed(3)
    assert torch.equal(a, K.dropout_seed(torch.device(device)))
    assert not torch.equal(a, K.dropout_seed(torch.device(device)))


SPLIT = {"down": {"block_n": 16, "block_k": 32, "splits": 3}, "wgrad": {"block_n": 32, "block_k": 64, "splits": 3},
         "igrad": {"block_n": 32, "block_k": 32}}   # features split 3 ways (fp32 partials), rows split, small tiles


@pytest.fixture(params=["default", "split"])
def launch(request):
    """The launch configurations launch_config picks, or forced ones that take the split paths."""
    forced = SPLIT if request.param == "split" else {}
    for kind, fields in forced.items():
        _common.set_launch_override(K, kind, **fields)
    yield request.param
    for kind in forced:
        _common.set_launch_override(K, kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,n_in,r", SHAPES)
@pytest.mark.parametrize("p", [0.05, 0.5])
def test_products_match_float64(device, n, n_in, r, p, dtype, poisoned_empty, launch):
    g = torch.Generator().manual_seed(n * 1000 + n_in + r)
    x = torch.randn(n, n_in, generator=g).to(device, dtype)
    a = (torch.randn(r, n_in, generator=g) / n_in ** 0.5).to(device, dtype)
    du = torch.randn(n, r, generator=g).to(device, dtype)
    seed = _seed(987 + n, device)
    keep = K.keep_mask(n, n_in, seed, p, device).cpu()
    xd = torch.where(keep, x.double().cpu() / (1 - p), 0.0)   # exact; the kernel rounds x / (1 - p) to `dtype`
    xa, aa, dua = x.double().cpu(), a.double().cpu(), du.double().cpu()
    # each product term carries at most one 16-bit rounding of x / (1 - p), the output one more (2^-10 for fp16, 2^-7
    # for bf16, doubled for the interpreter's rounding toward zero)
    eps = 2.0 ** (-6 if dtype == torch.bfloat16 else -9)
    with inputs_unchanged(x, a, du, seed):
        u = K.lora_down(x, a, seed, p)
        da = K.lora_down_weight_grad(x, du, seed, p)
        dxl = K.lora_down_input_grad(du, a, seed, p, dtype)
    assert u.dtype == da.dtype == dxl.dtype == dtype
    for got, ref, bound in ((u, xd @ aa.t(), (xd.abs() @ aa.abs().t())),
                            (da, dua.t() @ xd, dua.abs().t() @ xd.abs()),
                            (dxl, torch.where(keep, (dua @ aa) / (1 - p), 0.0), (dua.abs() @ aa.abs()) / (1 - p))):
        err = (got.double().cpu() - ref).abs()
        assert torch.isfinite(got).all()
        assert (err <= eps * bound + 1e-6).all(), (err - eps * bound).max()
    assert (dxl.cpu()[~keep] == 0).all()   # dropped elements pass no gradient


def test_applies(device):
    x = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    assert K.applies(x, torch.randn(8, 16, device=device))
    assert not K.applies(x.float(), torch.randn(8, 16, device=device))               # fp32 x
    assert not K.applies(x[:, :12], torch.randn(8, 12, device=device))               # not contiguous, in % 8
    assert not K.applies(x, torch.randn(K.MAX_RANK + 1, 16, device=device))          # rank above 64
    with pytest.raises(ValueError, match="p must be in"):
        K.lora_down(x, torch.randn(8, 16, device=device, dtype=torch.bfloat16), _seed(1, device), 0.0)
