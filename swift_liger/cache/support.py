"""Which models a RollingKVCache can run on, checked before one is built: model family, attention implementation,
causal attention, RoPE (streaming mode), the layer kinds of window="model" (read from the config as transformers
reads them), and whether the ring fits the device at all. Also finds the decoder the cache hooks.

Needs torch and transformers' cache_utils but not the cache itself, so integration/arguments.py can check
``window="model"`` against a checkpoint's config before the model loads.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from transformers import cache_utils

from ..patching.families import rolling_cache_model_types
from .settings import RollingCacheRefused

SUPPORTED_MODEL_TYPES = rolling_cache_model_types()   # from the family tables (models/families.py)
# Sliding + full layers: supported with window="model" only (their own window on the sliding layers, exact).
HYBRID_MODEL_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ATTENTION = ("sdpa", "eager")
# RoPE variants whose inverse frequencies are fixed, so scores depend only on position differences.
STREAMING_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module that embeds, builds masks and runs the layers (``LlamaModel`` for ``LlamaForCausalLM``)."""
    m = model
    for _ in range(4):
        if hasattr(m, "layers") and hasattr(m, "config"):
            return m
        if hasattr(m, "get_decoder"):
            d = m.get_decoder()
            if d is not m:
                m = d
                continue
        if hasattr(m, "model"):
            m = m.model
            continue
        break
    raise ValueError(f"RollingKVCache: cannot find the decoder (a module with .layers) in {type(model).__name__}")


def check_family(model: torch.nn.Module, own_window: bool = False) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in HYBRID_MODEL_TYPES and not own_window:
        raise RollingCacheRefused(
            f"RollingKVCache supports {model_type} with window='model' only (--liger_rolling_cache "
            f"model): a ring of its own sliding window on the sliding layers and a full cache on the "
            f"full-attention ones, outputs equal to transformers' cache. An explicit window,sinks "
            f"ring would also cut the full-attention layers' context, which is not offered for "
            f"{model_type}.")
    if model_type not in SUPPORTED_MODEL_TYPES + (HYBRID_MODEL_TYPES if own_window else ()):
        types_ = SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES
        raise ValueError(f"RollingKVCache supports model types {', '.join(types_)} (RoPE attention that calls "
                         f"cache.update after rotating q and k; {', '.join(HYBRID_MODEL_TYPES)} with "
                         f"window='model'); got {model_type!r}")


