"""Column sums of fp32 partials (``ops/_reduce.py``, the last step of the RMSNorm and QK-norm+RoPE backward
kernels): the Triton kernel against float64 sums, one and two groups, odd sizes, several row steps, every output
dtype; outputs start poisoned (NaN) and the partials are left untouched."""
import pytest
import torch

from helpers import DTYPES, REDUCTION_SLACK, assert_close, inputs_unchanged, randn
from swift_liger.ops import _reduce
from swift_liger.ops._common import launch_override


def _poisoned(n, dtype, device):
    return torch.full((n,), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P, N", [(1, 1), (7, 33), (132, 96), (65, 1000)])
def test_one_group_matches_float64(device, dtype, P, N):
    part = randn(P, N, dtype=torch.float32, device=device)
    out = _poisoned(N, dtype, device)
    with inputs_unchanged(part):
        _reduce.column_sums(part, out)
    assert_close(out, part.double().sum(0).cpu(), dtype, slack=REDUCTION_SLACK, name="column sums")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_groups_into_their_own_outputs(device, dtype):
    part = randn(2, 9, 40, dtype=torch.float32, device=device)
    out0, out1 = _poisoned(40, dtype, device), _poisoned(40, torch.float32, device)
    _reduce.column_sums(part, out0, out1)
    assert_close(out0, part[0].double().sum(0).cpu(), dtype, slack=REDUCTION_SLACK, name="group 0")
    assert_close(out1, part[1].double().sum(0).cpu(), torch.float32, slack=REDUCTION_SLACK, name="group 1")


def test_several_row_steps_and_column_blocks(device):
    # 2 partial rows per step over 11 rows, 8 columns per program over 21 columns: tails in both directions.
    part = randn(2, 11, 21, dtype=torch.float32, device=device)
    out0, out1 = _poisoned(21, torch.float32, device), _poisoned(21, torch.float32, device)
    with launch_override(_reduce, block_p=2, block_n=8):
        _reduce.column_sums(part, out0, out1)
    assert_close(out0, part[0].double().sum(0).cpu(), torch.float32, slack=REDUCTION_SLACK, name="group 0")
    assert_close(out1, part[1].double().sum(0).cpu(), torch.float32, slack=REDUCTION_SLACK, name="group 1")


def test_empty_columns_launch_nothing(device):
    part = torch.zeros(3, 0, device=device)
    out = torch.empty(0, device=device)
    _reduce.column_sums(part, out)
    assert out.numel() == 0
