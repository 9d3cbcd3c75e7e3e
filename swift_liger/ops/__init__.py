"""Triton kernels behind autograd Functions. Pure kernels: nothing here imports transformers or ms-swift.

Imports are lazy so that `import swift_liger` (run at every interpreter start by the ms-swift hook) stays cheap.
"""
import importlib

_EXPORTS = {
    "rms_norm": "rms_norm",
    "RMSNormFunction": "rms_norm",
    "apply_rope": "rope",
    "RoPEFunction": "rope",
    "swiglu": "swiglu",
    "geglu": "swiglu",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "qk_norm_rope": "qk_norm_rope",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
