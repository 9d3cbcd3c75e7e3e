"""Decoder layers replayed as CUDA graphs under reentrant gradient checkpointing (fusion graph_layers).

Small models train host-bound: at Qwen2.5-0.5B, 8 x 512 tokens, a step's kernels take ~60 ms on an H200 while the
host spends ~200 ms issuing them (docs/benchmarks/train_graphed_h200.md). Under reentrant checkpointing (ms-swift's
choice on one GPU) each decoder layer runs forward with autograd off, then forward again (the recompute) right
before its backward. Here both forward passes replay one captured forward graph and the backward replays one
captured backward graph: per call the host copies the hidden states into a static buffer (position embeddings, mask
and positions only when they change: once per model forward) and launches one graph.

    graphs = LayerGraphs(shared)                   # one per decoder layer; shared = Shared(), one per model
    out = graphs.forward(layer, type(layer).forward, hidden_states, attention_mask=...,
                         position_embeddings=(cos, sin), position_ids=...)   # None: call the layer eagerly

What replays (anything else on CUDA runs the layer as it is, counted by reason; CPU runs it uncounted): a
training-mode layer under reentrant checkpointing (the first pass: autograd off, input requiring grad; the recompute:
inside the backward, after a replayed first pass) and the forward of other autograd-off passes (below), position
embeddings given, no cache, an attention mask that is None or a 4-D bool mask, weights that no hook gathers or moves
per call (not ZeRO-3, FSDP or accelerate offload; a model moved off the GPU and back between calls has its graphs
dropped, and runs eagerly once moved twice), and only small trainable parameters (adapters: the captured backward
keeps their gradients in static buffers, copied out per call in one multi-tensor op).

Chosen by measurement: at a new key the first layer's forward is timed eagerly; where the host issues it in under
GPU_BOUND of its GPU time nothing is captured (a replay runs the same kernels). Otherwise it is captured and timed
eagerly and replayed (host and GPU time of MEASURE_CALLS calls, best of MEASURE_REPS interleaved rounds; a pass costs
max(host, GPU) per call). A key kept for graphs is timed once more at that layer's RECHECK_AT-th replayed first pass,
away from the first step's other work (at 1.5B, 4 x 2k the first step timed 5.05 ms of host time per eager layer
forward, more than the 0.259 s eager step allows: docs/benchmarks/train_graph_choice_h200.md). Where the replay is
not MARGIN faster at the capture, or not faster at all at the recheck (GPU-bound layers: 7B-8B at 4k-8k tokens, where
the graphs only add the input copies and padding) the key runs eagerly in every layer, its graphs and buffers
dropped; counters record the times (call_counts()["graph_layers"]["measured"]). A new key of a family already timed
(the same but for rows and padded length) is not timed where a measured one decides it (Shared.infer: a smaller shape
that ran faster eagerly, or a larger one that ran faster replayed); "inferred" counts those.
SWIFT_LIGER_GRAPH_LAYERS=always skips the timing and replays every replayable key.

Autograd-off passes other than a checkpoint's first pass (a DPO/GRPO reference or old-policy forward, an evaluation,
a frozen reference or teacher model's forward) replay their forward alone, from graphs captured and timed under keys
of their own (the training mode is part of the key), up to 2 x MAX_KEYS keys in all (SWIFT_LIGER_GRAPH_NO_GRAD=0: they
run eagerly, MAX_KEYS keys). Through the CLI on an H100 (docs/benchmarks/rl_graph_no_grad_h100.md) that took DPO 1.18x
/ 1.11x and GRPO 1.13x / 1.00x at Qwen2.5-0.5B / 1.5B shapes, 0-0.13 GiB more reserved. A reference pass's first
layer still looks like a checkpoint's first pass (the input-require-grads hook marks its input) and replays a training
key. Inference mode always runs eagerly: its tensors have no version counters for _load's reuse check.

Keys: one pair of graphs per layer and (batch, padded length, dtypes, autocast, PEFT adapter state). The length is
padded up to a bucket (8 per octave: at most 1/8 more tokens) so batches of varying lengths share captures. Padded
tokens come after every real token, are masked out as keys (causal order does it when the mask is None) and their
rows are dropped, so real tokens compute what they would unpadded (up to the GEMMs' rounding order; LoRA dropout on a
padded row draws its mask over more elements, so other, equally distributed, draws). At most MAX_KEYS keys (least
recently used dropped). A capture that fails (a host sync inside the layer, e.g. MoE routing) leaves that key eager.

Memory: every graph of a process draws from one pool; the static buffers (hidden input, output, gradients in and
out, cos/sin, mask, positions) are one set of views per key, shared by all layers, of one store shared by all keys
(_Store: ~2x the largest key's, and up to as much again in older tensors that keys captured before a growth still
view); the parameters' gradients land in one buffer per parameter, shared by the keys. So a key costs its graphs,
not memory that grows with the number of lengths. All of it is safe only in reentrant order:
the first pass replays layer after layer, each reading and writing the shared buffers in turn, and a layer's
recompute and backward replay back to back with nothing between them (its saved tensors live in pool memory the next
layer's capture reuses). Non-reentrant checkpointing, or no checkpointing, breaks that order: those run eagerly.
Dropout draws come from torch's generator, which graph replays advance; the checkpoint's saved RNG state makes the
recompute draw what the first pass drew.
"""
from __future__ import annotations

