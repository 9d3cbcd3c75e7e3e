"""One small table per supported model family: which module classes the patcher swaps, by class name.

Nothing here copies transformers code. The patcher matches modules by class name inside one model instance,
so the same table works across transformers releases as long as the class names and the module attributes the
patcher reads (weight / variance_epsilon, gate_proj / up_proj / down_proj / act_fn, q_norm / k_norm, lm_head)
stay put. A family whose forward no longer looks the way the table says is skipped with a reason, never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Family:
    name: str
    model_types: Tuple[str, ...]
    rms_norm: Tuple[str, ...]        # RMSNorm classes: forward(x) -> weight * norm(x) ("llama" casting)
    mlp: Tuple[str, ...]             # gated MLP classes: down_proj(act(gate_proj(x)) * up_proj(x))
    attention: Tuple[str, ...]       # attention classes whose forward calls the module-global `rope_function`
    causal_lm: Tuple[str, ...]       # ...ForCausalLM classes: lm_head + self.loss_function(logits=, labels=, ...)
    decoder_layer: Tuple[str, ...] = ()   # decoder-layer classes (compile_layers compiles each one)
    rope_function: str = "apply_rotary_pos_emb"
    qk_norm: bool = False            # attention applies q_norm/k_norm (RMSNorm over head_dim) right before rope
    lm_head: str = "lm_head"
    rolling_cache: bool = True       # RoPE attention that calls cache.update after rotating q and k (RollingKVCache)


# hidden_act -> (fused kernel, accepted act_fn class names). Anything else keeps the Hugging Face MLP.
ACTIVATIONS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "silu": ("swiglu", ("SiLUActivation", "SiLU")),
    "swish": ("swiglu", ("SiLUActivation", "SiLU")),
    "gelu_pytorch_tanh": ("geglu", ("GELUTanh", "PytorchGELUTanh")),
}


def _family(prefix: str, model_type: str, **kw) -> Family:
    return Family(
        name=model_type,
        model_types=(model_type,),
        rms_norm=(f"{prefix}RMSNorm",),
        mlp=(f"{prefix}MLP",),
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


for _f in (
    _family("Llama", "llama"),
    _family("Mistral", "mistral"),
    _family("Qwen2", "qwen2"),
    _family("Qwen3", "qwen3", qk_norm=True),
):
    register_family(_f)


def family_for(model_type: Optional[str]) -> Optional[Family]:
    return FAMILIES.get(model_type) if model_type else None


def rolling_cache_model_types() -> Tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.rolling_cache)
