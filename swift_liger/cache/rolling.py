"""RollingKVCache: a fixed-size KV cache (attention sinks + a ring of the last ``window`` tokens).

Generation runs in constant memory: keys and values are preallocated once (static address) as one
``[layers, B, Hkv, sinks + window, D]`` tensor each, every layer's storage a view of it, and new tokens are written
straight into their ring slots by a Triton kernel
(``swift_liger.ops.kv_ring_write``), O(new tokens) bytes per step, never a cat/roll of the window.

Semantics (per batch row; a row's *stream* is its non-padding tokens, numbered 0, 1, 2, ...)
--------------------------------------------------------------------------------------------
The query of stream token ``q`` attends to the keys ``j <= q`` with ``j < sinks`` (the sinks) or
``j > q - window`` (the last ``window`` tokens, itself included). Before ``sinks + window`` tokens have been seen
that is every earlier token, so outputs equal ``DynamicCache``'s.

* ``mode="absolute"`` (Mistral-style sliding window plus sinks): every key keeps its true RoPE position; the model
  rotates q and k as usual before ``cache.update``, so nothing is re-rotated.
* ``mode="streaming"`` (StreamingLLM): positions are assigned within the cache. The visible keys, in order
  (sinks, then the window chronologically), get positions ``0 .. L-1`` and the query ``L-1``. RoPE scores depend
  only on ``q_pos - k_pos``, so this equals: window keys at their true positions (exactly what the model already
  did) and sink ``s`` at position ``s + delta`` with ``delta = max(0, q - window + 1 - sinks)``, i.e. placed just
  before the oldest window key. The cache therefore keeps the sink keys as the model produced them (rotated at
  their true position ``s``) in a separate pristine buffer, and before each attention writes
  ``R(delta) @ sink`` into the sink slots (for an unpadded decode token, one launch for all layers before the
  first layer runs; otherwise fused into each layer's write launch; fp32 math, always from the pristine copy, so
  bf16 rounding never accumulates). Only ``sinks`` keys per layer are touched per step; the
  query keeps the true position the model gave it (so RoPE angles grow with the stream exactly as with
  DynamicCache). Needs a RoPE whose frequencies do not depend on the sequence length (default, linear, llama3,
  yarn); dynamic-NTK / longrope are refused.
* A chunk of T > 1 tokens (prefill, chat continuation) is one step: its queries are masked token by token as
  above, and in streaming mode all of them see the sinks at the position they have at the chunk's start
  (``delta`` from the chunk's first token). Token-by-token decoding is exactly StreamingLLM.

Left padding: pads (0 in the 2D attention mask) are never stored, so each row's sinks are its first real tokens
and rows with different prompt lengths fill their rings independently. ``position_ids`` must advance by one per
real token (``generate`` does this: cumsum of the mask); when they are not given the cache supplies them.

Hybrid models: ``window="model"``
--------------------------------
For configs whose layers mix sliding-window and full attention (gemma2, gemma3_text, qwen2/qwen3 with
``layer_types``; read with transformers' ``get_layer_types_and_kwargs``, as ``DynamicCache(config)`` reads them),
each sliding layer is a ring (RollingLayer) of the model's own ``sliding_window`` W slots, no sinks, absolute
positions, and each full-attention layer a FullLayer that keeps every column, padding included, like DynamicLayer.
transformers' window counts the current token (``sliding_window_overlay``: keys ``q - W < j <= q``;
DynamicSlidingWindowLayer keeps W - 1 past tokens and attends over W) and so does the ring, so outputs equal the
default cache's: same tokens, fp32 logits equal up to summation order, ~1e-6 (tests/cache/test_hybrid_cache.py:
gemma2, gemma3, qwen2; padded or not, sdpa and eager). Exact for left padding (the ring counts real tokens,
transformers' window counts columns; the two agree when padding precedes every real token). Memory: W slots per
ring layer from the first forward; full layers grow by 1024 columns at a time (DynamicLayer: a torch.cat, i.e. a
copy of the whole past, per step).
A config with sliding layers only (mistral with sliding_window) is every layer a ring. An explicit window on
gemma2/gemma3 is refused; on qwen2/qwen3 with mixed layer_types it keeps its meaning (every layer the same ring)
with a warning. No CUDA graph with window="model" (the full layers' keys grow).

How the model is told about the layout
--------------------------------------
Storage order is ring order, not chronological, so Hugging Face's mask builders (which assume key ``i`` is
column ``kv_offset + i``) cannot describe it in general. The cache registers a forward pre-hook on the model's
decoder (``LlamaModel`` etc.; a no-op unless ``past_key_values`` is a RollingKVCache) that plans each forward
once for all layers: per-row stream indices of the new tokens, their slots, the sink rotation, and the mask. Two
cases:

* fast path (no padding ever seen, and either the cache has not wrapped yet or this is a single decode token):
  the keys handed to attention are the storage itself (a prefix view before the ring wraps, the whole buffer
  after); every stored key is visible, so the hook passes ``attention_mask=None`` and transformers builds the
  usual causal mask from ``get_mask_sizes`` / ``get_query_offset`` (SDPA then takes the maskless GQA path, as
  with ``DynamicCache``). A decode token builds no tensor per step: position ids and sink angles are views into
  tables covering 256 steps, and the write is one launch per layer with the start index as a scalar.
* padded decode (left padding seen, a single real token per row, every row's ring full): every slot of every
  row is then stored and visible after the write, so it is maskless like the fast path; slots and positions come
  from the row lengths, a [B] device tensor (one host read of its minimum after each masked forward).
* general path (padding before every ring is full, or a multi-token chunk that wraps the ring): the hook passes
  its own 4D mask (``[B, 1, T, K]``, bool for sdpa, additive float for eager), which every mask builder of
  transformers 5.17-5.19 returns unchanged (``_preprocess_mask_arguments`` early exit for 4D masks). Keys are the
  storage (T == 1; a real query then sees exactly the stored slots, ``slot < end``) or ``cat(storage, chunk)`` for
  multi-token chunks (the chunk's early queries need tokens the write evicts).
* hybrid models: on the fast path transformers builds both masks from ``get_mask_sizes`` / ``get_query_offset``,
  answered per layer kind; on the general path the hook passes ``{"sliding_attention": ring mask,
  "full_attention": create_causal_mask(...)}``, a mapping these decoders use as it is.

Decode speed (CUDA). A maskless single-token step (fast path or padded decode) attends with
``swift_liger.ops.decode_attention`` (split-KV, GQA heads share their K/V reads) instead of SDPA: the decoder's
``forward`` is wrapped on this instance and the model's attention implementation is switched by name for that call
only. With ``cuda_graph=True`` every such step after the ring is full is one replay of a CUDA graph of the decoder,
its positions, slots and sink angles read from a device counter (one per row in a padded batch). H200,
Llama-3-8B shapes, 32 layers, with swift_liger's kernels in the model: 5.6 ms/token at batch 1 and 6.5 at batch 8
against 37-45 and 32-37 for transformers' sliding-window caches, whose eager steps (and ours without the graph) are
set by the host's Python (docs/benchmarks/rolling_cache.md).

Transformers hooks relied on (5.17-5.19): ``Cache(layers=...)``, ``Cache.update(k, v, layer_idx)`` called by
the attention after RoPE, ``get_seq_length`` (generate slices continued prompts with it: it counts columns,
padding included), ``get_mask_sizes`` / ``get_query_offset`` (fast path), the 4D-mask early exit, and the
decoder being called with keyword arguments (``past_key_values=``, ``attention_mask=``, ``position_ids=``); for
window="model" also ``get_layer_types_and_kwargs``, ``create_causal_mask(layer_idx=)``, ``Cache.is_sliding`` (which
layer each mask builder sizes against) and decoders taking a mask mapping keyed by layer type.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import warnings
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..models.families import rolling_cache_model_types
from ..ops.decode_attention_kernel import decode_attention_unchecked, decode_attention_write_unchecked
from ..ops.kv_ring_write_kernel import kv_ring_write_unchecked, kv_sink_rotate, kv_sink_rotate_unchecked
from .settings import MODEL_WINDOW, RollingCacheRefused, check_settings

SUPPORTED_MODEL_TYPES = rolling_cache_model_types()   # from the family tables (models/families.py)
# Sliding + full layers: supported with window="model" only (their own window on the sliding layers, exact).
HYBRID_MODEL_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ATTENTION = ("sdpa", "eager")
# RoPE variants whose inverse frequencies are fixed, so scores depend only on position differences.
STREAMING_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_TABLE = 256   # decode steps covered by one precomputed position / sink-rotation table
_FULL_BLOCK = 1024   # full-attention layers of a hybrid cache grow their storage by this many columns at a time
# Devices whose eager single-token steps attend with the decode kernel (on CPU SDPA is as good; tests add "cpu").
DECODE_KERNEL_DEVICES = ("cuda",)
_HOOK_ATTR = "_swift_liger_rolling_hook"
_INSTALL_ATTR = "_swift_liger_rolling_install"
_GRAPH_ATTR = "_swift_liger_rolling_graph_forward"


def _find_decoder(model: torch.nn.Module) -> torch.nn.Module:
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


def _check_family(model: torch.nn.Module, own_window: bool = False) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in HYBRID_MODEL_TYPES and not own_window:
        raise RollingCacheRefused(f"RollingKVCache supports {model_type} with window='model' only (--liger_rolling_cache "
                         f"model): a ring of its own sliding window on the sliding layers and a full cache on the "
                         f"full-attention ones, outputs equal to transformers' cache. An explicit window,sinks "
                         f"ring would also cut the full-attention layers' context, which is not offered for "
                         f"{model_type}.")
    if model_type not in SUPPORTED_MODEL_TYPES + (HYBRID_MODEL_TYPES if own_window else ()):
        types_ = SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES
        raise ValueError(f"RollingKVCache supports model types {', '.join(types_)} (RoPE attention that calls "
                         f"cache.update after rotating q and k; {', '.join(HYBRID_MODEL_TYPES)} with "
                         f"window='model'); got {model_type!r}")


def _validate_model(decoder: torch.nn.Module, mode: str, own_window: bool = False) -> None:
    config = decoder.config
    _check_family(decoder, own_window)
    _check_attention(config)
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


def _layer_types(config) -> tuple:
    """(layer types, per-layer sliding window or None) as transformers reads them to build DynamicCache(config)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:   # transformers >= 5.19: per-layer kwargs dicts
        types_, kwargs = get_layer_types_and_kwargs(config)
        if isinstance(kwargs, (list, tuple)) and all(isinstance(kw, dict) for kw in kwargs):
            return list(types_), [kw.get("sliding_window") for kw in kwargs]
    # 5.17 returns one kwargs dict for every layer, older releases lack the function: read the config
    window = getattr(config, "sliding_window", None)
    types_ = getattr(config, "layer_types", None) or (
        ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers)
    return list(types_), [window if t == "sliding_attention" else None for t in types_]