import collections
import math
import os
import time
import weakref
from typing import Callable, Optional

import torch

from ..ops import _common, _launch

MAX_KEYS = 48           # keys kept per model and per layer (graphs), least recently used dropped: rows of varying
                        # length meet up to ~40 buckets (log-uniform 64-2048 tokens at batch 1: 37)
MEASURE_REPS = 3        # a new key: its first layer timed eagerly and replayed in this many interleaved rounds
MEASURE_CALLS = 3       # of this many calls each
SPIN_CYCLES = 50_000_000  # GPU clock cycles (~25 ms at ~2 GHz) a timing's calls queue behind, at most: where the host
SPIN_S = 0.025            # time of the same calls is known (an earlier round), 2x that (SPIN_HOST_X), at least
SPIN_HOST_X = 2.0         # SPIN_FLOOR_S: six full spins were ~0.15 s of the ~0.17 s a key's recheck took (H200)
SPIN_FLOOR_S = 0.002
MARGIN = 0.05           # replays must be this much faster than eager calls to be kept (they cost memory)
RECHECK_MARGIN = 0.0    # at the recheck, any gain keeps them: their memory is already in the run's peak, and a drop
                        # costs the eager path's first calls (1.5B, 1 x 8k on the H200: 4.7% faster replayed, dropped
                        # at MARGIN: a 0.53 s longer step 5, then 0.261 s steps against 0.252)
# A new key whose eager host time is below GPU_BOUND of its GPU time is not captured: a replay runs the same kernels,
# so it cannot be MARGIN faster. Every capture recorded in docs/benchmarks/ with the host below the GPU (ratios
# 0.04-0.93, H100 and H200, ~30 keys) ran eagerly after it; at 0.64-0.66 (FP8 bases, Qwen2.5-7B / Llama-3-8B, 8k
# tokens, H200) the capture raised the run's peak reserved memory from 14.6 to 18.5 GiB.
GPU_BOUND = 0.8
RETIME_BELOW = 0.9      # a host time between GPU_BOUND and this share of the GPU time is timed once more
RECHECK_AT = 5          # a key kept for graphs is timed again at its timing layer's 5th replayed first pass
SMALL_TRAINABLE = 0.25  # trainable parameters up to this share of the layer's elements (adapters) replay

EAGER_MEASURED = "measured faster eagerly at this batch shape"
EAGER_INFERRED = "a smaller batch shape measured faster eagerly"
INFERENCE_MODE = "inference mode (its tensors keep no version counter to check a reload by)"
MOVED = "parameters moved again since a capture (a model offloaded between calls)"

_BACKENDS: dict = {}    # device index -> the one capture stream and memory pool of every layer's graphs


def spin_cycles(host_hint: Optional[float]) -> int:
    """The timer's spin: SPIN_CYCLES without a hint, else SPIN_HOST_X x the hinted host seconds (at least
    SPIN_FLOOR_S, at most SPIN_S), in cycles at SPIN_CYCLES / SPIN_S."""
    if host_hint is None:
        return SPIN_CYCLES
    return int(SPIN_CYCLES * min(1.0, max(SPIN_FLOOR_S, SPIN_HOST_X * host_hint) / SPIN_S))


