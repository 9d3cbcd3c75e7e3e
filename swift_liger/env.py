"""Settings read from the environment, checked. Torch-free, imports nothing: the kernels (ops/) and the ms-swift
argument checks (integration/) both read them."""
from __future__ import annotations

import os

BACKENDS = ("auto", "triton", "torch")   # SWIFT_LIGER_BACKEND


def backend_from_env() -> str:
    """SWIFT_LIGER_BACKEND, checked: auto (CUDA tensors run Triton, CPU tensors the PyTorch reference), triton or
    torch (the reference everywhere)."""
    value = os.environ.get("SWIFT_LIGER_BACKEND", "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"SWIFT_LIGER_BACKEND must be one of {', '.join(BACKENDS)}; got {value!r}")
    return value
