"""One small table per supported model family: which module classes the patcher swaps, by class name.

Nothing here copies transformers code. The patcher matches modules by class name inside one model instance,
so the same table works across transformers releases as long as the class names and the module attributes the
patcher reads (weight / the norm's eps attribute, gate_proj / up_proj / down_proj / act_fn or gate_up_proj /
activation_fn, q_norm / k_norm, lm_head, an experts module's gate_up_proj and _apply_gate) stay put. A family
whose forward no longer looks the way the table says is skipped with a reason, never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Norm:
    """How the family's RMSNorm weights and rounds (ops.rms_norm's casting modes): y = (offset + w) * x / rms(x)."""
    casting: str = "llama"           # "llama": normalise in fp32, round, scale; "gemma": all fp32, round once
    offset: float = 0.0              # Gemma stores w - 1 (scale = 1 + w)
    eps: str = "variance_epsilon"    # the module attribute holding eps


LLAMA_NORM = Norm()
GEMMA_NORM = Norm(casting="gemma", offset=1.0, eps="eps")


@dataclass(frozen=True)
class Mlp:
    """Where the gated MLP keeps its projections: out = down(act(gate(x)) * up(x))."""
    gate: Optional[str] = "gate_proj"   # None: one packed projection `gate_up` whose output is [gate | up]
    up: str = "up_proj"
    down: str = "down_proj"
    act: str = "act_fn"


SPLIT_MLP = Mlp()
PACKED_MLP = Mlp(gate=None, up="gate_up_proj", act="activation_fn")   # Phi-3, GLM-4

# The attention projections that read the same input (the normed hidden states), by attribute name: one GEMM for
# decode (fusions/fused_projections.py), one quantization of x over FP8 bases (patching/fp8.py).
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: Tuple[str, ...]
    rms_norm: Tuple[str, ...]        # RMSNorm classes (also q_norm/k_norm where qk_norm)
    mlp: Tuple[str, ...]             # gated MLP classes, laid out as `mlp_layout` says
    attention: Tuple[str, ...]       # attention classes whose forward calls the module-global `rope_function`
    causal_lm: Tuple[str, ...]       # root classes: lm_head + self.loss_function(logits=, labels=, ...)
    decoder_layer: Tuple[str, ...] = ()   # decoder-layer classes (compile_layers compiles each one)
    rope_function: str = "apply_rotary_pos_emb"
    rope_interleaved: bool = False   # rotary pairs (2i, 2i+1) (GLM) instead of halves (i, i + D/2)
    qk_norm: bool = False            # attention applies q_norm/k_norm (RMSNorm over head_dim) right before rope
    norm: Norm = LLAMA_NORM
    mlp_layout: Mlp = SPLIT_MLP
    experts: Tuple[str, ...] = ()    # MoE experts classes with packed [gate | up] weights and an `_apply_gate` hook
    logit_softcap: Optional[str] = None   # config attribute with which the root's forward softcaps its logits
    untouched: Tuple[str, ...] = ()  # classes whose whole subtree stays as it is (vision towers)
    lm_head: str = "lm_head"
    rolling_cache: bool = True       # RoPE attention that calls cache.update after rotating q and k (RollingKVCache)


# act_fn class -> fused gated kernel (ops.swiglu / ops.geglu). Anything else keeps the Hugging Face MLP.
ACTIVATIONS: Dict[str, str] = {
    "SiLUActivation": "swiglu", "SiLU": "swiglu",
    "GELUTanh": "geglu", "PytorchGELUTanh": "geglu",
}


def _family(prefix: str, model_type: str, *, mlp: Optional[str] = None, **kw) -> Family:
    return Family(
        name=model_type,
        model_types=(model_type,),
        rms_norm=(f"{prefix}RMSNorm",),
        mlp=(mlp or f"{prefix}MLP",),
        attention=(f"{prefix}Attention",),
        causal_lm=(f"{prefix}ForCausalLM",),
        decoder_layer=(f"{prefix}DecoderLayer",),
        **kw,
    )


FAMILIES: Dict[str, Family] = {}


def register_family(family: Family) -> None:
    """Add (or replace) a family; keyed by every model_type it covers."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family


# Gemma-2/3: sliding-window layers keep everything in the attention call (the mask, attn_logit_softcapping), so
# the rope kernel applies unchanged. rolling_cache=False: RollingKVCache is tested with the first four families
# only (Gemma-2/3 already slide per layer).
for _f in (
    _family("Llama", "llama"),
    _family("Mistral", "mistral"),
    _family("Qwen2", "qwen2"),
    _family("Qwen3", "qwen3", qk_norm=True),
    _family("Gemma", "gemma", norm=GEMMA_NORM, rolling_cache=False),
    _family("Gemma2", "gemma2", norm=GEMMA_NORM, logit_softcap="final_logit_softcapping", rolling_cache=False),
    _family("Gemma3", "gemma3_text", norm=GEMMA_NORM, qk_norm=True, logit_softcap="final_logit_softcapping",
            rolling_cache=False),
    _family("Phi3", "phi3", mlp_layout=PACKED_MLP, rolling_cache=False),
    _family("Glm4", "glm4", mlp_layout=PACKED_MLP, rope_interleaved=True, rolling_cache=False),
    _family("Qwen3Moe", "qwen3_moe", qk_norm=True, experts=("Qwen3MoeExperts",), rolling_cache=False),
    # vision-language: the language model is patched, the vision tower is left as it is; mrope positions arrive as
    # ordinary cos/sin (the rotary embedding interleaves the sections), so the rope kernel applies unchanged
    Family(name="qwen2_5_vl", model_types=("qwen2_5_vl",), rms_norm=("Qwen2_5_VLRMSNorm",), mlp=("Qwen2MLP",),
           attention=("Qwen2_5_VLAttention",), causal_lm=("Qwen2_5_VLForConditionalGeneration",),
           decoder_layer=("Qwen2_5_VLDecoderLayer",), untouched=("Qwen2_5_VisionTransformerPretrainedModel",),
           rolling_cache=False),
    Family(name="qwen3_vl", model_types=("qwen3_vl",), rms_norm=("Qwen3VLTextRMSNorm",), mlp=("Qwen3VLTextMLP",),
           attention=("Qwen3VLTextAttention",), causal_lm=("Qwen3VLForConditionalGeneration",),
           decoder_layer=("Qwen3VLTextDecoderLayer",), qk_norm=True, untouched=("Qwen3VLVisionModel",),
           rolling_cache=False),
):
    register_family(_f)


def family_for(model_type: Optional[str]) -> Optional[Family]:
    return FAMILIES.get(model_type) if model_type else None


def rolling_cache_model_types() -> Tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.rolling_cache)
