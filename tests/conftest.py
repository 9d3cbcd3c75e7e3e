"""Test set-up. Runs before any swift_liger module is imported.

On CPU (the default, and CI) the real Triton kernels run through Triton's interpreter: TRITON_INTERPRET must be
set before `triton.jit` decorates them. `SWIFT_LIGER_TEST_GPU=1` runs the same suite on CUDA with compiled kernels.
"""
import os
import sys

GPU = os.environ.get("SWIFT_LIGER_TEST_GPU", "0") == "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["SWIFT_LIGER_BACKEND"] = "triton"
os.environ["SWIFT_LIGER_POISON"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def device():
    if GPU:
        assert torch.cuda.is_available(), "SWIFT_LIGER_TEST_GPU=1 but CUDA is not available"
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