def _model_layer_kinds(config) -> tuple:
    """window="model": ("ring" | "full" per layer, the sliding window W). Refuses configs without sliding layers,
    with other layer types (chunked, linear) or with different windows per layer."""
    types_, windows = _layer_types(config)
    model_type = getattr(config, "model_type", "this")
    if len(types_) != config.num_hidden_layers:
        raise RollingCacheRefused(f"RollingKVCache(window='model'): {model_type} has {config.num_hidden_layers} layers but "
                         f"{len(types_)} cache layer types (shared-KV layers are not supported)")
    other = sorted({t for t in types_ if t not in ("sliding_attention", "full_attention")})
    if other:
        raise RollingCacheRefused(f"RollingKVCache(window='model') handles sliding_attention and full_attention layers; "
                         f"{model_type} has {', '.join(other)}")
    sliding = {w for t, w in zip(types_, windows) if t == "sliding_attention"}
    if not sliding:
        raise RollingCacheRefused(f"RollingKVCache(window='model') needs sliding-window layers; this {model_type} config has "
                         f"none (sliding_window={getattr(config, 'sliding_window', None)!r}, every layer full "
                         f"attention). Give an explicit window,sinks instead.")
    if len(sliding) > 1 or not isinstance(next(iter(sliding)), int) or next(iter(sliding)) < 1:
        raise RollingCacheRefused(f"RollingKVCache(window='model') needs one int sliding window >= 1 for all sliding layers, "
                         f"{model_type} has {sorted(sliding, key=repr)}")
    kinds = tuple("ring" if t == "sliding_attention" else "full" for t in types_)
    return kinds, next(iter(sliding))


def _warn_mixed(config, window: int, sinks: int) -> None:
    """An explicit window on a config that mixes sliding and full layers (qwen2/qwen3 with layer_types)."""
    types_, windows = _layer_types(config)
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


def _check_attention(config) -> None:
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"RollingKVCache needs attn_implementation in {SUPPORTED_ATTENTION} (they take the "
                         f"arbitrary 4D mask the ring layout needs); the model uses {impl!r}. Load it with "
                         f"attn_implementation='sdpa' or call model.set_attn_implementation('sdpa').")


@dataclasses.dataclass(slots=True)
class _Plan:
    """What every layer does in one forward (computed once by the pre-hook)."""
    T: int
    layout: str                      # "prefix" | "full" | "slots" | "rows" | "concat"
    pos: object                      # [B, T] stream index of each new token (-1 = padding), or an int p when
                                     # every row's tokens are p .. p+T-1 (end/start implied)
    end: Optional[torch.Tensor]      # [B] stream length after this forward (None with an int pos)
    start: Optional[torch.Tensor] = None  # [B] stream length before this forward (streaming, pos tensor)
    prefix_len: int = 0              # "prefix": keys are storage[:, :, :prefix_len]
    storage_in_keys: bool = True     # "concat": False when the cache was empty (keys = the chunk only)
    cos: Optional[torch.Tensor] = None   # streaming: [B, D/2] fp32 sink rotation for this forward
    sin: Optional[torch.Tensor] = None
    kv_length: int = 0               # get_mask_sizes / get_query_offset answers (fast path)
    q_offset: int = 0
    done: set = dataclasses.field(default_factory=set)   # layers already updated (a plan serves one forward)
    graph: bool = False              # decode step run by (or captured into) the cache's CUDA graph
    decode_kernel: bool = False      # one token per row, every key handed over visible: split-KV decode attention
    pos_t: Optional[torch.Tensor] = None   # graph: [B, 1] / [B] device views of the step counter, read by the
    end_t: Optional[torch.Tensor] = None   # write kernel at replay time (a Python int would be baked in)
    defer_write: bool = False        # eager decode with our attention installed: each layer's write is done by its
                                     # decode-attention launch (see _PENDING_WRITES)


