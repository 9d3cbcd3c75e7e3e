"""Triton kernels behind autograd Functions. Pure kernels: nothing here imports transformers or ms-swift.

The public names are functions; the modules of the same name (``swift_liger.ops.rms_norm`` as a module) are reached
with ``importlib.import_module("swift_liger.ops.rms_norm")``. `import swift_liger` alone does not import this
package, so the ms-swift start-up hook stays cheap.
"""
from .cross_entropy import CrossEntropyFunction, cross_entropy, cross_entropy_reference
from .fused_linear_cross_entropy import (FusedLinearCrossEntropyFunction, fused_linear_cross_entropy,
                                         fused_linear_cross_entropy_reference)
from .logprobs import LogprobsOutput, fused_linear_logprobs, fused_linear_logprobs_reference
from .qk_norm_rope import QKNormRoPEFunction, qk_norm_rope, qk_norm_rope_reference
from .rms_norm import RMSNormFunction, rms_norm, rms_norm_reference
from .rope import RoPEFunction, apply_rope, apply_rope_reference
from .swiglu import GeGLUFunction, SwiGLUFunction, geglu, geglu_reference, swiglu, swiglu_reference

__all__ = [
    "rms_norm", "rms_norm_reference", "RMSNormFunction",
    "apply_rope", "apply_rope_reference", "RoPEFunction",
    "qk_norm_rope", "qk_norm_rope_reference", "QKNormRoPEFunction",
    "swiglu", "geglu", "swiglu_reference", "geglu_reference", "SwiGLUFunction", "GeGLUFunction",
    "cross_entropy", "cross_entropy_reference", "CrossEntropyFunction",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_reference", "FusedLinearCrossEntropyFunction",
    "fused_linear_logprobs", "fused_linear_logprobs_reference", "LogprobsOutput",
]
