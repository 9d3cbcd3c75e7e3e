"""Triton kernels behind autograd Functions. Pure kernels: nothing here imports transformers or ms-swift.

The public names are functions (``from swift_liger.ops import rms_norm``). A module's name says what it holds:
``<op>_kernel.py`` holds the op's Triton kernels with their launchers and tuning knobs (``rms_norm_kernel``,
``rope_kernel``, ``dropout_mask_kernel``, ...); ``<op>_op.py`` builds an op from other modules' kernels and GEMMs
(``lora_linear_op``, ``logprobs_op``); ``_<piece>.py`` are shared pieces. No module takes a function's name, so
``from swift_liger.ops import rms_norm_kernel`` reaches the module with a plain import (tests/test_import_layers.py
checks the rule). `import swift_liger` alone does not import this package, so the ms-swift start-up hook stays
cheap.
"""
from ..versions import require as _require_versions

_require_versions("torch", "triton")   # before any kernel module imports them: a clear error, not a Triton one

from .cross_entropy_kernel import CrossEntropyFunction, cross_entropy, cross_entropy_reference
from .decode_attention_kernel import decode_attention, decode_attention_reference
from .fused_linear_cross_entropy_kernel import (FusedLinearCrossEntropyFunction, fused_linear_cross_entropy,
                                                fused_linear_cross_entropy_reference)
from .fp8_linear_op import Fp8Weight, fp8_linear, fp8_linear_reference
from .fused_linear_jsd_kernel import fused_linear_jsd, fused_linear_jsd_reference, fused_linear_jsd_topk
from .kv_ring_write_kernel import kv_ring_write, kv_ring_write_reference, kv_sink_rotate, kv_sink_rotate_reference
from .logprobs_op import LogprobsOutput, fused_linear_logprobs, fused_linear_logprobs_reference
from .lora_linear_op import lora_linear, lora_linear_reference
from .qk_norm_rope_kernel import QKNormRoPEFunction, qk_norm_rope, qk_norm_rope_reference
from .rms_norm_kernel import RMSNormFunction, rms_norm, rms_norm_reference
from .rope_kernel import RoPEFunction, apply_rope, apply_rope_reference
from .swiglu_kernel import GeGLUFunction, SwiGLUFunction, geglu, geglu_reference, swiglu, swiglu_reference
from .varlen_attention_kernel import (VarlenAttentionFunction, doc_bounds, seq_ids_from_positions, varlen_attention,
                                      varlen_attention_reference)

__all__ = [
    "rms_norm", "rms_norm_reference", "RMSNormFunction",
    "apply_rope", "apply_rope_reference", "RoPEFunction",
    "qk_norm_rope", "qk_norm_rope_reference", "QKNormRoPEFunction",
    "swiglu", "geglu", "swiglu_reference", "geglu_reference", "SwiGLUFunction", "GeGLUFunction",
    "cross_entropy", "cross_entropy_reference", "CrossEntropyFunction",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_reference", "FusedLinearCrossEntropyFunction",
    "fused_linear_logprobs", "fused_linear_logprobs_reference", "LogprobsOutput",
    "fused_linear_jsd", "fused_linear_jsd_reference", "fused_linear_jsd_topk",
    "lora_linear", "lora_linear_reference",
    "fp8_linear", "fp8_linear_reference", "Fp8Weight",
    "decode_attention", "decode_attention_reference",
    "kv_ring_write", "kv_ring_write_reference", "kv_sink_rotate", "kv_sink_rotate_reference",
    "varlen_attention", "varlen_attention_reference", "VarlenAttentionFunction", "doc_bounds",
    "seq_ids_from_positions",
]