class _Unsupported:
    """What neither layer kind of a RollingKVCache does: offloading, cropping, changing the batch."""

    def offload(self):
        raise NotImplementedError("RollingKVCache does not support offloading")

    def prefetch(self):
        raise NotImplementedError("RollingKVCache does not support offloading")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("RollingKVCache cannot be cropped: evicted tokens are gone (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("RollingKVCache has a fixed batch size; create it before expanding the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("RollingKVCache has a fixed batch size")


class RollingLayer(_Unsupported, CacheLayerMixin):
    """One layer's storage: keys/values ``[B, H, sinks + window, D]`` and, in streaming mode, pristine sink keys."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "RollingKVCache", idx: int, ring_idx: Optional[int] = None):
        super().__init__()
        self._owner = owner
        self._idx = idx
        self._ring_idx = idx if ring_idx is None else ring_idx   # index among the cache's ring layers
        self._joint = False      # storage is a view of the cache's joint all-ring-layer buffers
        self.sink_keys: Optional[torch.Tensor] = None
        if getattr(owner, "own_window", False):   # window="model": a sliding layer to transformers' mask builders
            self.is_sliding = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self._owner
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        if value_states.shape[:2] != key_states.shape[:2] or value_states.shape[-1] != key_states.shape[-1]:
            raise ValueError("RollingKVCache needs keys and values of the same [B, H, *, D] shape")
        shape = (self.batch_size, self.num_heads, o.capacity, key_states.shape[-1])
        self.keys, self.values, self.sink_keys, self._joint = o._layer_storage(self._ring_idx, shape, self.dtype,
                                                                               self.device)
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.sink_keys):
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        self.is_initialized = True
        o._joint_ready = all(layer.is_initialized and layer._joint for layer in o.layers
                             if isinstance(layer, RollingLayer))

    def update(self, key_states, value_states, plan: Optional[_Plan] = None, *args, **kwargs):
        if plan is None:
            raise RuntimeError("RollingKVCache layers are updated through RollingKVCache.update")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape != (self.batch_size, self.num_heads, plan.T, self.keys.shape[3]):
            raise ValueError(f"RollingKVCache: got keys {tuple(key_states.shape)}, expected "
                             f"[{self.batch_size}, {self.num_heads}, {plan.T}, {self.keys.shape[3]}]")
        if key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise TypeError(f"RollingKVCache holds {self.dtype}, got keys {key_states.dtype} / values "
                            f"{value_states.dtype}")
        o = self._owner
        if plan.layout == "concat":
            if plan.storage_in_keys:
                if self.sink_keys is not None:   # sinks at this chunk's positions before they are read
                    kv_sink_rotate(self.keys[:, :, :o.sinks], self.sink_keys, plan.cos, plan.sin)
                keys = torch.cat((self.keys, key_states), dim=2)
                values = torch.cat((self.values, value_states), dim=2)
            else:
                keys, values = key_states, value_states
            kv_ring_write_unchecked(self.keys, self.values, key_states, value_states, plan.pos, plan.end, o.sinks,
                                    o.window, self.sink_keys)
            return keys, values
        # One launch: write the new tokens and (streaming) re-rotate the sinks stored earlier.
        rotate = self.sink_keys is not None and plan.cos is not None
        pos, end = (plan.pos_t, plan.end_t) if plan.graph else (plan.pos, plan.end)
        if (plan.defer_write and not rotate and plan.layout in ("full", "prefix") and pos >= o.sinks
                and not torch.compiler.is_compiling()):
            # The layer's decode-attention launch stores the token (same slot as the ring write kernel's).
            slot = o.sinks + (pos - o.sinks) % o.window
            keys, values = ((self.keys[:, :, :plan.prefix_len], self.values[:, :, :plan.prefix_len])
                            if plan.layout == "prefix" else (self.keys, self.values))
            _PENDING_WRITES[id(keys)] = (keys, values, key_states, value_states, slot, o)
            return keys, values
        kv_ring_write_unchecked(self.keys, self.values, key_states, value_states, pos, end, o.sinks,
                                o.window, self.sink_keys, plan.cos if rotate else None,
                                plan.sin if rotate else None, plan.start if rotate else None)
        if plan.layout == "prefix":
            return self.keys[:, :, :plan.prefix_len], self.values[:, :, :plan.prefix_len]
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.sink_keys) if t is not None)

    def get_mask_sizes(self, query_length: int) -> tuple:
        plan = self._owner._plan
        if plan is None:
            return query_length, 0
        return plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self._owner._columns

    def get_max_length(self) -> int:
        return self._owner.capacity

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            if self.sink_keys is not None:
                self.sink_keys.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            for t in (self.keys, self.values, self.sink_keys):
                if t is not None:
                    t.copy_(t.index_select(0, idx))


class FullLayer(_Unsupported, CacheLayerMixin):
    """A full-attention layer of a hybrid cache (window="model"): every column, padding included (the model's own
    causal mask hides it), as transformers' DynamicLayer keeps them. Storage grows by _FULL_BLOCK (1024) columns at
    a time, so a decode step copies one token rather than the whole past (DynamicLayer: a torch.cat per step);
    ``keys`` / ``values`` are views of the filled part."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "RollingKVCache", idx: int):
        super().__init__()
        self._owner = owner
        self._idx = idx
        self.length = 0          # columns stored
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        if value_states.shape != key_states.shape:
            raise ValueError("RollingKVCache needs keys and values of the same [B, H, *, D] shape")
        self._k = self._v = None
        self.length = 0
        self.is_initialized = True

    def update(self, key_states, value_states, plan: Optional[_Plan] = None, *args, **kwargs):
        if plan is None:
            raise RuntimeError("RollingKVCache layers are updated through RollingKVCache.update")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        if (B, H, T) != (self.batch_size, self.num_heads, plan.T) or value_states.shape != key_states.shape:
            raise ValueError(f"RollingKVCache: got keys {tuple(key_states.shape)} / values "
                             f"{tuple(value_states.shape)}, expected [{self.batch_size}, {self.num_heads}, "
                             f"{plan.T}, D]")
        if key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise TypeError(f"RollingKVCache holds {self.dtype}, got keys {key_states.dtype} / values "
                            f"{value_states.dtype}")
        n0, n = self.length, self.length + T
        if self._k is None or n > self._k.shape[2]:
            cap = -(-n // _FULL_BLOCK) * _FULL_BLOCK
            k = key_states.new_zeros((B, H, cap, D))
            v = torch.zeros_like(k)
            if n0:
                k[:, :, :n0].copy_(self._k[:, :, :n0])
                v[:, :, :n0].copy_(self._v[:, :, :n0])
            self._k, self._v = k, v
        self._k[:, :, n0:n].copy_(key_states)
        self._v[:, :, n0:n].copy_(value_states)
        self.length = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the filled part rounded up to _FULL_BLOCK columns)."""
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0      # DynamicLayer's answer: all past columns, offset 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        if self._k is not None:
            self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._k is not None:
            idx = beam_idx.to(self._k.device)
            self._k, self._v = self._k.index_select(0, idx), self._v.index_select(0, idx)
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


class RollingKVCache(Cache):
    """Sinks + ring-buffer KV cache with constant memory. See the module docstring for the exact semantics.

    Args:
        model: the Hugging Face model it will run with (llama, mistral, qwen2, qwen3; gemma2 and gemma3_text with
            window="model"; attn_implementation sdpa or eager). The cache installs a forward pre-hook on its
            decoder (once per model, a no-op for other caches).
        window: tokens of recent context each query sees (itself included), > 0: every layer is a ring of
            ``sinks + window`` slots. Or ``"model"``: the model's own sliding window, exact (hybrid models, see
            the module docstring): a ring of ``config.sliding_window`` slots, no sinks, on each sliding layer and a
            growing full cache (FullLayer) on each full-attention layer.
        sinks: first tokens kept forever, 0 <= sinks < window (default 4; StreamingLLM uses 4). 0 with "model".
        mode: "absolute" (true RoPE positions, Mistral-style) or "streaming" (positions within the cache).
        cuda_graph: on CUDA, once the ring is full (every row's ring, in a left-padded batch), run each
            single-token decode step as one replay of a CUDA graph of the decoder (captured at the first such step;
            the LM head and sampling stay eager). Decode is then bound by the GPU, not by ~20 us of Python per
            layer. Needs ``torch.no_grad()`` (``generate`` does that); ``output_attentions`` /
            ``output_hidden_states`` and steps before the wrap run eagerly. The returned ``last_hidden_state`` is
            the graph's static buffer, valid until the next step. Not with window="model".

    Use as ``model.generate(..., past_key_values=RollingKVCache(model, window=4096, sinks=4))``, or call
    ``install_rolling_cache(model, ...)`` once so that every ``generate`` call gets a fresh one. Ring storage is
    allocated at the first forward (batch size, heads, dtype and device come from it) and never reallocated;
    ``reset()`` clears it for reuse with the same batch size. ``layer_kinds`` says which layers are rings.
    """

    def __init__(self, model: torch.nn.Module, window, sinks: Optional[int] = None, mode: str = "absolute",
                 cuda_graph: bool = False):
        settings = check_settings(window, sinks, mode, cuda_graph)
        self.own_window = settings["window"] == MODEL_WINDOW
        _check_family(model, self.own_window)
        decoder = _find_decoder(model)
        _validate_model(decoder, mode, self.own_window)
        config = decoder.config
        if self.own_window:
            kinds, window = _model_layer_kinds(config)
        else:
            kinds = ("ring",) * config.num_hidden_layers
            _warn_mixed(config, window, settings["sinks"])
        sinks = settings["sinks"]
        if not self.own_window:
            _check_fits(decoder, config, window, sinks, kinds.count("ring"))
        self.window, self.sinks, self.mode = window, sinks, mode
        self.capacity = sinks + window
        self.layer_kinds = kinds                # "ring" (RollingLayer) or "full" (FullLayer) per layer
        self._decoder = decoder
        self._config = config
        # The model's own sliding window, if narrower than ours, would cut the all-visible fast path.
        model_window = getattr(config, "sliding_window", None)
        self._fast_ok = model_window is None or model_window >= self.capacity
        layers, rings = [], 0
        for i, kind in enumerate(kinds):
            if kind == "ring":
                layers.append(RollingLayer(self, i, rings))
                rings += 1
            else:
                layers.append(FullLayer(self, i))
        self._n_ring = rings
        self._full_idx = kinds.index("full") if "full" in kinds else None   # sizes transformers' full mask
        super().__init__(layers=layers)
        self._joint: Optional[tuple] = None     # (spec, keys [L, ...], values, sink_keys, sink refresh views)
        self._joint_ready = False               # every ring layer's storage is a view of self._joint
        self.cuda_graph = cuda_graph
        self._graph: Optional[dict] = None      # captured decode step (see _graph_run)
        self._g_step: Optional[torch.Tensor] = None   # [1] int64: stream index of the token being decoded
        self._g_counts: Optional[torch.Tensor] = None   # [B] int64: per-row stream indices (padded batches)
        self._reset_state()
        _ensure_hook(decoder)
        _ensure_forward_wrapper(decoder)

    def _reset_state(self) -> None:
        self._columns = 0                       # columns processed, padding included (generate's past length)
        self._uniform: Optional[int] = 0        # stream length when all rows are equal and unpadded, else None
        self._counts: Optional[torch.Tensor] = None   # [B] per-row stream lengths once rows differ
        self._counts_min: Optional[int] = None   # min of _counts when known on the host (None: read it)
        self._batch: Optional[int] = None
        self._plan: Optional[_Plan] = None
        # Decode fast path tables (see _decode_positions / _decode_sink_rotation).
        self._pos_table: Optional[torch.Tensor] = None
        self._pos_start = 0
        self._rot_table: Optional[tuple] = None
        self._rot_start = 0
        self._cols: Optional[torch.Tensor] = None

    # ----- transformers Cache API -----

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        plan = self._plan
        if plan is None or layer_idx in plan.done:
            raise RuntimeError("RollingKVCache.update ran without its pre-forward hook: build the cache with the model "
                               "that uses it (RollingKVCache(model, ...)) and call that model (or its decoder) with "
                               "past_key_values=cache as a keyword argument")
        plan.done.add(layer_idx)
        return self.layers[layer_idx].update(key_states, value_states, plan)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def _full_layer(self, layer_idx) -> Optional["FullLayer"]:
        layer = self.layers[layer_idx] if layer_idx is not None and 0 <= layer_idx < len(self.layers) else None
        return layer if isinstance(layer, FullLayer) else None

    def get_query_offset(self, layer_idx: int = 0) -> int:
        full = self._full_layer(layer_idx)
        if full is not None:
            return full.length   # columns before this forward (masks are built before the layers update)
        return self._plan.q_offset if self._plan is not None else self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple:
        full = self._full_layer(layer_idx)
        if full is not None:
            return full.get_mask_sizes(query_length)
        if self._plan is None:
            return query_length, 0
        return self._plan.kv_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1 if self._full_layer(layer_idx) is not None else self.capacity

    def reset(self) -> None:
        super().reset()
        self._reset_state()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._counts is not None:
            self._counts = self._counts.index_select(0, beam_idx.to(self._counts.device))
            self._counts_min = None   # rows may repeat: the minimum can change

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant once allocated; full-attention layers of a window="model"
        cache grow by 1024 columns at a time)."""
        return sum(layer.nbytes for layer in self.layers)

    def __repr__(self) -> str:
        full = len(self.layers) - self._n_ring
        return (f"RollingKVCache(window={'model: ' if self.own_window else ''}{self.window}, sinks={self.sinks}, "
                f"mode={self.mode!r}, layers={len(self.layers)}{f' ({full} full)' if full else ''}, "
                f"seen={self._columns})")

    # ----- planning (called by the decoder's pre-forward hook) -----

    def _layer_storage(self, idx: int, shape: tuple, dtype: torch.dtype, device: torch.device):
        """(keys, values, sink_keys, joint) for ring layer idx (index among the ring layers). Ring layers shaped
        like the first get views of one [L, ...] tensor each, so a streaming decode step re-rotates every layer's
        sinks in one launch."""
        spec = (shape, dtype, device)
        streaming = self.mode == "streaming" and self.sinks > 0
        B, H, C, D = shape
        S = self.sinks
        j = self._joint
        if idx == 0 or j is None:
            self._graph = None      # new storage addresses: a captured graph would write to the old ones
            L = self._n_ring
            # Zero, not empty: masked slots are still read by attention (0 * NaN would poison the output).
            keys = torch.zeros((L, *shape), dtype=dtype, device=device)
            values = torch.zeros_like(keys)
            sinks = torch.zeros((L, B, H, S, D), dtype=dtype, device=device) if streaming else None
            refresh = (keys.view(L * B, H, C, D)[:, :, :S], sinks.view(L * B, H, S, D)) if streaming else None
            j = self._joint = (spec, keys, values, sinks, refresh)
        if j[0] == spec:
            return j[1][idx], j[2][idx], (j[3][idx] if j[3] is not None else None), True
        keys = torch.zeros(shape, dtype=dtype, device=device)
        sinks = torch.zeros((B, H, S, D), dtype=dtype, device=device) if streaming else None
        return keys, torch.zeros_like(keys), sinks, False

    def _begin_forward(self, batch: int, T: int, device: torch.device, attention_mask: Optional[torch.Tensor],
                       position_ids: Optional[torch.Tensor], module: torch.nn.Module,
                       embeds: Optional[torch.Tensor]):
        """Plan one forward of T new columns; returns the (attention_mask, position_ids) to hand to the decoder."""
        if T <= 0:
            raise ValueError("RollingKVCache: empty input")
        if batch != self._batch:
            if self._batch is not None:
                raise ValueError(f"RollingKVCache holds a batch of {self._batch}, got {batch}; call reset() first")
            self._batch = batch
            for layer in self.layers:   # first forward after reset() with another batch size: reallocate
                if layer.is_initialized and layer.batch_size != batch:
                    layer.is_initialized = False
        C = self.capacity
        if attention_mask is not None and attention_mask.shape[-1] < T:
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, fewer than the {T} new tokens")
        n = self._uniform
        mask = None
        if attention_mask is not None and n is not None and bool(attention_mask[:, -T:].all()):
            # Only the new columns matter (stored tokens were judged when they came). generate passes an all-ones
            # mask every step; it means "no padding", so it keeps the fast paths (one sync: generate syncs anyway).
            attention_mask = None
        if attention_mask is None and n is not None and self._fast_ok and T == 1:
            # Decode fast path: no mask, no index tensors; positions and sink angles come from tables.
            if n >= C and self._graph_ok(device):
                # Positions and the sink rotation are computed inside the graph from the step counter.
                plan = _Plan(1, "full", n, None, kv_length=C, q_offset=C - 1, graph=True, decode_kernel=True)
            else:
                if position_ids is None:
                    position_ids = self._decode_positions(n, device)
                if n < C:
                    plan = _Plan(1, "prefix", n, None, prefix_len=n + 1, kv_length=n + 1, q_offset=n)
                else:
                    plan = _Plan(1, "full", n, None, kv_length=C, q_offset=C - 1)
                    if self.mode == "streaming" and self.sinks > 0:
                        cos, sin = self._decode_sink_rotation(n, device)
                        if self._joint_ready:   # every layer's sinks in one launch, before any layer attends
                            dst, src = self._joint[4]
                            kv_sink_rotate_unchecked(dst, src, cos, sin)
                        else:                   # fused into each layer's write
                            plan.cos, plan.sin = cos[:batch], sin[:batch]
                # SDPA with a key length that grows every step took 40-45 ms per token before the wrap (Llama-3-8B
                # shapes, H200; DynamicCache the same); the decode kernel: 4-7 ms, the length is a runtime argument.
                plan.decode_kernel = device.type in DECODE_KERNEL_DEVICES
        elif n is None and T == 1 and self._rows_wrapped(attention_mask):
            plan = self._padded_decode_plan(batch, device)
            if position_ids is None:
                position_ids = plan.pos
        elif attention_mask is None and n is not None and self._fast_ok and n + T <= C:
            # Uniform rows: the kernel takes the start index as a scalar, no per-step index tensors.
            plan = _Plan(T, "prefix", n, None, prefix_len=n + T, kv_length=n + T, q_offset=n)
            if position_ids is None:
                position_ids = (torch.arange(T, device=device) + n).unsqueeze(0)
        else:
            dtype = embeds.dtype if embeds is not None else module.dtype
            plan, mask, position_ids = self._general_plan(batch, T, device, attention_mask, position_ids, dtype)
        self._plan = plan
        self._columns += T
        if attention_mask is not None:
            self._uniform = None
        elif n is not None:
            self._uniform = n + T
        if self._uniform is None:
            self._counts = plan.end
            self._counts_min = self._counts_min + 1 if plan.layout == "rows" else None
        return mask, position_ids

    def _rows_wrapped(self, attention_mask: Optional[torch.Tensor]) -> bool:
        """A padded batch's decode token can take the fast path: every row has filled its ring (so every slot of
        every row is stored and visible after the write) and the new column is a real token in every row (generate
        always extends the mask with ones). Rings only: a hybrid cache's full layers need the padding mask."""
        if self._counts is None or not self._fast_ok or self._full_idx is not None:
            return False
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            return False
        if self._counts_min is None:
            self._counts_min = int(self._counts.min())   # one host read after each masked forward
        return self._counts_min >= self.capacity

    def _padded_decode_plan(self, batch: int, device) -> "_Plan":
        """One real token per row of a padded batch whose rings are all full: per-row slots and positions from the
        row lengths, no mask; attention is the decode kernel (CUDA) or SDPA over the whole storage."""
        counts = self._counts.to(device)
        plan = _Plan(1, "rows", counts[:, None], counts + 1, kv_length=self.capacity, q_offset=self.capacity - 1)
        if self._graph_ok(device):
            plan.graph = plan.decode_kernel = True
            return plan
        if self.mode == "streaming" and self.sinks > 0:
            if self._joint_ready:   # every layer's sinks in one launch, before any layer attends
                L = self._n_ring
                cos, sin = self._sink_rotation(counts.repeat(L), L * batch, device)
                dst, src = self._joint[4]
                kv_sink_rotate_unchecked(dst, src, cos, sin)
            else:                   # fused into each layer's write
                plan.start = counts
                plan.cos, plan.sin = self._sink_rotation(counts, batch, device)
        plan.decode_kernel = device.type in DECODE_KERNEL_DEVICES
        return plan

    def _full_mask(self, batch: int, T: int, device, dtype, attention_mask, position_ids):
        """The full-attention layers' mask, built by transformers' create_causal_mask from the caller's 2D mask
        exactly as with DynamicCache (those layers store every column, padding included)."""
        from transformers.masking_utils import create_causal_mask
        embeds = torch.empty((batch, T, 0), dtype=dtype, device=device)   # only its shape, dtype, device are read
        return create_causal_mask(config=self._config, inputs_embeds=embeds, attention_mask=attention_mask,
                                  past_key_values=self, position_ids=position_ids, layer_idx=self._full_idx)

    # ----- CUDA graph decode -----

    def _graph_ok(self, device) -> bool:
        return (self.cuda_graph and device.type == "cuda" and self._joint_ready and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def _graph_body(self, original, kwargs: dict):
        """One decode step of the decoder, every step-dependent value read from device buffers (capturable)."""
        plan = self._plan
        plan.done.clear()
        B = self._batch
        per_row = plan.layout == "rows"
        step = self._g_counts if per_row else self._g_step      # [B] row stream indices, or [1] for all rows
        plan.pos_t = step.view(B, 1) if per_row else step.view(1, 1).expand(B, 1)
        plan.end_t = (step + 1).expand(B).contiguous()     # the kernel reads end[b] at stride 1
        if self.mode == "streaming" and self.sinks > 0:
            # Same fp32 products as _sink_rotation: max(0, n - shift) * inv_freq.
            inv_freq = self._decoder.rotary_emb.inv_freq.to(device=step.device, dtype=torch.float32)
            shift = self.window - 1 + self.sinks
            angle = (step - shift).clamp_min(0).to(torch.float32)[:, None] * inv_freq[None, :]
            dst, src = self._joint[4]
            rows = dst.shape[0]                     # L * B, layer-major
            cos, sin = angle.cos(), angle.sin()
            if per_row:
                cos, sin = cos.repeat(rows // B, 1), sin.repeat(rows // B, 1)
            else:
                cos, sin = cos.expand(rows, -1), sin.expand(rows, -1)
            kv_sink_rotate_unchecked(dst, src, cos, sin)
        if kwargs.get("position_ids") is None:
            kwargs = {**kwargs, "position_ids": plan.pos_t if per_row else step.view(1, 1)}
        return self._call_with_decode_attention(original, kwargs)

    def _call_with_decode_attention(self, original, kwargs: dict):
        """Run the decoder with our split-KV decode kernel as its attention (one token per row, every key handed
        over visible, so no mask). SDPA's one-query flash path walked 4100 keys per program at ~0.2 TB/s on the
        H200. transformers looks the attention function up by name at every forward, and naming an implementation
        without a mask builder also makes create_causal_mask return None. Restored right after the call."""
        config = self._config
        previous = config.__dict__.get("_attn_implementation_internal")
        # Gemma-2's eager attention softcaps its scores (its sdpa path does not); the kernel does not softcap.
        softcap = previous == "eager" and getattr(config, "attn_logit_softcapping", None) is not None
        if (previous not in SUPPORTED_ATTENTION or softcap or kwargs.get("output_attentions")
                or not _register_decode_attention()):
            return original(**kwargs)
        config._attn_implementation_internal = _DECODE_ATTENTION
        plan = self._plan
        plan.defer_write = (not plan.graph and isinstance(plan.pos, int) and plan.T == 1
                            and not torch.compiler.is_compiling())
        try:
            out = original(**kwargs)
        finally:
            config._attn_implementation_internal = previous
            plan.defer_write = False
            left = [k for k, w in _PENDING_WRITES.items() if w[5] is self]
            for k in left:   # a layer that did not attend through our function: store its token now
                keys, values, k_new, v_new, slot, _ = _PENDING_WRITES.pop(k)
                keys[:, :, slot] = k_new[:, :, 0]
                values[:, :, slot] = v_new[:, :, 0]
        if left:
            raise RuntimeError(f"RollingKVCache: {len(left)} layer(s) did not attend through the decode attention "
                               "installed for this step, so their outputs missed the new token (the tokens are stored "
                               "now). RollingKVCache expects every layer of a supported family to call transformers' "
                               "attention interface; please report the model.")
        return out

    def _graph_run(self, original, kwargs: dict):
        """Run a planned graph decode step: replay the captured decoder, or run it eagerly and capture it."""
        plan = self._plan
        x = kwargs.get("input_ids")
        x = kwargs.get("inputs_embeds") if x is None else x
        if plan.layout == "rows":
            if self._g_counts is None or self._g_counts.device != x.device or len(self._g_counts) != self._batch:
                self._g_counts = torch.zeros(self._batch, dtype=torch.long, device=x.device)
                self._graph = None
            self._g_counts.copy_(plan.pos[:, 0])
        else:
            if self._g_step is None or self._g_step.device != x.device:
                self._g_step = torch.zeros(1, dtype=torch.long, device=x.device)
                self._graph = None
            self._g_step.fill_(plan.pos)
        if x.device.type != "cuda" or any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states")):
            # No graph (per-layer outputs wanted, or a test forcing this path on CPU): same device-side math, eager.
            return self._graph_body(original, kwargs)
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        key = (plan.layout, tuple(sorted((k, tuple(v.shape), v.dtype, v.device) for k, v in tensors.items())),
               tuple(sorted((k, repr(v)) for k, v in kwargs.items()
                            if k not in tensors and k != "past_key_values")))
        g = self._graph
        if g is not None and g["key"] == key:
            for k, v in tensors.items():
                g["inputs"][k].copy_(v)
            g["graph"].replay()
            return g["out"]
        # First step with these inputs: run it eagerly on static copies (warming up kernels and workspaces on the
        # capture stream), then capture the same call. Capture records without executing, so the cache state
        # advances exactly once.
        inputs = {k: v.clone() for k, v in tensors.items()}
        static = {**kwargs, **inputs}
        current = torch.cuda.current_stream(x.device)
        stream = torch.cuda.Stream(device=x.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out = self._graph_body(original, static)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            g_out = self._graph_body(original, static)
        self._graph = {"key": key, "inputs": inputs, "graph": graph, "out": g_out}
        return out

    def _decode_positions(self, n: int, device) -> torch.Tensor:
        """position_ids [1, 1] = n, a view into a table of _TABLE consecutive positions (no op per step)."""
        table = self._pos_table
        i = n - self._pos_start
        if table is None or not 0 <= i < _TABLE or table.device != device:
            table = self._pos_table = (torch.arange(_TABLE, device=device) + n).view(_TABLE, 1, 1)
            self._pos_start, i = n, 0
        return table[i]

    def _decode_sink_rotation(self, n: int, device):
        """cos/sin [L * B, D/2] (stride 0 over rows) of _sink_rotation(n) for a uniform decode token at stream
        index n, views into a table of _TABLE steps (same fp32 products as _sink_rotation)."""
        table = self._rot_table
        i = n - self._rot_start
        if table is None or not 0 <= i < _TABLE or table[0].device != device:
            inv_freq = self._decoder.rotary_emb.inv_freq.to(device=device, dtype=torch.float32)
            shift = self.window - 1 + self.sinks
            steps = (torch.arange(_TABLE, device=device) + (n - shift)).clamp_min(0).to(torch.float32)
            angle = (steps[:, None] * inv_freq[None, :])[:, None, :]
            rows = self._n_ring * self._batch
            table = self._rot_table = (angle.cos().expand(-1, rows, -1), angle.sin().expand(-1, rows, -1))
            self._rot_start, i = n, 0
        return table[0][i], table[1][i]

    def _columns_arange(self, device) -> torch.Tensor:
        cols = self._cols
        if cols is None or cols.device != device:
            cols = self._cols = torch.arange(self.capacity, device=device)
        return cols

    def _sink_rotation(self, n0, batch: int, device):
        """cos/sin [B, D/2] (fp32) rotating the sinks by delta = max(0, n0 - window + 1 - sinks) positions, for
        row lengths n0 ([B] tensor, or an int shared by all rows). HF's angle arithmetic: fp32 position * inv_freq."""
        # The model's live buffer, as its rotary embedding uses it (fp32 math whatever the buffer's dtype).
        inv_freq = self._decoder.rotary_emb.inv_freq.to(device=device, dtype=torch.float32)
        shift = self.window - 1 + self.sinks
        if isinstance(n0, int):
            angle = (inv_freq * float(max(0, n0 - shift)))[None, :]
            return angle.cos().expand(batch, -1), angle.sin().expand(batch, -1)
        angle = (n0 - shift).clamp_min(0).to(torch.float32)[:, None] * inv_freq[None, :]
        return angle.cos(), angle.sin()

    def _slot_streams(self, n: torch.Tensor):
        """Stream index held by each storage slot ([B, C]) and whether it holds one, for row lengths n [B]."""
        S, W = self.sinks, self.window
        c = torch.arange(S, device=n.device)
        sink_idx = c.expand(n.shape[0], S)
        r = torch.arange(W, device=n.device)
        newest = torch.remainder(n - 1 - S, W)                      # ring offset of the newest token
        ring_idx = n[:, None] - 1 - torch.remainder(newest[:, None] - r[None, :], W)
        idx = torch.cat((sink_idx, ring_idx), dim=1)
        held = torch.cat((sink_idx < n[:, None], ring_idx >= S), dim=1)
        return idx, held

    def _general_decode_plan(self, batch, device, attention_mask, position_ids, dtype, n0):
        """One token per row (padding or not). Written first, then attention reads the whole storage: after the
        write a real query sees every stored slot (the sinks and a ring of exactly its last `window` tokens), and
        slot c is stored iff c < end, so the mask needs no per-slot stream indices."""
        cols = self._columns_arange(device)
        if attention_mask is not None:
            valid = attention_mask[:, -1:].to(device=device, dtype=torch.bool)       # [B, 1]
            pos = torch.where(valid, n0[:, None], -1)
            end = n0 + valid[:, 0]
            # Padding queries attend to one finite key (column 0) so no row is fully masked.
            vis = torch.where(valid, cols < end[:, None], cols == 0)
            if position_ids is None:
                position_ids = torch.where(valid, pos, 0)
        else:
            pos = n0[:, None]
            end = n0 + 1
            vis = cols < end[:, None]
            if position_ids is None:
                position_ids = pos
        plan = _Plan(1, "slots", pos, end, kv_length=self.capacity, q_offset=self.capacity - 1)
        if self.mode == "streaming" and self.sinks > 0:
            if self._joint_ready:
                # Every layer's sinks in one launch, before any layer writes. Slots s >= n0[b] are not stored
                # yet (zero in both buffers, and the angle is 0 while n0[b] < sinks), so rotating all is exact.
                L = self._n_ring
                cos, sin = self._sink_rotation(n0.repeat(L), L * batch, device)
                dst, src = self._joint[4]
                kv_sink_rotate_unchecked(dst, src, cos, sin)
            else:
                plan.start = n0
                plan.cos, plan.sin = self._sink_rotation(n0, batch, device)
        mask = vis[:, None, None, :]                                                  # [B, 1, 1, C]
        if self._config._attn_implementation == "eager":
            mask = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
        return plan, mask, position_ids

    def _general_plan(self, batch, T, device, attention_mask, position_ids, dtype):
        S, W, C = self.sinks, self.window, self.capacity
        if self._uniform is not None:
            n0 = torch.full((batch,), self._uniform, dtype=torch.long, device=device)
        else:
            n0 = self._counts.to(device)
        if T == 1:
            return self._general_decode_plan(batch, device, attention_mask, position_ids, dtype, n0)
        if attention_mask is not None:
            valid = attention_mask[:, -T:].to(device=device, dtype=torch.bool)
            rank = valid.long().cumsum(-1) - 1
            pos = torch.where(valid, n0[:, None] + rank, -1)
            end = n0 + valid.long().sum(-1)
        else:
            valid = torch.ones((batch, T), dtype=torch.bool, device=device)
            pos = n0[:, None] + torch.arange(T, device=device)
            end = n0 + T
        q = pos                                                      # [B, T]
        # Keys are cat(storage, chunk): the chunk's early queries need tokens the write evicts.
        storage = self._columns > 0
        plan = _Plan(T, "concat", pos, end, storage_in_keys=storage)
        chunk_cols = torch.arange(T, device=device)
        if storage:
            sidx, sheld = self._slot_streams(n0)
            kidx = torch.cat((sidx, pos), dim=1)
            kheld = torch.cat((sheld, valid), dim=1)
            own_col = (chunk_cols + C)[None, :]
        else:
            kidx, kheld = pos, valid
            own_col = chunk_cols[None, :]
        plan.kv_length = kidx.shape[1]
        plan.q_offset = plan.kv_length - T
        kj = kidx[:, None, :]
        qi = q[:, :, None]
        vis = kheld[:, None, :] & (kj <= qi) & ((kj < S) | (kj > qi - W))
        # Padding queries attend to one finite key (their own column) so no row is fully masked.
        cols = torch.arange(kidx.shape[1], device=device)
        pad_vis = cols[None, None, :] == own_col[:, :, None]
        vis = torch.where(valid[:, :, None], vis, pad_vis)
        if self.mode == "streaming":
            plan.start = n0
            plan.cos, plan.sin = self._sink_rotation(n0, batch, device)
        mask = vis[:, None]
        if self._config._attn_implementation == "eager":
            mask = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
        if position_ids is None:
            position_ids = torch.where(valid, pos, 0)
        return plan, mask, position_ids


# ---------------------------------------------------------------------------------------------------------------
# Decode attention for graph steps (registered with transformers' AttentionInterface under its own name)
# ---------------------------------------------------------------------------------------------------------------

_DECODE_ATTENTION = "swift_liger_rolling_decode"


# Eager decode: RollingLayer.update leaves each layer's new token here (keyed by id of the keys it returned) and
# the layer's attention call below stores it in the same launch as the attention (ring write + decode attention
# in 2 launches instead of 3: ~40 us of host time per layer and step on the H200 host).
_PENDING_WRITES: dict = {}


def _rolling_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-function contract: q [B, Hq, 1, D], k/v [B, Hkv, C, D] -> ([B, 1, Hq, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pending = _PENDING_WRITES.pop(id(key), None) if _PENDING_WRITES else None
    if pending is not None and pending[0] is key and pending[1] is value:
        _, _, k_new, v_new, slot, _ = pending
        return decode_attention_write_unchecked(query, key, value, float(scale), k_new, v_new, slot), None
    return decode_attention_unchecked(query, key, value, float(scale)), None


@functools.lru_cache(maxsize=None)
def _register_decode_attention() -> bool:
    try:
        from transformers import AttentionInterface
        AttentionInterface.register(_DECODE_ATTENTION, _rolling_decode_attention)
        return True
    except Exception:   # an older registry: graph steps keep the model's own attention
        return False


# ---------------------------------------------------------------------------------------------------------------
# Decoder pre-forward hook
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _forward_params(cls) -> tuple:
    return tuple(inspect.signature(cls.forward).parameters)[1:]


def _rolling_pre_hook(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if cache is None and args:
        names = _forward_params(type(module))
        if "past_key_values" in names[:len(args)]:
            kwargs = {**dict(zip(names, args)), **kwargs}
            args = ()
            cache = kwargs.get("past_key_values")
    if not isinstance(cache, RollingKVCache):
        return None
    if args:
        kwargs = {**dict(zip(_forward_params(type(module)), args)), **kwargs}
        args = ()
    if cache._decoder is not module:
        raise ValueError("this RollingKVCache was built for a different model")
    _check_attention(module.config)
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("RollingKVCache: the decoder got neither input_ids nor inputs_embeds")
    mask = kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ValueError("RollingKVCache builds the attention mask itself: pass a 2D padding mask [B, columns] "
                         "or none (not a 4D mask or a mask dict)")
    embeds = kwargs.get("inputs_embeds")
    new_mask, position_ids = cache._begin_forward(x.shape[0], x.shape[1], x.device, mask,
                                                  kwargs.get("position_ids"), module, embeds)
    if new_mask is not None and cache._full_idx is not None:
        # Hybrid decoders take a mask per layer type: ours for the rings, transformers' own for the full layers.
        dtype = embeds.dtype if embeds is not None else module.dtype
        new_mask = {"sliding_attention": new_mask,
                    "full_attention": cache._full_mask(x.shape[0], x.shape[1], x.device, dtype, mask, position_ids)}
    kwargs["attention_mask"] = new_mask
    kwargs["position_ids"] = position_ids
    return args, kwargs


def _ensure_hook(decoder: torch.nn.Module) -> None:
    if getattr(decoder, _HOOK_ATTR, None) is None:
        handle = decoder.register_forward_pre_hook(_rolling_pre_hook, with_kwargs=True)
        object.__setattr__(decoder, _HOOK_ATTR, handle)


def _rolling_decoder_forward(self, *args, **kwargs):
    """The decoder's instance-level forward while a RollingKVCache knows it: planned decode steps go through the
    cache (graph replay, decode attention), everything else to the forward it replaced. Bound with MethodType and
    reading its state from the instance, so a deep copy runs the copy's own modules."""
    previous = self.__dict__[_GRAPH_ATTR][0]
    original = previous if previous is not None else functools.partial(type(self).forward, self)
    cache = kwargs.get("past_key_values")
    plan = cache._plan if isinstance(cache, RollingKVCache) and not args else None
    if plan is not None and plan.graph:
        return cache._graph_run(original, kwargs)
    if plan is not None and plan.decode_kernel:
        return cache._call_with_decode_attention(original, kwargs)
    return original(*args, **kwargs)


def _ensure_forward_wrapper(decoder: torch.nn.Module) -> None:
    """Install _rolling_decoder_forward on this decoder instance (removable)."""
    if getattr(decoder, _GRAPH_ATTR, None) is not None:
        return
    previous = decoder.__dict__.get("forward")     # e.g. accelerate's hook wrapper; None: the class forward
    object.__setattr__(decoder, _GRAPH_ATTR, (previous,))
    object.__setattr__(decoder, "forward", types.MethodType(_rolling_decoder_forward, decoder))


def _remove_forward_wrapper(decoder: torch.nn.Module) -> None:
    state = decoder.__dict__.get(_GRAPH_ATTR)
    if state is None:
        return
    if state[0] is not None:
        object.__setattr__(decoder, "forward", state[0])
    else:
        object.__delattr__(decoder, "forward")
    object.__delattr__(decoder, _GRAPH_ATTR)


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


def _check_fits(decoder, config, window: int, sinks: int, ring_layers: int) -> None:
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
        raise RollingCacheRefused(f"liger_rolling_cache: window {window} + {sinks} sinks needs {need / 2**30:,.1f} GiB of keys "
                         f"and values per sequence on this model ({ring_layers} layers x {kv_heads} KV heads x "
                         f"{head_dim} x 2 x {param.element_size()} bytes per token), more than the {param.device} "
                         f"device's {total / 2**30:,.1f} GiB; the largest window that fits at all is {largest}")


# ---------------------------------------------------------------------------------------------------------------
# Installation on a model (the rolling_cache fusion, `liger_rolling_cache`, calls it)
# ---------------------------------------------------------------------------------------------------------------

def install_rolling_cache(model: torch.nn.Module, window, sinks: Optional[int] = None, mode: str = "absolute",
                          cuda_graph: bool = False):
    """Make every ``model.generate(...)`` call that brings no cache of its own use a fresh RollingKVCache
    (``window`` an int, sinks default 4, or ``"model"``: see RollingKVCache).

    Validates the configuration now (bad window/sinks/mode, unsupported family or attention are errors here, not at
    the first generate). Wraps ``generate`` on this instance only; ``uninstall_rolling_cache`` undoes it. Calls that
    pass ``past_key_values``, ``cache_implementation`` or ``use_cache=False`` are left alone. Returns the model.
    """
    RollingKVCache(model, window=window, sinks=sinks, mode=mode, cuda_graph=cuda_graph)   # validation, hooks
    settings = {"window": window, "sinks": sinks, "mode": mode, "cuda_graph": cuda_graph}
    state = getattr(model, _INSTALL_ATTR, None)
    if state is not None:
        state["settings"] = settings
        return model
    state = {"settings": settings, "original": model.__dict__.get("generate")}   # None: the class method
    object.__setattr__(model, _INSTALL_ATTR, state)
    object.__setattr__(model, "generate", types.MethodType(_rolling_generate, model))
    return model


def _rolling_generate(self, *args, **kwargs):
    """``generate`` of a model with install_rolling_cache: a fresh RollingKVCache unless the call brings its own
    cache (or none). Bound with MethodType and reading its settings from the instance, so deep copies build caches
    for themselves."""
    state = self.__dict__[_INSTALL_ATTR]
    gen_config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
    wants_cache = (kwargs.get("past_key_values") is None and kwargs.get("use_cache", True) is not False
                   and kwargs.get("cache_implementation") is None
                   and getattr(gen_config, "cache_implementation", None) is None
                   and getattr(gen_config, "use_cache", True) is not False)
    if wants_cache:
        kwargs["past_key_values"] = RollingKVCache(self, **state["settings"])
    original = state["original"]
    if original is None:
        return type(self).generate(self, *args, **kwargs)
    return original(*args, **kwargs)


def uninstall_rolling_cache(model: torch.nn.Module) -> None:
    """Undo ``install_rolling_cache`` (and remove the decoder hook)."""
    state = model.__dict__.get(_INSTALL_ATTR)
    if state is not None:
        if state["original"] is not None:
            object.__setattr__(model, "generate", state["original"])
        else:
            object.__delattr__(model, "generate")
        object.__delattr__(model, _INSTALL_ATTR)
    try:
        decoder = _find_decoder(model)
    except ValueError:
        return
    handle = getattr(decoder, _HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        object.__delattr__(decoder, _HOOK_ATTR)
    _remove_forward_wrapper(decoder)