def bucket(n: int) -> int:
    """The padded length for n tokens: the next multiple of 2**(floor(log2 n) - 3) and of 16 (from 128 tokens on:
    8 buckets per octave, at most 1/8 more tokens)."""
    step = max(16, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class _Graph:
    """A captured CUDA graph that counts itself live in its backend: a pool whose graphs all died cannot take another
    capture (the allocator asserts on it), so the next capture starts a fresh pool."""
    __slots__ = ("graph", "backend", "replay")

    def __init__(self, graph, backend):
        self.graph, self.backend, self.replay = graph, backend, graph.replay
        backend.live += 1

    def __del__(self):
        self.backend.live -= 1


class _Backend:
    """CUDA graphs. capture(fn) runs fn once under capture on the side stream and returns the replayable graph."""

    def __init__(self, device: torch.device):
        self.pool = None
        self.live = 0   # graphs of self.pool alive
        self.stream = torch.cuda.Stream(device)   # one stream: the allocator reuses a freed block only on its stream
        self.keep_capture_outputs = False   # the captured tensors live in pool memory; replays rewrite them

    @classmethod
    def of(cls, device: torch.device) -> "_Backend":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _BACKENDS:
            _BACKENDS[index] = cls(device)
        return _BACKENDS[index]

    def side(self):
        return torch.cuda.stream(self.stream)

    def begin(self):
        self.stream.wait_stream(torch.cuda.current_stream())

    def end(self):
        torch.cuda.current_stream().wait_stream(self.stream)

    @staticmethod
    def release():
        torch.cuda.empty_cache()   # cached blocks nothing will reuse (another stream's, a dropped graph's)

    @staticmethod
    def timer(fn: Callable, host_hint: Optional[float] = None) -> tuple:
        """(host, device) seconds of fn: the host's to issue its work, the GPU's to run it without waiting for the
        host (issued behind a spin kernel, so its kernels queue up before the GPU reaches them; spin_cycles says how
        long from host_hint, the host seconds fn took before). A spin shorter than the host's issuing would add the
        host's gaps to the GPU time; a pass costs max(host, GPU) per call, so the choices would still hold."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin_cycles(host_hint))
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return host, 1e-3 * start.elapsed_time(end)

    def capture(self, fn: Callable) -> _Graph:
        if self.pool is None or not self.live:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        try:
            fn()
        finally:
            g.capture_end()
        return _Graph(g, self)

    @staticmethod
    def rng_state(device):
        return torch.cuda.get_rng_state(device)

    @staticmethod
    def set_rng_state(state, device):
        torch.cuda.set_rng_state(state, device)


class _Slot:
    """The static buffers of one key, shared by all layers: inputs (hidden, cos, sin, mask or None, positions or
    None), what was last loaded into them (n real tokens; weak references and versions of the sources). They are
    views of the model's _Store, which every key shares: `last` ([inputs, output gradient]) names the slot that
    wrote each last, so a slot reloads what another key may have overwritten."""
    __slots__ = ("inputs", "out", "gout", "ghidden", "dead", "warm", "n", "gout_n", "src", "ver", "last")


class _Entry:
    """One layer's graphs for one key (fonly: the forward alone, of an autograd-off pass)."""
    __slots__ = ("fwd", "bwd", "gbufs", "params", "keep", "slot", "recheck", "pidx", "plist", "pnone", "fonly",
                 "hints")


def _replay_forward(stats, slot, entry, n, hidden, cos, sin, mask, pos) -> torch.Tensor:
    """Load one call's inputs, replay the forward graph, return the n real tokens' output (a copy: the next layer's
    replay rewrites slot.out)."""
    _load(slot, n, hidden, cos, sin, mask, pos)
    entry.fwd.replay()
    stats["replays"] += 1
    return slot.out[:, :n].clone()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs, slot, entry, n, hidden, cos, sin, mask, pos, *params):
        ctx.graphs, ctx.slot, ctx.entry, ctx.n = graphs, slot, entry, n
        return _replay_forward(graphs.stats, slot, entry, n, hidden, cos, sin, mask, pos)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        slot, entry, n = ctx.slot, ctx.entry, ctx.n
        slot.gout[:, :n].copy_(grad)
        if n < slot.gout.shape[1] and (slot.gout_n != n or slot.last[1] is not slot):   # padded rows: no gradient
            slot.gout[:, n:].zero_()   # (zeroed once per length, and after another key wrote the shared store)
        slot.gout_n = n
        slot.last[1] = slot
        entry.bwd.replay()
        # The parameters' gradients leave as fresh tensors (one multi-tensor op, x * 1.0 is exact): autograd may
        # keep a gradient it is handed as .grad, and the next replay rewrites the static buffers.
        grads = list(entry.pnone)
        for i, g in zip(entry.pidx, torch._foreach_mul(entry.plist, 1.0) if entry.plist else ()):
            grads[i] = g
        return (None,) * 4 + (slot.ghidden[:, :n].clone(), None, None, None, None) + tuple(grads)


def _new_slot(shared: "Shared", padded: int, hidden, cos, sin, mask, pos) -> _Slot:
    """A key's static buffers ([rows, padded, ...] for each input like the call's), views of shared.store."""
    slot = _Slot()
    slot.dead = slot.warm = False
    slot.n = slot.gout_n = None
    slot.src, slot.ver = [None] * 5, [None] * 5
    slot.last = shared.last
    view = shared.store.view

    def static(role, t):
        return None if t is None else view(role, t.shape[:1] + (padded,) + t.shape[2:], t.dtype, t.device)
    slot.inputs = [static(r, t) for r, t in zip(("hidden", "cos", "sin", "", "pos"), (hidden, cos, sin, None, pos))]
    if mask is not None:
        slot.inputs[3] = view("mask", mask.shape[:2] + (padded, padded), mask.dtype, mask.device)
    slot.inputs[0] = slot.inputs[0].detach().requires_grad_(True)   # a leaf over the store's memory
    shape, dt, dv = slot.inputs[0].shape, slot.inputs[0].dtype, slot.inputs[0].device
    slot.out, slot.gout, slot.ghidden = (view(r, shape, dt, dv) for r in ("out", "gout", "ghidden"))
    return slot


