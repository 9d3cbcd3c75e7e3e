"""Model shapes of the benchmarks and labs: one dataclass of decoder dims, one table of named shapes (the released
models' widths; every model is random-init), and the builders that make a transformers config and model of them."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """A decoder's dims. None leaves a field to the family's default (head_dim: hidden / heads; the MoE fields:
    no experts); `asdict` records only the fields that are set."""
    family: Optional[str]            # transformers model_type (None: the caller picks one)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: Optional[int]
    vocab: int
    rope_theta: Optional[float] = None
    rms_norm_eps: Optional[float] = None
    tied: Optional[bool] = None      # lm_head shares the embedding matrix
    moe_intermediate: Optional[int] = None
    experts: Optional[int] = None
    experts_per_tok: Optional[int] = None

    def asdict(self) -> Dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


SHAPES = {
    "llama3-8b": ModelDims("llama", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0, 1e-5, tied=False),
    "qwen2.5-7b": ModelDims("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, 1000000.0, 1e-6, tied=False),
    "qwen2.5-3b": ModelDims("qwen2", 2048, 11008, 36, 16, 2, 128, 151936, 1000000.0, 1e-6, tied=True),
    "qwen2.5-1.5b": ModelDims("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, 1000000.0, 1e-6, tied=True),
    "qwen2.5-0.5b": ModelDims("qwen2", 896, 4864, 24, 14, 2, 64, 151936, 1000000.0, 1e-6, tied=True),
    "gemma2-9b": ModelDims("gemma2", 3584, 14336, 42, 16, 8, 256, 256000),   # rope, eps, tied: gemma2's defaults
    "tiny": ModelDims("llama", 64, 128, 2, 4, 2, 16, 256, 500000.0, 1e-5, tied=False),   # CPU pipeline checks
}


def config_kwargs(dims: ModelDims, *, layers: Optional[int] = None, max_positions: int = 4096) -> Dict[str, Any]:
    """The transformers config arguments of `dims` (layers: fewer decoder layers than the shape's)."""
    kw = dict(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
              num_hidden_layers=layers or dims.layers, num_attention_heads=dims.heads,
              num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim, max_position_embeddings=max_positions,
              rope_theta=dims.rope_theta, rms_norm_eps=dims.rms_norm_eps, tie_word_embeddings=dims.tied)
    return {k: v for k, v in kw.items() if v is not None}


def hf_config(dims: Optional[ModelDims] = None, *, family: Optional[str] = None, layers: Optional[int] = None,
              max_positions: int = 4096, **overrides):
    """`AutoConfig.for_model(family or dims.family, ...)` of `dims`, `overrides` passed as given (None included)."""
    from transformers import AutoConfig  # lazy: seconds to import; sweep parents and reports never build a model

    kw = config_kwargs(dims, layers=layers, max_positions=max_positions) if dims is not None else {}
    kw.update(overrides)
    return AutoConfig.for_model(family or dims.family, **kw)


def build_model(config, *, device="cpu", dtype: Optional[torch.dtype] = None, attn: Optional[str] = "sdpa",
                seed: int = 0, image_text: bool = False):
    """A random-init model of `config`, born on `device` (CPU init of a large model would dominate a run), with the
    weights of `seed` (the same in every variant). attn None / dtype None: transformers' defaults."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # lazy: as in hf_config

    kw: Dict[str, Any] = {}
    if dtype is not None:
        kw["dtype"] = dtype
    if attn is not None:
        kw["attn_implementation"] = attn
    torch.manual_seed(seed)
    with torch.device(device):
        return (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_config(config, **kw)


def train_ready(model, *, lora=True, targets="all-linear", dropout: float = 0.0, reentrant: bool = False,
                seed: int = 1):
    """The model as the training loops run it: no KV cache, gradient checkpointing (input grads enabled), and with
    `lora` a PEFT LoRA r=16 alpha 32 on `targets`, its adapters drawn from `seed` (the same in every variant)."""
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    if lora:
        from peft import LoraConfig, get_peft_model  # lazy: imports transformers (seconds); LoRA runs only

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=targets))
    model.train()
    return model
