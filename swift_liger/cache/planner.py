"""Per-forward planning of a RollingKVCache: for each forward of the decoder, once for all layers, the stream index
and ring slot of every new token, the position ids, the sink rotation (streaming mode) and what attention sees (a
mask of our own, or none so that transformers builds its usual causal one). Holds the plan (Plan), the planning
methods (ForwardPlanner, mixed into RollingKVCache in ring.py) and the decoder's pre-forward hook that runs them.

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
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Optional

import torch
from transformers.masking_utils import create_causal_mask

from ..ops.kv_ring_write_kernel import kv_sink_rotate_unchecked
from .support import check_attention

_TABLE = 256   # decode steps covered by one precomputed position / sink-rotation table
# Devices whose eager single-token steps attend with the decode kernel (on CPU SDPA is as good; tests add "cpu").
DECODE_KERNEL_DEVICES = ("cuda",)
_HOOK_ATTR = "_swift_liger_rolling_hook"


@dataclasses.dataclass(slots=True)
class Plan:
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
    lens_t: Optional[torch.Tensor] = None  # graph: [B] keys each row's decode attention sees (decode.STEP_LENS)
    defer_write: bool = False        # eager decode with our attention installed: each layer's write is done by its
                                     # decode-attention launch (see PENDING_WRITES)


class ForwardPlanner:
    """RollingKVCache's planning methods (the class in ring.py mixes them in; they read and advance its stream state:
    _columns, _uniform, _counts, see RollingKVCache._reset_state). _begin_forward is called by the decoder's
    pre-forward hook below and leaves the plan in ``self._plan`` for the layers' updates."""

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
            if (n >= C or self._early_graph()) and self._graph_ok(device):
                # Positions and the sink rotation are computed inside the graph from the step counter.
                plan = Plan(1, "full", n, None, kv_length=C, q_offset=C - 1, graph=True, decode_kernel=True)
            else:
                if position_ids is None:
                    position_ids = self._decode_positions(n, device)
                if n < C:
                    plan = Plan(1, "prefix", n, None, prefix_len=n + 1, kv_length=n + 1, q_offset=n)
                else:
                    plan = Plan(1, "full", n, None, kv_length=C, q_offset=C - 1)
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
        elif n is None and T == 1 and self._rows_wrapped(attention_mask, device):
            plan = self._padded_decode_plan(batch, device)
            if position_ids is None:
                position_ids = plan.pos
        elif attention_mask is None and n is not None and self._fast_ok and n + T <= C:
            # Uniform rows: the kernel takes the start index as a scalar, no per-step index tensors.
            plan = Plan(T, "prefix", n, None, prefix_len=n + T, kv_length=n + T, q_offset=n)
            if position_ids is None:
                position_ids = (torch.arange(T, device=device) + n).unsqueeze(0)
        else:
            dtype = embeds.dtype if embeds is not None else module.dtype
            plan, mask, position_ids = self._general_plan(batch, T, device, attention_mask, position_ids, dtype)
        self._plan = plan
        self.forwards[plan.graph] += 1
        self._columns += T
        if attention_mask is not None:
            self._uniform = None
        elif n is not None:
            self._uniform = n + T
        if self._uniform is None:
            self._counts = plan.end
            self._counts_min = self._counts_min + 1 if plan.layout == "rows" else None
        return mask, position_ids

    def _rows_wrapped(self, attention_mask: Optional[torch.Tensor], device) -> bool:
        """A padded batch's decode token can take the fast path: the new column is a real token in every row
        (generate always extends the mask with ones) and either every row has filled its ring (so every slot of
        every row is stored and visible after the write) or the step is a graph step, whose decode attention stops
        each row at its own length. Rings only: a hybrid cache's full layers need the padding mask."""
        if self._counts is None or not self._fast_ok or self._full_idx is not None:
            return False
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            return False
        if self._counts_min is None:
            self._counts_min = int(self._counts.min())   # one host read after each masked forward
        return self._counts_min >= self.capacity or (self._early_graph() and self._graph_ok(device))

    def _padded_decode_plan(self, batch: int, device) -> "Plan":
        """One real token per row of a padded batch whose rings are all full: per-row slots and positions from the
        row lengths, no mask; attention is the decode kernel (CUDA) or SDPA over the whole storage."""
        counts = self._counts.to(device)
        plan = Plan(1, "rows", counts[:, None], counts + 1, kv_length=self.capacity, q_offset=self.capacity - 1)
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
        embeds = torch.empty((batch, T, 0), dtype=dtype, device=device)   # only its shape, dtype, device are read
        return create_causal_mask(config=self._config, inputs_embeds=embeds, attention_mask=attention_mask,
                                  past_key_values=self, position_ids=position_ids, layer_idx=self._full_idx)

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
        plan = Plan(1, "slots", pos, end, kv_length=self.capacity, q_offset=self.capacity - 1)
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
        plan = Plan(T, "concat", pos, end, storage_in_keys=storage)
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
    if not isinstance(cache, ForwardPlanner):   # only RollingKVCache (ring.py) mixes it in
        return None
    if args:
        kwargs = {**dict(zip(_forward_params(type(module)), args)), **kwargs}
        args = ()
    if cache._decoder is not module:
        raise ValueError("this RollingKVCache was built for a different model")
    check_attention(module.config)
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
    cache._wants_attentions = bool(kwargs.get("output_attentions"))   # such steps keep the model's own attention
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


def ensure_hook(decoder: torch.nn.Module) -> None:
    if getattr(decoder, _HOOK_ATTR, None) is None:
        handle = decoder.register_forward_pre_hook(_rolling_pre_hook, with_kwargs=True)
        object.__setattr__(decoder, _HOOK_ATTR, handle)


def remove_hook(decoder: torch.nn.Module) -> None:
    handle = getattr(decoder, _HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        object.__delattr__(decoder, _HOOK_ATTR)