def _load(slot, n, hidden, cos, sin, mask, pos) -> None:
    """Copy one call's inputs into the key's static buffers. Hidden states every call; position embeddings, mask and
    positions only when they are other tensors (or were modified) than the last call's: the layers of one forward
    share them. Rows past n (padding) are rewritten when n changes: zeros (positions continue, masks are causal)."""
    static = slot.inputs
    padded = static[0].shape[1]
    fresh = slot.n != n or slot.last[0] is not slot   # another key's inputs may be in the shared store
    static[0][:, :n].copy_(hidden)
    if fresh and n < padded:
        static[0][:, n:].zero_()
    for i, t in enumerate((cos, sin, mask, pos), 1):
        if t is None:
            continue
        if not fresh and slot.src[i] is not None and slot.src[i]() is t and slot.ver[i] == t._version:
            continue
        dst = static[i]
        if i == 3:
            dst.copy_(t if n == padded else _pad_mask(t, n, padded))
        else:
            dst[:, :n].copy_(t)
            if n < padded:
                if i == 4:   # positions continue: a reset would read as a new packed document
                    dst[:, n:].copy_(t[:, -1:] + torch.arange(1, padded - n + 1, device=t.device, dtype=t.dtype))
                else:
                    dst[:, n:].zero_()
        slot.src[i], slot.ver[i] = weakref.ref(t), t._version
    slot.n = n
    slot.last[0] = slot


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _eager_calls(layer, call, hidden, cos, sin, mask, pos, calls: int = MEASURE_CALLS,
                 grad: bool = True) -> Callable:
    """A function running the layer's forward `calls` times eagerly with autograd on (the recompute's mode; off for
    an autograd-off pass's key), named "eager" for the timings' records."""
    def eager():
        with torch.set_grad_enabled(grad):
            for _ in range(calls):
                call(layer, hidden, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
    return eager


def _pad_mask(mask: torch.Tensor, n: int, padded: int) -> torch.Tensor:
    """[B, 1, n, n] bool -> [B, 1, padded, padded]: real rows see no padded key; padded rows are causal (never
    empty)."""
    out = torch.ones(padded, padded, dtype=torch.bool, device=mask.device).tril_()
    out = out.expand(mask.shape[0], mask.shape[1], padded, padded).clone()
    out[:, :, :n, :n] = mask
    out[:, :, :n, n:] = False
    return out


class LayerGraphs:
    """The graphs of one decoder layer. ``stats`` (shared by a model's layers) counts captures, capture seconds,
    replays, and eager calls by reason."""

    backend_for: Callable = _Backend.of   # tests swap in a CPU stand-in (re-runs the captured function)

    def __init__(self, shared: "Shared"):
        self.shared, self.stats = shared, shared.stats
        self.entries: "collections.OrderedDict" = collections.OrderedDict()
        self.backend = None
        self.pending = 0   # first passes replayed whose recompute has not run yet
        # (first parameter, its address, last parameter, its address) at the capture: graphs read the weights where
        # they were then, so a model moved off the GPU and back (GKD's offload_teacher_model, GRPO's offload_model)
        # drops this layer's graphs; moved twice, it runs eagerly from then on
        self.anchors: Optional[tuple] = None
        self.moves = 0
        self.lora = None
        self.gbufs: dict = {}   # trainable parameter -> the static buffer its replayed gradient lands in
        shared.members.append(self)

    def __deepcopy__(self, memo):   # a copied model captures its own graphs (its stats: the copied patch state's)
        import copy
        return type(self)(copy.deepcopy(self.shared, memo))

    def _eager(self, reason: str) -> None:
        self.stats["eager"][reason] = self.stats["eager"].get(reason, 0) + 1
        return None

    def _adapter_state(self, layer) -> tuple:
        if self.lora is None:
            self.lora = [m for m in layer.modules() if "_active_adapter" in m.__dict__ and hasattr(m, "lora_A")]
        return tuple((m.__dict__.get("_disable_adapters"), str(m.__dict__.get("_active_adapter")),
                      tuple(m.__dict__.get("merged_adapters", ()))) for m in self.lora)

    def forward(self, layer, call: Callable, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        """The layer's output replayed from graphs, or None (the caller runs the layer eagerly)."""
        if hidden_states.device.type != "cuda" and self.backend_for == _Backend.of:
            return None   # no CUDA graphs on this device: nothing to report
        if torch.is_inference_mode_enabled() or hidden_states.is_inference():
            # (a train-mode model generating under inference mode: its inputs may still be marked requiring grad)
            return self._eager(INFERENCE_MODE) if layer.training or self.shared.no_grad else None
        # an autograd-off pass that is not a reentrant checkpoint's first pass: a reference, old-policy or evaluation
        # forward: its forward alone is replayed (SWIFT_LIGER_GRAPH_NO_GRAD=0: eagerly)
        fonly = self.shared.no_grad and not torch.is_grad_enabled() and not (
            layer.training and hidden_states.requires_grad and getattr(layer, "gradient_checkpointing", False))
        if not fonly:
            if not layer.training:
                return None   # evaluation: nothing to report
            if torch.is_grad_enabled():   # a reentrant recompute: inside the backward, after a replayed first pass
                if not _in_backward():
                    return self._eager("autograd on outside a reentrant checkpoint's recompute")
                if self.pending <= 0:     # the recompute of a first pass that ran eagerly (counted there)
                    return None
            elif not (hidden_states.requires_grad and getattr(layer, "gradient_checkpointing", False)):
                return self._eager("autograd off, input without grad (an evaluation or reference pass)")
        a = self.anchors
        if a is not None and (a[0].data_ptr() != a[1] or a[2].data_ptr() != a[3]):
            self.entries.clear()
            self.anchors, self.moves = None, self.moves + 1
        if self.moves > 1:
            return self._eager(MOVED)
        if past_key_values is not None or use_cache:
            return self._eager("a KV cache")
        kwargs.pop("cache_position", None)   # read only by a KV cache's update
        if position_embeddings is None or any(v is not None for v in kwargs.values()):
            return self._eager("arguments other than hidden states, mask, positions and position embeddings")
        if hidden_states.dim() != 3:
            return self._eager("hidden states not [batch, tokens, hidden]")
        cos, sin = position_embeddings
        n = hidden_states.shape[1]
        padded = bucket(n)
        mask = attention_mask
        if mask is not None and not (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-2:] == (n, n)):
            return self._eager("an attention mask other than a 4-D bool [.., tokens, tokens] mask")
        if not (cos.dim() == 3 and cos.shape[1] == n and sin.shape == cos.shape) or (
                position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != n)):
            return self._eager("position embeddings or ids not [batch, tokens, ...]")
        dev = hidden_states.device
        rows = hidden_states.shape[0]
        # ((rows, padded tokens), everything else): keys of one family differ in size only (Shared.infer)
        key = ((rows, padded), (tuple(hidden_states.shape[2:]), hidden_states.dtype, cos.shape[0] == rows,
                                tuple(cos.shape[2:]), cos.dtype, mask is None or (mask.shape[0] == rows, mask.shape[1]),
                                position_ids is None or position_ids.shape[0] == rows, dev,
                                torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type),
                                self._adapter_state(layer), fonly and ("forward only", layer.training)))
        entry = self.entries.get(key)
        if isinstance(entry, _Entry) and entry.slot.dead:   # its static buffers were dropped: capture again
            del self.entries[key]
            entry = None
        if isinstance(entry, str):   # this key runs eagerly, for this reason
            return self._eager(entry)
        if entry is None:
            why = self.shared.choice.get(key) or self._unreplayable(layer)
            if why is not None:
                self.entries[key] = why
                return self._eager(why)
            if self.backend is None:
                self.backend = type(self).backend_for(dev)
            t0 = time.perf_counter()
            ahead = self.shared.compile_ahead
            ahead = (dev.type == "cuda" and not _common.INTERPRET) if ahead is None else ahead == "1"
            if ahead and not fonly and key not in self.shared.ahead_keys:
                self.shared.ahead_keys.add(key)
                self._compile_ahead(layer, call, hidden_states, cos, sin, mask, position_ids)
                t0 = self._spent("compile_ahead", t0)
            inferred = None if key in self.shared.slots else self.shared.infer(key)
            if inferred is not None:
                self.stats["inferred"] += 1
            if inferred is False:   # a smaller shape of this family measured GPU-bound or faster eagerly
                self.shared.choice[key] = EAGER_INFERRED
                self.entries[key] = EAGER_INFERRED
                return self._eager(EAGER_INFERRED)
            bound = inferred is None and key not in self.shared.slots and self._gpu_bound(
                self.backend, layer, call, padded, hidden_states, cos, sin, mask, position_ids, key, grad=not fonly)
            self._spent("eager_timing", t0)
            if bound:
                self.entries[key] = self.shared.choice[key]
                return self._eager(self.entries[key])
            try:
                entry = self._capture(layer, call, key, padded, hidden_states, cos, sin, mask, position_ids, n,
                                      timed=inferred is None, fonly=fonly)
            except Exception as exc:   # noqa: BLE001  e.g. a host sync inside the layer (MoE routing): eager
                self.entries[key] = f"capture failed ({type(exc).__name__}: {str(exc)[:120]})"
                return self._eager(self.entries[key])
            if entry is None:   # measured: eager is faster at this shape
                self.entries[key] = self.shared.choice[key]
                return self._eager(self.entries[key])
        if entry.recheck is not None and not torch.is_grad_enabled():   # the layer that timed this key
            entry.recheck -= 1
            if entry.recheck <= 0:   # again, away from the first step (whose host times can run high)
                entry.recheck = None
                if not self._graphs_faster(self.backend, layer, call, entry, entry.slot, n, hidden_states, cos, sin,
                                           mask, position_ids, key, when=f"first pass {RECHECK_AT}",
                                           margin=RECHECK_MARGIN):
                    self.entries[key] = self.shared.choice[key]
                    return self._eager(self.entries[key])
        self.entries.move_to_end(key)
        self.shared.slots.move_to_end(key)
        if entry.fonly:   # the forward alone: no recompute or backward follows
            self.stats["no_grad_replays"] += 1
            return _replay_forward(self.stats, entry.slot, entry, n, hidden_states, cos, sin, mask, position_ids)
        self.pending += -1 if torch.is_grad_enabled() else 1
        return _Replay.apply(self, entry.slot, entry, n, hidden_states, cos, sin, mask, position_ids, *entry.params)

    def _spent(self, part: str, since: float) -> float:
        """Adds the host seconds since `since` to the first-call cost (capture_s) and its part; returns now."""
        now = time.perf_counter()
        self.stats["capture_s"] += now - since
        parts = self.stats["capture_parts_s"]
        parts[part] = parts.get(part, 0.0) + now - since   # "compile_ahead" only where it ran
        return now

    def _compile_ahead(self, layer, call, hidden, cos, sin, mask, pos) -> None:
        """Before a new key's first eager call (on CUDA; SWIFT_LIGER_COMPILE_AHEAD=0 turns it off): the layer's
        forward with autograd off (a reentrant checkpoint's first pass) and on, and its backward, inside
        ops._launch.compile_ahead, so every kernel of ours those passes launch compiles on a thread pool, side by
        side, instead of one after another at its first launch. With an empty Triton cache it took Qwen2.5-1.5B,
        4 x 2k's first step from 7.61-10.08 s to 5.98-6.35 on an H100 (train_cli_grid_h100.md, call 18). Our
        kernels do not run there; torch's ops run on their unwritten outputs, which nothing reads on the host. The
        RNG state and the parameters' gradients stay as they were; an error leaves the compiles to the real calls.
        The pass's cached blocks go back to the device after it (release): kept, they raised that first step's peak
        reserved memory by 0.69 GiB (5.19 GiB with the release, 5.15 without the pass: call 19)."""
        be, dev = self.backend, hidden.device
        rng = be.rng_state(dev)
        params = tuple(p for p in layer.parameters() if p.requires_grad)
        try:
            with _launch.compile_ahead() as ahead:
                with torch.no_grad():
                    call(layer, hidden, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
                with torch.enable_grad():
                    h = hidden.detach().requires_grad_()
                    out = call(layer, h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
                    out = out[0] if isinstance(out, tuple) else out
                    torch.autograd.grad(out, (h,) + params, torch.zeros_like(out), allow_unused=True)
                    del out, h
            if ahead is not None:
                self.stats["compiled_ahead"] = (self.stats["compiled_ahead"] or 0) + len(ahead.futures) - ahead.failed
                self.stats["compile_ahead_failed"] += ahead.failed
        except Exception as exc:   # noqa: BLE001 - the real calls compile (and raise) what this pass missed
            self.stats["compile_ahead_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            be.set_rng_state(rng, dev)
            be.release()

    @staticmethod
    def _unreplayable(layer) -> Optional[str]:
        """Why this layer's captured graphs could not be replayed (None: they can). Graphs keep the addresses the
        capture saw: weights that hooks gather, move or re-shard per call would be stale at replay."""
        total = trainable = 0
        for p in layer.parameters():
            # FP8 bases (fp8_base) keep their q / scale tensors where quantization put them: replayable
            if hasattr(p, "ds_id") or type(p).__name__ not in ("Parameter", "Params4bit", "Fp8Weight"):
                return "parameters managed per call (DeepSpeed ZeRO-3 / FSDP)"
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
        for m in layer.modules():
            hook = m.__dict__.get("_hf_hook")
            if hook is not None and any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,))):
                return "weights offloaded by accelerate hooks"
        if trainable > SMALL_TRAINABLE * total:
            return "trainable parameters beyond adapters (full fine-tuning)"
        return None

    def _capture(self, layer, call, key, padded, hidden_states, cos, sin, mask, pos, n,
                 timed: bool = True, fonly: bool = False) -> Optional[_Entry]:
        t0 = time.perf_counter()
        dev, be = hidden_states.device, self.backend
        cap = self.shared.max_keys
        while len(self.entries) >= cap:
            self.entries.popitem(last=False)
        slots = self.shared.slots
        slot = slots.get(key)
        new_slot = slot is None
        if new_slot:
            while len(slots) >= cap:
                slots.popitem(last=False)[1].dead = True
            slot = slots[key] = _new_slot(self.shared, padded, hidden_states, cos, sin, mask, pos)
        with torch.no_grad():
            _load(slot, n, hidden_states, cos, sin, mask, pos)
        e = _Entry()
        e.slot, e.recheck, e.fonly, e.hints = slot, None, fonly, {}
        e.params = () if fonly else tuple(p for p in layer.parameters() if p.requires_grad)
        # the parameters' gradients land in one buffer per parameter, shared by every key of this layer (the
        # captured backward copies them there; autograd's own outputs go back to the pool at the capture's end)
        e.gbufs = tuple(self._gbuf(p) for p in e.params)
        s_hidden, s_cos, s_sin, s_mask, s_pos = slot.inputs
        wrt = (s_hidden,) + e.params
        held = {}

        def run():
            out = call(layer, s_hidden, attention_mask=s_mask, position_ids=s_pos, position_embeddings=(s_cos, s_sin))
            return out[0] if isinstance(out, tuple) else out

        def fwd():
            held["out"] = run()
            slot.out.copy_(held["out"].detach())

        def fwd_only():   # autograd off inside: the CPU stand-in replays with it on
            with torch.no_grad():
                slot.out.copy_(run())

        def bwd():
            grads = torch.autograd.grad(held["out"], wrt, slot.gout, allow_unused=True)
            slot.ghidden.copy_(grads[0])
            held["has_grad"] = tuple(g is not None for g in grads[1:])
            pairs = [(b, g) for b, g in zip(e.gbufs, grads[1:]) if g is not None]
            if pairs:
                torch._foreach_copy_([b for b, _ in pairs], [g for _, g in pairs])

        rng = be.rng_state(dev)
        adt, aen = torch.get_autocast_dtype(dev.type), torch.is_autocast_enabled(dev.type)
        be.begin()
        try:
            with be.side(), torch.set_grad_enabled(not fonly), torch.autocast(dev.type, dtype=adt, enabled=aen,
                                                                                cache_enabled=False):
                if not slot.warm:   # once per key: kernel compiles, cuBLAS workspace, lazy state, outside capture
                    out = run()
                    if not fonly:
                        torch.autograd.grad(out, wrt, torch.zeros_like(out), allow_unused=True)
                    del out
                t0 = self._spent("warm_up", t0)
                e.fwd = be.capture(fwd_only if fonly else fwd)
                t0 = self._spent("capture_forward", t0)
                e.bwd = None if fonly else be.capture(bwd)
                t0 = self._spent("capture_backward", t0)
        finally:
            be.end()
            be.set_rng_state(rng, dev)
        if not slot.warm:
            be.release()   # the warm-up's blocks, cached for the capture stream only
        slot.warm = True
        e.pidx = tuple(i for i, has in enumerate(held.get("has_grad", ())) if has)
        e.plist = [e.gbufs[i] for i in e.pidx]
        e.pnone = (None,) * len(e.params)
        if not be.keep_capture_outputs:
            held.clear()   # the capture's own tensors go back to the pool for the next capture
        e.keep = held
        self.stats["captures"] += 1
        if self.anchors is None:   # plain parameters (an FP8 base is a wrapper without an address of its own)
            ps = [p for p in layer.parameters() if type(p) is torch.nn.Parameter]
            self.anchors = (ps[0], ps[0].data_ptr(), ps[-1], ps[-1].data_ptr()) if ps else None
        if new_slot and timed and self.shared.measure and be.timer is not None:
            faster = self._graphs_faster(be, layer, call, e, slot, n, hidden_states, cos, sin, mask, pos, key,
                                         when="capture")
            self._spent("release_and_timing", t0)
            if not faster:
                return None
            e.recheck = RECHECK_AT
        else:
            self._spent("release_and_timing", t0)
        self.entries[key] = e
        return e

    def _gbuf(self, p: torch.Tensor) -> torch.Tensor:
        """The static buffer p's replayed gradient lands in (a new one if p changed shape, dtype or device)."""
        b = self.gbufs.get(p)
        if b is None or b.shape != p.shape or b.dtype != p.dtype or b.device != p.device:
            b = self.gbufs[p] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return b

    def _gpu_bound(self, be, layer, call, padded, hidden, cos, sin, mask, pos, key, grad: bool = True) -> bool:
        """Before a new key's capture: the layer's forward eagerly, once untimed (compiles, lazy state), then one timed
        round. Where the host issues it in under GPU_BOUND of the GPU's time to run it, a replay (the same kernels plus
        the input copies) cannot come out MARGIN faster: the key runs eagerly in every layer and nothing is captured (at
        Qwen2.5-7B, 8k tokens, host 2.2 vs GPU 7.4 ms per layer, the capture and its timing cost 1.1-1.8 s of the first
        step; over FP8 bases, host 3.4 vs GPU 5.3 ms, ~4 GiB of reserved memory). Otherwise the capture and the
        interleaved timing decide. A host time between GPU_BOUND and RETIME_BELOW of the GPU's is timed once more and
        the lower one counts: the first step's host times run high (7B 8k on an H100: 3.11 ms host against 7.18 GPU at
        the later timing, yet captured)."""
        if not self.shared.measure or be.timer is None:
            return False
        dev = hidden.device
        rng = be.rng_state(dev)
        eager = _eager_calls(layer, call, hidden, cos, sin, mask, pos, grad=grad)
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                _eager_calls(layer, call, hidden, cos, sin, mask, pos, 1, grad)()
                once = time.perf_counter() - t0   # builds and lazy state included: at least one call's host time
                host, gpu = (t / MEASURE_CALLS for t in be.timer(eager, MEASURE_CALLS * once))
                if GPU_BOUND * gpu <= host < RETIME_BELOW * gpu:   # near the line: once more, the lower host time
                    host = min(host, be.timer(eager, MEASURE_CALLS * host)[0] / MEASURE_CALLS)
        finally:
            be.set_rng_state(rng, dev)
        if not host < GPU_BOUND * gpu:
            return False
        self.stats["measured"].append({
            "rows": hidden.shape[0], "tokens": padded, "eager_ms": round(1e3 * max(host, gpu), 3), "graph_ms": None,
            "eager_host_ms": round(1e3 * host, 3), "eager_gpu_ms": round(1e3 * gpu, 3), "graph_host_ms": None,
            "graph_gpu_ms": None, "graphs": False, "when": "before capture"})
        self.shared.choice[key] = EAGER_MEASURED
        self.shared.record(key, False)
        return True

    def _graphs_faster(self, be, layer, call, e, slot, n, hidden, cos, sin, mask, pos, key, when,
                       margin: float = MARGIN) -> bool:
        """Time this layer's forward eagerly (the recompute's mode, autograd on) and replayed (with the input
        copies): host and GPU seconds of MEASURE_CALLS calls, best of MEASURE_REPS interleaved rounds. A pass over
        the layers costs max(host, GPU) per call; keep the graphs only if theirs is `margin` below eager's (MARGIN at
        the capture, RECHECK_MARGIN at the recheck): where the GPU is the bound the replay only adds the copies and
        the padding. The decision holds for the key in every layer."""
        dev = hidden.device
        rng = be.rng_state(dev)
        eager = _eager_calls(layer, call, hidden, cos, sin, mask, pos, grad=not e.fonly)

        def replay():
            for _ in range(MEASURE_CALLS):
                _load(slot, n, hidden, cos, sin, mask, pos)
                e.fwd.replay()
                slot.out[:, :n].clone()

        best = {"eager": (float("inf"),) * 2, "replay": (float("inf"),) * 2}
        try:
            with torch.no_grad():
                for _ in range(MEASURE_REPS):
                    for fn in (eager, replay):   # the spin from this key's last round (the recheck: the capture's)
                        host, dev_s = be.timer(fn, e.hints.get(fn.__name__))
                        e.hints[fn.__name__] = host
                        b = best[fn.__name__]
                        best[fn.__name__] = (min(b[0], host / MEASURE_CALLS), min(b[1], dev_s / MEASURE_CALLS))
        finally:
            be.set_rng_state(rng, dev)
        # a pass over the layers keeps the GPU fed only as fast as the host issues: per call max(host, device)
        t_eager, t_graph = max(best["eager"]), max(best["replay"])
        faster = t_graph < (1.0 - margin) * t_eager
        rows, padded = slot.inputs[0].shape[:2]
        self.stats["measured"].append({
            "rows": rows, "tokens": padded, "eager_ms": round(1e3 * t_eager, 3), "graph_ms": round(1e3 * t_graph, 3),
            "eager_host_ms": round(1e3 * best["eager"][0], 3), "eager_gpu_ms": round(1e3 * best["eager"][1], 3),
            "graph_host_ms": round(1e3 * best["replay"][0], 3), "graph_gpu_ms": round(1e3 * best["replay"][1], 3),
            "graphs": faster, "when": when})
        self.shared.record(key, faster)
        if not faster:   # every layer runs this key eagerly; its graphs and static buffers go
            self.shared.choice[key] = EAGER_MEASURED
            self.shared.slots.pop(key).dead = True
            e.fwd = e.bwd = None
            for member in self.shared.members:
                if isinstance(member.entries.get(key), _Entry):
                    del member.entries[key]
            be.release()   # the pool blocks only these graphs used
        return faster


