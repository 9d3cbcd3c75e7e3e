"""Fixtures shared by the cache tests."""
import pytest
import torch

pytest.register_assert_rewrite("ring_helpers")   # the shared drivers and reference (ring_helpers.py) assert too


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: intra-op threads only contend (10x slower on a loaded 2-core CI box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
