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

This module holds the cache (RollingKVCache), its two layer kinds (RollingLayer, FullLayer) and their storage. The
planning of each forward is in planner.py, decode steps (decode kernel, CUDA graph) in decode.py, the model checks in
support.py, the settings check in settings.py, install_rolling_cache in install.py.

Transformers hooks relied on (5.17-5.19): ``Cache(layers=...)``, ``Cache.update(k, v, layer_idx)`` called by
the attention after RoPE, ``get_seq_length`` (generate slices continued prompts with it: it counts columns,
padding included), ``get_mask_sizes`` / ``get_query_offset`` (fast path), the 4D-mask early exit, and the
decoder being called with keyword arguments (``past_key_values=``, ``attention_mask=``, ``position_ids=``); for
window="model" also ``get_layer_types_and_kwargs``, ``create_causal_mask(layer_idx=)``, ``Cache.is_sliding`` (which
layer each mask builder sizes against) and decoders taking a mask mapping keyed by layer type.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..ops.kv_ring_write_kernel import kv_ring_write_unchecked, kv_sink_rotate
from .decode import PENDING_WRITES, DecodeRunner, ensure_forward_wrapper
from .planner import ForwardPlanner, Plan, ensure_hook
from .settings import EXACT_WINDOW, MODEL_WINDOW, check_settings
from .support import check_family, check_fits, find_decoder, model_layer_kinds, validate_model, warn_mixed

_FULL_BLOCK = 1024   # full-attention layers of a hybrid cache grow their storage by this many columns at a time


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

    def update(self, key_states, value_states, plan: Optional[Plan] = None, *args, **kwargs):
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
            PENDING_WRITES[id(keys)] = (keys, values, key_states, value_states, slot, o)
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

    def update(self, key_states, value_states, plan: Optional[Plan] = None, *args, **kwargs):
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


class RollingKVCache(ForwardPlanner, DecodeRunner, Cache):
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
        cuda_graph: on CUDA, run each single-token decode step whose new column is real in every row as one
            replay of a CUDA graph of the decoder (captured at the first such step; the LM head and sampling stay
            eager), from the first decode step on: the decode attention reads each row's length from the step
            counter, so steps before the ring is full replay the same graph. Decode is then bound by the GPU, not by
            ~20 us of Python per layer. A window of at least prompt + new tokens never evicts: exact attention
            with graph steps (GRPO rollouts through ms-swift's pt engine). Needs ``torch.no_grad()`` (``generate``
            does that); ``output_attentions`` / ``output_hidden_states`` run eagerly (before the ring is full,
            ``output_attentions`` steps keep the eager path). The returned ``last_hidden_state`` is the graph's
            static buffer, valid until the next step. Not with window="model".

    Use as ``model.generate(..., past_key_values=RollingKVCache(model, window=4096, sinks=4))``, or call
    ``install_rolling_cache(model, ...)`` once so that every ``generate`` call gets a fresh one. Ring storage is
    allocated at the first forward (batch size, heads, dtype and device come from it) and never reallocated;
    ``reset()`` clears it for reuse with the same batch size. ``layer_kinds`` says which layers are rings.
    """

    def __init__(self, model: torch.nn.Module, window, sinks: Optional[int] = None, mode: str = "absolute",
                 cuda_graph: bool = False):
        settings = check_settings(window, sinks, mode, cuda_graph)
        if settings["window"] == EXACT_WINDOW:
            raise ValueError("RollingKVCache: window 'exact' is sized per generate call by install_rolling_cache "
                             "(--liger_rolling_cache exact); a cache built by hand takes an int window (prompt + new "
                             "tokens, sinks=0, is exact attention)")
        self.own_window = settings["window"] == MODEL_WINDOW
        check_family(model, self.own_window)
        decoder = find_decoder(model)
        validate_model(decoder, mode, self.own_window)
        config = decoder.config
        if self.own_window:
            kinds, window = model_layer_kinds(config)
        else:
            kinds = ("ring",) * config.num_hidden_layers
            warn_mixed(config, window, settings["sinks"])
        sinks = settings["sinks"]
        if not self.own_window:
            check_fits(decoder, config, window, sinks, kinds.count("ring"))
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
        self._wants_attentions = False          # the current forward asks for attention weights (set by the hook)
        self.forwards = [0, 0]                  # decoder forwards planned: [eager, CUDA-graph decode steps]
        self.graph_error: Optional[str] = None  # why capturing the decode step failed (then cuda_graph is off)
        self._reset_state()
        ensure_hook(decoder)
        ensure_forward_wrapper(decoder)

    def _reset_state(self) -> None:
        self._columns = 0                       # columns processed, padding included (generate's past length)
        self._uniform: Optional[int] = 0        # stream length when all rows are equal and unpadded, else None
        self._counts: Optional[torch.Tensor] = None   # [B] per-row stream lengths once rows differ
        self._counts_min: Optional[int] = None   # min of _counts when known on the host (None: read it)
        self._batch: Optional[int] = None
        self._plan: Optional[Plan] = None
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

    # ----- storage -----

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
