"""Gradient scaling (``ops/_scale.py``: out = src * scale in fp32, one rounding; what fused linear CE's backward
uses for dW and dh): the Triton kernel against float64 products, one factor and one per row, out of place into
another dtype and in place, tails across programs; outputs start poisoned and the inputs are left untouched."""
import pytest
import torch

from helpers import DTYPES, assert_close, inputs_unchanged, poisoned_like, randn
from swift_liger.ops import _scale
from swift_liger.ops._common import launch_override


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 33), (130, 96)])
def test_one_factor_out_of_place(device, dtype, shape):
    src = randn(*shape, dtype=dtype, device=device)
    scale = torch.tensor(0.37, dtype=torch.float32, device=device)
    out = poisoned_like(src)
    with inputs_unchanged(src, scale):
        got = _scale.scale_into(src, scale, out)
    assert got is out
    assert_close(out, src.double().cpu() * 0.37, dtype, name="scaled")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_factor_per_row_in_place(device, dtype):
    src = randn(11, 40, dtype=dtype, device=device)
    expected = src.double().cpu()
    scale = randn(11, dtype=torch.float32, device=device)
    with launch_override(_scale, block=64):   # 440 elements over 7 programs: rows straddle program edges
        got = _scale.scale_into(src, scale, src)
    assert got is src
    assert_close(src, expected * scale.double().cpu()[:, None], dtype, name="per-row scaled")


def test_fp32_source_into_bf16_rounds_once(device):
    # fused linear CE's "accumulate" dW: an fp32 buffer scaled into the bf16 gradient.
    src = randn(9, 70, dtype=torch.float32, device=device)
    out = torch.full((9, 70), float("nan"), dtype=torch.bfloat16, device=device)
    _scale.scale_into(src, torch.tensor(1.0 / 3, device=device), out)
    assert_close(out, src.double().cpu() / 3, torch.bfloat16, name="fp32 -> bf16")


def test_bad_arguments_are_named(device):
    src = randn(4, 6, device=device)
    with pytest.raises(ValueError, match="contiguous and of one shape"):
        _scale.scale_into(src, torch.tensor(1.0, device=device), torch.empty(4, 5, device=device))
    with pytest.raises(ValueError, match="contiguous and of one shape"):
        _scale.scale_into(src.t(), torch.tensor(1.0, device=device), torch.empty(6, 4, device=device))
    with pytest.raises(ValueError, match="scale must have 1 or 4 elements"):
        _scale.scale_into(src, torch.ones(3, device=device), src)


def test_empty_launches_nothing(device):
    src = torch.empty(0, 8, device=device)
    assert _scale.scale_into(src, torch.tensor(2.0, device=device), src).numel() == 0
