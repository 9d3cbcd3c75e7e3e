"""The "swift_liger" attention implementation for transformers: packed rows (padding-free batches, `--packing`) and
padded batches train through `ops.varlen_attention` (Triton on CUDA), no flash-attn package needed.

    register()                                    # idempotent; then
    AutoModelForCausalLM.from_pretrained(..., attn_implementation="swift_liger")
    # or model.set_attn_implementation("swift_liger"); in ms-swift: --attn_impl swift_liger

It mirrors transformers' flash-attention path (`masking_utils.flash_attention_mask`, `_flash_attention_forward`):

* the mask function (`mask_interface`) returns None when no token is padding and the 2D boolean padding mask
  otherwise; the attention function reads each row's documents from the `position_ids` the decoder layer passes
  down (a document starts where a position is not its predecessor + 1, as `find_packed_sequence_indices` and
  `_is_packed_sequence` read them), from ms-swift's `cu_seq_lens_q` when there are no 2D position ids, and splits
  a padded row at its padding (a run of padding is a document of its own, whose outputs nobody reads).
  Unlike flash-attn, a 2D mask does not make it ignore position ids: a padded row whose positions restart is
  split there too (flash and SDPA would let its documents see each other).
* whatever that cannot express gets SDPA's own mask and `sdpa_attention_forward` (or, for a model with an attention
  logit softcap, which SDPA ignores, an eager softmax with the cap): generation steps with a KV cache (query length
  != key length, or a cache offset), 4D masks a model or user built, masks with padding inside a row, custom mask
  overlays (`or_mask_function` / `and_mask_function`, e.g. bidirectional image tokens), bidirectional configs and
  non-causal modules. A prompt's prefill (empty cache) still runs the varlen kernel.
* sliding windows and softcaps come from the attention call (`sliding_window`, `softcap`): query i sees key j iff
  i - j < sliding_window, as masking_utils.sliding_window_overlay (kv_idx > q_idx - sliding_window).
* attention dropout is refused (ValueError naming the model's attention_dropout) in the varlen path rather than
  silently dropped: the kernel has none. Generation steps that go to SDPA keep whatever the module passes.

Per forward, every layer gets the same position_ids / attention_mask objects: their document bounds
(`doc_bounds`, ~6 small ops) are computed once and kept in a small cache keyed on those tensors' identity
(weak references), shape and version counter, so a layer's recompute under gradient checkpointing finds them too,
and a tensor changed in place or a new forward misses. Entries die with their key tensors. `COUNTS` counts calls.

Not a registry fusion (no LigerConfig key): an attention implementation, chosen through the model config. Imports
torch and transformers at the top (nothing imports this module at flag-parsing time).
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Optional, Tuple

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from ..ops import _launch, varlen_attention_kernel as vk

NAME = "swift_liger"
MAX_HEAD_DIM = 256
# varlen: calls through the kernel; bounds: doc_bounds computations (one per forward and mask);
# sdpa / eager: calls handed to SDPA or to the softcap-aware eager softmax; dense_masks: SDPA masks built
COUNTS: Counter = Counter()


def _count_call(key: str) -> None:
    """One attention call of `key`'s kind, except inside graph_layers' compile-ahead pass (nothing of ours launches
    there, and it is not a training call)."""
    if not _launch.compiling_ahead():
        COUNTS[key] += 1


def reset_counts() -> dict:
    out = dict(COUNTS)
    COUNTS.clear()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Per-forward document bounds
# ---------------------------------------------------------------------------------------------------------------

def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:      # inference tensors keep no version counter: not cached
        return None


class BoundsCache:
    """A few (key tensors -> seq_ids, bounds) entries, newest first. A key holds weak references to its tensors plus
    their version counters, shapes and strides: a hit needs the very same live objects, unchanged since. Hybrid
    models (full and sliding layers) get one padding mask object per layer type, hence more than one entry."""

    def __init__(self, size: int = 4):
        self.size = size
        self._entries = []          # [(keys, extra, value)]
        self._lock = threading.RLock()   # re-entrant: a weakref callback (_prune) can fire while it is held

    def _prune(self, _ref=None) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if all(k is None or k[0]() is not None for k in e[0])]

    def _key(self, t):
        if t is None:
            return None
        version = _version(t)
        if version is None:
            raise LookupError
        return (weakref.ref(t, self._prune), version, tuple(t.shape), t.stride())

    @staticmethod
    def _matches(keys, tensors) -> bool:
        for key, t in zip(keys, tensors):
            if key is None or t is None:
                if key is not t:
                    return False
                continue
            ref, version, shape, stride = key
            if ref() is not t or _version(t) != version or tuple(t.shape) != shape or t.stride() != stride:
                return False
        return True

    def get(self, tensors: tuple, extra: tuple, compute):
        entries = self._entries
        for keys, ext, value in entries:
            if ext == extra and self._matches(keys, tensors):
                return value
        value = compute()
        try:
            keys = tuple(self._key(t) for t in tensors)
        except LookupError:
            return value
        with self._lock:   # entries for an older version of one of these very tensors can never hit again
            kept = [e for e in self._entries if not self._stale(e[0], keys)]
            self._entries = [(keys, extra, value)] + kept[: self.size - 1]
        return value

    @staticmethod
    def _stale(old, new) -> bool:
        for a, b in zip(old, new):
            if a is not None and b is not None and a[0]() is b[0]() and a[1:] != b[1:]:
                return True
        return False

    def clear(self) -> None:
        with self._lock:
            self._entries = []

    def __len__(self) -> int:
        return len(self._entries)


CACHE = BoundsCache()


def documents(position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], batch: int, length: int, device) -> torch.Tensor:
    """Document ids [B, T] for one forward: from 2D position ids (restarts split documents), else ms-swift's
    cu_seq_lens_q (one packed row), else one document per row; a 2D padding mask splits each row at its padding."""
    pos = None
    if position_ids is not None and position_ids.ndim == 2 and position_ids.shape[-1] == length:
        pos = position_ids.to(device)
        if pos.shape[0] != batch:
            pos = pos.expand(batch, length)
    if pos is None and attention_mask is None and cu_seqlens is not None and batch == 1:
        cu = cu_seqlens.to(device=device, dtype=torch.int64).flatten()
        steps = torch.arange(length, device=device, dtype=torch.int64)
        return torch.searchsorted(cu[1:-1].contiguous(), steps, right=True).unsqueeze(0)
    if pos is None:
        if attention_mask is None:
            return torch.zeros((batch, length), dtype=torch.int32, device=device)
        pos = torch.arange(length, device=device).expand(batch, length)
    return vk.seq_ids_from_positions(pos, attention_mask)


def doc_bounds_for(position_ids, attention_mask, cu_seqlens, batch: int, length: int, device):
    """(seq_ids, (lo, hi)) of this forward, computed once per set of key tensors (see BoundsCache)."""
    def compute():
        COUNTS["bounds"] += 1
        ids = documents(position_ids, attention_mask, cu_seqlens, batch, length, device)
        return ids, vk.doc_bounds(ids)
    return CACHE.get((position_ids, attention_mask, cu_seqlens), (batch, length, str(device)), compute)


# ---------------------------------------------------------------------------------------------------------------
# Mask function (AttentionMaskInterface)
# ---------------------------------------------------------------------------------------------------------------

def _needs_dense_mask(q_length, kv_length, q_offset, kv_offset, kwargs) -> bool:
    offsets = all(isinstance(o, int) and o == 0 for o in (q_offset, kv_offset))
    return (not offsets or q_length != kv_length or bool(kwargs.get("use_vmap"))
            or "allow_is_bidirectional_skip" in kwargs)


def mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   mask_function=causal_mask_function, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """None (no padding) or the [B, kv_length] boolean padding mask, as flash_attention_mask returns; SDPA's mask
    (4D, or None where SDPA relies on is_causal) for what the varlen path does not take (see the module doc)."""
    def dense():
        COUNTS["dense_masks"] += 1
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)

    if _needs_dense_mask(q_length, kv_length, q_offset, kv_offset, kwargs):
        return dense()
    if attention_mask is None:
        return None
    am = attention_mask[:, -kv_length:]
    if am.shape[-1] != kv_length:
        return dense()
    if am.dtype != torch.bool:
        am = am.to(torch.bool)
    runs = am[:, 0].to(torch.int32) + (am[:, 1:] & ~am[:, :-1]).sum(-1)   # runs of real tokens per row
    all_real, one_run = torch.stack([am.all(), (runs <= 1).all()]).tolist()
    if all_real:
        return None
    if not one_run:           # padding inside a row: SDPA lets the tokens after it see those before it
        return dense()
    return am


# ---------------------------------------------------------------------------------------------------------------
# Attention function (AttentionInterface)
# ---------------------------------------------------------------------------------------------------------------

def _lower_right_causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= i)[None, None]


def _eager_softcap(module, query, key, value, mask, scaling, dropout, softcap, is_causal):
    """Eager attention with Gemma-2's logit softcap (SDPA has none): cap, then mask, as the model's eager code."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and is_causal and q_len > 1:
        mask = _lower_right_causal(q_len, kv_len, query.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., :kv_len], torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask[..., :kv_len]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), None