PARTS = ("eager_timing", "warm_up", "capture_forward", "capture_backward", "release_and_timing")   # host s per part


def new_stats() -> dict:
    return {"captures": 0, "capture_s": 0.0, "capture_parts_s": dict.fromkeys(PARTS, 0.0), "replays": 0, "eager": {},
            "inferred": 0, "no_grad_replays": 0,
            "measured": [], "compiled_ahead": None, "compile_ahead_failed": 0, "compile_ahead_error": None}


class _Store:
    """The memory behind every key's static buffers: one flat tensor per (role, dtype, device), each key's buffer a
    contiguous view of its start. A key larger than a role's tensor gets a new one twice the size (or its own size);
    keys captured before keep the old tensor alive through their views until they are dropped. So the store holds at
    most ~2x the largest key's buffers, and older tensors at most as much again, however many keys (lengths) the
    data brings."""

    def __init__(self):
        self.flat: dict = {}

    def view(self, role: str, shape, dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        k = (role, dtype, device)
        t = self.flat.get(k)
        if t is None or t.numel() < numel:
            t = self.flat[k] = torch.empty(numel if t is None else max(numel, 2 * t.numel()), dtype=dtype,
                                           device=device)
        return t[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


class Shared:
    """What the decoder layers of one patched model share: the counters, the static buffers' store and one set of
    views of it per key, and the measured choices."""

    def __init__(self):
        self.stats = new_stats()
        self.slots: "collections.OrderedDict" = collections.OrderedDict()
        self.store = _Store()
        self.last = [None, None]   # the slot whose inputs / output gradient the store holds
        self.choice: dict = {}   # key -> why it runs eagerly (measured), kept after its slot is dropped
        self.sizes: dict = {}    # a key's family -> {True: sizes measured faster replayed, False: eagerly}
        self.members: list = []  # the LayerGraphs of the model's layers
        # SWIFT_LIGER_GRAPH_LAYERS=always replays every replayable key without timing it (benchmarks)
        self.measure = os.environ.get("SWIFT_LIGER_GRAPH_LAYERS", "measure").strip() != "always"
        # a new key's kernels compile side by side first (LayerGraphs._compile_ahead): on CUDA unless
        # SWIFT_LIGER_COMPILE_AHEAD=0; =1 forces it where nothing compiles (the CPU tests' stand-in)
        self.compile_ahead = os.environ.get("SWIFT_LIGER_COMPILE_AHEAD", "").strip() or None
        # autograd-off passes (reference, old-policy, evaluation forwards) replay their forward from graphs too, under
        # keys of their own (so twice the keys are kept); SWIFT_LIGER_GRAPH_NO_GRAD=0 runs them eagerly
        self.no_grad = os.environ.get("SWIFT_LIGER_GRAPH_NO_GRAD", "1").strip() != "0"
        self.max_keys = MAX_KEYS * (2 if self.no_grad else 1)
        self.ahead_keys: set = set()

    def record(self, key, graphs: bool) -> None:
        """A measured choice for key ((rows, padded tokens), family)."""
        sizes = self.sizes.setdefault(key[1], {True: set(), False: set()})
        sizes[not graphs].discard(key[0])
        sizes[graphs].add(key[0])

    def infer(self, key) -> Optional[bool]:
        """The choice for a new key of a family already timed, without timing it: eager (False) where a size with no
        more rows and tokens ran faster eagerly, replayed (True) where one with no fewer of either ran faster
        replayed; None (time it) otherwise. A layer's host time per call hardly depends on its shape while its GPU
        time grows with rows and tokens, so a smaller shape is at least as host-bound as a larger one. Data of
        varying lengths meets up to ~40 keys (8 buckets per octave); each timing costs ~0.2 s of the step."""
        sizes = self.sizes.get(key[1])
        if not sizes:
            return None
        rows, tokens = key[0]
        if any(r <= rows and t <= tokens for r, t in sizes[False]):
            return False
        if any(rows <= r and tokens <= t for r, t in sizes[True]):
            return True
        return None

    def __deepcopy__(self, memo):   # a copied model starts empty
        return type(self)()
