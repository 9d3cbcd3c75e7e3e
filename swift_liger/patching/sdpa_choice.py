"""Which fused SDPA kernel a decoder layer's attention runs, chosen per batch shape by timing (fusions/cudnn_attention).

torch's SDPA tries its backends in a priority order and runs the first that supports the call. On Hopper cuDNN's
fused attention is the faster kernel at long causal rows: H200, Qwen2.5-7B heads, one 8k-token row, forward +
backward 499 TFLOP/s against FlashAttention-2's 287 (`attn_lab_h200.json`). torch's CPU build lists FlashAttention-2
first and cuDNN after math; torch 2.11's CUDA build on the H200 already ran cuDNN by default at every training shape
of tools/sdpa_probe.py (`sdpa_probe_h200.json`), so there every call keeps torch's order and nothing is timed.
`SdpaChoice.order_for(hidden_states, kwargs, training)` returns the priority order to run one layer call under
(cuDNN first) or None (torch's own order):

* only for calls transformers sends to SDPA as plain causal attention: no attention mask tensor (a padded batch
  passes one; cuDNN's backward has returned NaN with explicit masks, pytorch#196678), no KV cache, CUDA, bf16/fp16;
* per key (rows, tokens rounded up to a power of two, dtype, training or not) the first call times FlashAttention
  against cuDNN on random tensors of the layer's head shape (forward, plus backward for a training layer or with
  autograd on; median of 3 timed runs after a first one, which is recorded apart) and keeps cuDNN only if it is at
  least 3% faster; nothing is timed while a CUDA graph is being captured or torch.compile traces (those calls keep
  torch's order);
* the order only moves cuDNN to the front: torch still checks each call and falls back to the next backend it
  supports, and a backend the user switched off (torch.backends.cuda.enable_cudnn_sdp(False)) stays off.

`prefer(order)` / `restore(prev)` set and restore torch's process-wide priority order (0.2 us per pair on this CPU,
against 15 us for torch.nn.attention.sdpa_kernel): the layer's eager forward runs between them, so its reentrant
recompute does too. Layers that graph_layers replays keep torch's order (their captures hold FlashAttention-2):
those are the short, host-bound shapes; at 7B-8B and long rows graph_layers measures the eager layer faster. cuDNN
builds an execution plan per exact shape (rows, tokens): its first call at Qwen2.5-7B 8k took 121 ms (recorded apart as
cudnn_first_ms); batches of varying length pay that per new length.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MIN_TOKENS = 512          # shorter rows keep torch's order (no measurement below this)
MARGIN = 0.97             # cuDNN must take at most 97% of FlashAttention's time
_FLASH = SDPBackend.FLASH_ATTENTION
_CUDNN = SDPBackend.CUDNN_ATTENTION
_MISSING = object()


def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


def prefer(order: List[int]) -> List[int]:
    """Set torch's SDPA priority order; returns the previous one for `restore`."""
    prev = torch._C._get_sdp_priority_order()
    torch._C._set_sdp_priority_order(order)
    return prev


def restore(prev: List[int]) -> None:
    torch._C._set_sdp_priority_order(prev)


def cudnn_first(current: List[int]) -> List[int]:
    return [int(_CUDNN)] + [int(b) for b in current if int(b) != int(_CUDNN)]