def _fallback(module, query, key, value, attention_mask, scaling, dropout, softcap, is_causal, kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.ndim == 2:   # a caller that did not use our mask function
        pad = attention_mask[:, -kv_len:].to(torch.bool)[:, None, None, :]
        attention_mask = pad & _lower_right_causal(q_len, kv_len, query.device) if is_causal else pad
    if softcap:
        _count_call("eager")
        return _eager_softcap(module, query, key, value, attention_mask, scaling, dropout, softcap, is_causal)
    _count_call("sdpa")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, Hq, T, D], key/value [B, Hkv, S, D] -> ([B, T, Hq, D], None)."""
    return _forward(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, **kwargs)


def _forward(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, **kwargs):
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    config = getattr(module, "config", None)
    if (query.shape[2] != key.shape[2] or not is_causal or not getattr(config, "is_causal", True)
            or (attention_mask is not None and attention_mask.ndim != 2)):
        return _fallback(module, query, key, value, attention_mask, scaling, dropout, softcap, is_causal, kwargs)
    if dropout:
        raise ValueError(
            f"swift_liger attention has no attention dropout, and {type(module).__name__} trains with dropout "
            f"{dropout} (the model config's attention_dropout): set attention_dropout to 0 in the model's "
            "config.json, or use --attn_impl sdpa (no packing) / flash_attn")
    head_dim = query.shape[-1]
    if head_dim > MAX_HEAD_DIM or value.shape[-1] != head_dim or key.shape[-1] != head_dim:
        raise ValueError(f"swift_liger attention takes query/key/value head dims up to {MAX_HEAD_DIM}, all equal; "
                         f"{type(module).__name__} has {head_dim} / {key.shape[-1]} / {value.shape[-1]} "
                         "(use --attn_impl sdpa or flash_attn for this model)")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    B, _, T, _ = query.shape
    if torch.compiler.is_compiling():
        # A compiled decoder layer (liger_compile_layers): the bounds are six traced ops per layer (the cache's weak
        # references and version counters are not traceable) and the kernels are custom-op nodes, so the layer
        # stays one graph. Nothing is counted: a compiled graph replays without running this Python.
        seq_ids = documents(kwargs.get("position_ids"), attention_mask, kwargs.get("cu_seq_lens_q"), B, T,
                            query.device)
        bounds = vk.doc_bounds(seq_ids)
    else:
        seq_ids, bounds = doc_bounds_for(kwargs.get("position_ids"), attention_mask, kwargs.get("cu_seq_lens_q"),
                                         B, T, query.device)
        _count_call("varlen")
    out = vk.varlen_attention_unchecked(query, key, value, bounds, float(scaling), float(softcap or 0.0),
                                        int(sliding_window or 0), seq_ids)
    return out, None


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

def register() -> None:
    """Make attn_implementation="swift_liger" known to transformers (attention and mask interfaces). Idempotent;
    must run before a model with that implementation is built (transformers validates the name at load)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if AttentionInterface._global_mapping.get(NAME) is not attention_forward:
        AttentionInterface.register(NAME, attention_forward)
    if AttentionMaskInterface._global_mapping.get(NAME) is not mask_interface:
        AttentionMaskInterface.register(NAME, mask_interface)


def registered() -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    return (AttentionInterface._global_mapping.get(NAME) is attention_forward
            and AttentionMaskInterface._global_mapping.get(NAME) is mask_interface)


__all__ = ["NAME", "COUNTS", "CACHE", "BoundsCache", "attention_forward", "doc_bounds_for", "documents",
           "mask_interface", "register", "registered", "reset_counts"]