def validate_model(decoder: torch.nn.Module, mode: str, own_window: bool = False) -> None:
    config = decoder.config
    check_family(decoder, own_window)
    check_attention(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("RollingKVCache needs causal attention; this config has use_bidirectional_attention=True")
    if mode == "streaming":
        rotary = getattr(decoder, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise ValueError("RollingKVCache(mode='streaming') needs the model's rotary embedding (decoder.rotary_emb)")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STREAMING_ROPE_TYPES:
            raise ValueError(f"RollingKVCache(mode='streaming') needs a RoPE with fixed frequencies "
                             f"({', '.join(STREAMING_ROPE_TYPES)}); rope_type {rope_type!r} rescales them with the "
                             f"sequence length. Use mode='absolute'.")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if 2 * inv_freq.numel() != head_dim:
            raise ValueError(f"RollingKVCache(mode='streaming') needs RoPE over the full head_dim ({head_dim}), the "
                             f"rotary embedding covers {2 * inv_freq.numel()} dims")


def layer_types(config) -> tuple:
    """(layer types, per-layer sliding window or None) as transformers reads them to build DynamicCache(config)."""
    get_layer_types_and_kwargs = getattr(cache_utils, "get_layer_types_and_kwargs", None)   # read per call
    if get_layer_types_and_kwargs is not None:   # transformers >= 5.19: per-layer kwargs dicts
        types_, kwargs = get_layer_types_and_kwargs(config)
        if isinstance(kwargs, (list, tuple)) and all(isinstance(kw, dict) for kw in kwargs):
            return list(types_), [kw.get("sliding_window") for kw in kwargs]
    # 5.17 returns one kwargs dict for every layer, older releases lack the function: read the config
    window = getattr(config, "sliding_window", None)
    types_ = getattr(config, "layer_types", None) or (
        ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers)
    return list(types_), [window if t == "sliding_attention" else None for t in types_]


def model_layer_kinds(config) -> tuple:
    """window="model": ("ring" | "full" per layer, the sliding window W). Refuses configs without sliding layers,
    with other layer types (chunked, linear) or with different windows per layer."""
    types_, windows = layer_types(config)
    model_type = getattr(config, "model_type", "this")
    if len(types_) != config.num_hidden_layers:
        raise RollingCacheRefused(
            f"RollingKVCache(window='model'): {model_type} has {config.num_hidden_layers} layers but "
            f"{len(types_)} cache layer types (shared-KV layers are not supported)")
    other = sorted({t for t in types_ if t not in ("sliding_attention", "full_attention")})
    if other:
        raise RollingCacheRefused(
            f"RollingKVCache(window='model') handles sliding_attention and full_attention layers; "
            f"{model_type} has {', '.join(other)}")
    sliding = {w for t, w in zip(types_, windows) if t == "sliding_attention"}
    if not sliding:
        raise RollingCacheRefused(
            f"RollingKVCache(window='model') needs sliding-window layers; this {model_type} config has "
            f"none (sliding_window={getattr(config, 'sliding_window', None)!r}, every layer full "
            f"attention). Give an explicit window,sinks instead.")
    if len(sliding) > 1 or not isinstance(next(iter(sliding)), int) or next(iter(sliding)) < 1:
        raise RollingCacheRefused(
            f"RollingKVCache(window='model') needs one int sliding window >= 1 for all sliding layers, "
            f"{model_type} has {sorted(sliding, key=repr)}")
    kinds = tuple("ring" if t == "sliding_attention" else "full" for t in types_)
    return kinds, next(iter(sliding))


def warn_mixed(config, window: int, sinks: int) -> None:
    """An explicit window on a config that mixes sliding and full layers (qwen2/qwen3 with layer_types)."""
    types_, windows = layer_types(config)
    full = [i for i, t in enumerate(types_) if t == "full_attention"]
    if not full or len(full) == len(types_):
        return
    own = next(w for t, w in zip(types_, windows) if t == "sliding_attention")
    warnings.warn(f"RollingKVCache(window={window}, sinks={sinks}) on a {config.model_type} that mixes sliding-window "
                  f"(window {own}) and full-attention layers: every layer becomes the same ring of {sinks} sinks + "
                  f"the last {window} tokens, so the {len(full)} full-attention layers ({full}) lose all context "
                  f"beyond it and the sliding ones see that ring instead of their own window (not exact). "
                  f"window='model' (--liger_rolling_cache model) keeps a full cache on the full-attention layers "
                  f"and the model's own window on the sliding ones (outputs equal transformers' cache).",
                  UserWarning, stacklevel=3)


def check_attention(config) -> None:
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"RollingKVCache needs attn_implementation in {SUPPORTED_ATTENTION} (they take the "
                         f"arbitrary 4D mask the ring layout needs); the model uses {impl!r}. Load it with "
                         f"attn_implementation='sdpa' or call model.set_attn_implementation('sdpa').")


def _device_bytes(device: torch.device) -> Optional[int]:
    """Total memory of `device` (a CUDA GPU's, or the host's for CPU), None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def check_fits(decoder, config, window: int, sinks: int, ring_layers: int) -> None:
    """ValueError when one sequence's ring (keys and values of every ring layer, sinks + window tokens) exceeds the
    model device's total memory: such a window would fail (or stall) at the first prompt's allocation."""
    param = next(decoder.parameters(), None)
    if param is None or ring_layers == 0:
        return
    total = _device_bytes(param.device)
    if total is None:
        return
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = ring_layers * 2 * kv_heads * head_dim * param.element_size()
    need = per_token * (sinks + window)
    if need > total:
        largest = max(0, total // per_token - sinks)
        raise RollingCacheRefused(
            f"liger_rolling_cache: window {window} + {sinks} sinks needs {need / 2**30:,.1f} GiB of keys "
            f"and values per sequence on this model ({ring_layers} layers x {kv_heads} KV heads x "
            f"{head_dim} x 2 x {param.element_size()} bytes per token), more than the {param.device} "
            f"device's {total / 2**30:,.1f} GiB; the largest window that fits at all is {largest}")