class SdpaChoice:
    """The choice for one model's decoder layers (they share head shapes). stats: calls run cuDNN-first, calls left
    to torch's order, and one entry per timed key. `device_type`, `dtypes` and `timer` are what tests replace to run
    the choice on CPU."""
    device_type = "cuda"
    dtypes = (torch.bfloat16, torch.float16)

    def __init__(self, config, heads: int, kv_heads: int, head_dim: int, min_tokens: int = MIN_TOKENS):
        self.config = config     # the attention modules' config: its _attn_implementation is read per call
        self.heads, self.kv_heads, self.head_dim, self.min_tokens = heads, kv_heads, head_dim, min_tokens
        self.keys: Dict[Tuple, Optional[List[int]]] = {}
        self.stats = {"cudnn_calls": 0, "torch_calls": 0, "cudnn_already": 0, "measured": []}
        self.timer = time_backend

    def order_for(self, hidden_states: torch.Tensor, kwargs: dict, training: bool) -> Optional[List[int]]:
        if (getattr(self.config, "_attn_implementation", None) != "sdpa" or kwargs.get("attention_mask") is not None
                or kwargs.get("past_key_values") is not None or kwargs.get("use_cache") or hidden_states.dim() != 3
                or hidden_states.device.type != self.device_type or hidden_states.shape[1] < self.min_tokens):
            return None
        dev = hidden_states.device
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else hidden_states.dtype
        if dtype not in self.dtypes:
            return None
        if torch._C._get_sdp_priority_order()[0] == int(_CUDNN):
            # torch already tries cuDNN first (torch 2.11 on the H200 does: its default SDPA ran cuDNN's kernels at
            # every training shape of tools/sdpa_probe.py): nothing to change, nothing to time
            self.stats["torch_calls"] += 1
            self.stats["cudnn_already"] += 1
            return None
        grad = training or torch.is_grad_enabled()   # a training layer's first pass (autograd off) and recompute agree
        key = (hidden_states.shape[0], _bucket(hidden_states.shape[1]), dtype, grad, dev)
        order = self.keys.get(key, _MISSING)
        if order is _MISSING:
            if (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling():
                return None
            order = self.keys[key] = self._measure(hidden_states.shape[0], hidden_states.shape[1], dtype, grad, dev)
        self.stats["cudnn_calls" if order is not None else "torch_calls"] += 1
        return order

    def _measure(self, rows: int, tokens: int, dtype, grad: bool, dev) -> Optional[List[int]]:
        times = {b: self.timer(b, rows, self.heads, self.kv_heads, tokens, self.head_dim, dtype, grad, dev)
                 for b in (_FLASH, _CUDNN)}
        flash, cudnn = times[_FLASH], times[_CUDNN]
        use = cudnn is not None and (flash is None or cudnn[0] <= MARGIN * flash[0])
        self.stats["measured"].append({"rows": rows, "tokens": tokens, "grad": grad,
                                       "flash_ms": None if flash is None else round(flash[0], 4),
                                       "cudnn_ms": None if cudnn is None else round(cudnn[0], 4),
                                       "cudnn_first_ms": None if cudnn is None else round(cudnn[1], 4),
                                       "chose": "cudnn" if use else "torch"})
        return cudnn_first(torch._C._get_sdp_priority_order()) if use else None


def inputs(rows: int, heads: int, kv_heads: int, tokens: int, head_dim: int, dtype, dev):
    """q [rows, heads, tokens, D], k, v [rows, kv_heads, tokens, D] and an output gradient like q, random from a
    generator of their own: timing inside a training step must not move the global RNG (a reentrant checkpoint's
    recompute replays the first pass's dropout draws from it)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows, heads, tokens, head_dim, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(rows, kv_heads, tokens, head_dim, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(rows, kv_heads, tokens, head_dim, device=dev, dtype=dtype, generator=gen)
    do = torch.randn(rows, heads, tokens, head_dim, device=dev, dtype=dtype, generator=gen)
    return q, k, v, do


def time_backend(backend: SDPBackend, rows: int, heads: int, kv_heads: int, tokens: int, head_dim: int, dtype,
                 grad: bool, dev, reps: int = 3) -> Optional[Tuple[float, float]]:
    """(median ms of `reps` calls, ms of the first call) of one causal SDPA call (forward, plus backward when `grad`)
    with only `backend` allowed, on random tensors of the layer's shape; None when that backend refuses the call.
    The first call includes what a new shape costs once (cuDNN builds its execution plans then)."""
    gqa = heads != kv_heads
    q, k, v, do = inputs(rows, heads, kv_heads, tokens, head_dim, dtype, dev)
    if grad:
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if grad:
            torch.autograd.grad(out, (q, k, v), do)

    ms = []
    try:
        with sdpa_kernel(backend), torch.enable_grad() if grad else torch.no_grad():
            for _ in range(reps + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end))
    except RuntimeError:      # "No available kernel": this backend does not support the call
        return None
    warm = sorted(ms[1:])
    return warm[len(warm) // 2], ms[0]
