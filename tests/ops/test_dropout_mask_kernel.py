"""dropout_mask: bits round-trip the mask exactly; masked_scale re-creates native_dropout's output."""
import pytest
import torch

from helpers import assert_close, inputs_unchanged, poisoned_like
from swift_liger.ops.dropout_mask_kernel import masked_scale, pack_mask


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 11), (2, 8192 + 13)])   # ragged tails, > one program
def test_pack_mask_bits(device, shape):
    g = torch.Generator().manual_seed(sum(shape))
    mask = (torch.rand(shape, generator=g) < 0.7).to(device)
    with inputs_unchanged(mask):
        bits = pack_mask(mask).cpu()
    mask = mask.cpu()
    n = mask.numel()
    assert bits.dtype == torch.uint8 and bits.shape == ((n + 7) // 8,)
    unpacked = ((bits.long().unsqueeze(1) >> torch.arange(8)) & 1).reshape(-1)
    assert torch.equal(unpacked[:n].bool(), mask.reshape(-1))
    assert not unpacked[n:].any()                       # padding bits are zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (4096 + 9,)])
def test_masked_scale_matches_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=g).to(device, dtype)
    mask = (torch.rand(shape, generator=g) < 0.9).to(device)
    bits = pack_mask(mask)
    out = poisoned_like(t)
    with inputs_unchanged(t, bits):
        got = masked_scale(t, bits, 1 / 0.9, out=out)
    assert got is out and got.dtype == dtype
    assert_close(got, t.double() * mask / 0.9, dtype, name="masked_scale")
    assert torch.equal(got == 0, ~mask | (t == 0))


def test_masked_scale_in_place_and_new(device):
    t = torch.randn(3, 17, device=device)
    mask = torch.rand(3, 17, device=device) < 0.5
    bits = pack_mask(mask)
    fresh = masked_scale(t, bits, 2.0)
    assert fresh.data_ptr() != t.data_ptr()
    same = masked_scale(t, bits, 2.0, out=t)
    assert same.data_ptr() == t.data_ptr() and torch.equal(same, fresh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reproduces_native_dropout(device, dtype):
    x = torch.randn(33, 70).to(device, dtype)
    torch.manual_seed(5)
    want, mask = torch.native_dropout(x, 0.1, True)
    got = masked_scale(x, pack_mask(mask), 1 / 0.9)
    assert torch.equal(got == 0, want == 0)
    if device.type == "cuda":    # compiled stores round to nearest, as torch's dropout kernel does
        assert torch.equal(got, want)
    assert_close(got, want.double(), dtype, name="vs native_dropout")


def test_bad_arguments(device):
    t = torch.randn(4, 6, device=device)
    with pytest.raises(TypeError, match="mask must have dtype"):
        pack_mask(t)
    with pytest.raises(ValueError, match="mask must be contiguous"):
        pack_mask((t > 0).t())
    bits = pack_mask(t > 0)
    with pytest.raises(ValueError, match="bits must hold 3 bytes"):
        masked_scale(t, bits[:2], 1.0)
    with pytest.raises(ValueError, match="t must be contiguous"):
        masked_scale(t.t(), bits, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        masked_scale(t, bits, 1.0, out=torch.empty(4, 5, device=device))
