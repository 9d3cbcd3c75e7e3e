"""Lab (issue 27, item 3): each decoder layer's forward and backward replayed as CUDA graphs.

Under reentrant gradient checkpointing (ms-swift's choice on one GPU) a layer runs forward twice, autograd off and
then again for the recompute right before its backward. Both passes replay one captured forward graph; the backward
replays one captured backward graph. One pair per layer and input signature (shapes, dtypes, autocast), captured at
the first call that has it (one warm-up pass, then capture), all pairs in one memory pool. Sharing the pool is safe
only in reentrant order (a layer's recompute and backward are adjacent, nothing replays between them), so this lab
refuses anything else. Host time of a replayed layer: the input copies and two graph launches, independent of the
layer's op count.

    layers = install(model)     # after swift_liger.apply and PEFT; model.train(), reentrant checkpointing on
    layers.stats                # captures, capture seconds, replays, eager calls

Not a fusion: measured in tools/train_lab.py (variant ours_graphed).
"""
from __future__ import annotations

import time

import torch


class _Entry:
    __slots__ = ("fwd", "bwd", "inputs", "out", "gout", "grads", "params")


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, *tensors):   # tensors: the graph inputs, then the layer's trainable parameters
        for static, t in zip(entry.inputs, tensors):
            static.copy_(t)
        entry.fwd.replay()
        ctx.entry = entry
        return entry.out.clone()   # a replay of the same graph (another call, the recompute) overwrites entry.out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        e = ctx.entry
        e.gout.copy_(grad)
        e.bwd.replay()
        return (None,) + tuple(None if g is None else g.clone() for g in e.grads)


class GraphedLayers:
    def __init__(self, layers, warmup: int = 1):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.warmup = warmup
        self.stats = {"captures": 0, "capture_s": 0.0, "replays": 0, "eager": 0}
        for layer in layers:
            if not getattr(layer, "gradient_checkpointing", False):
                raise ValueError(f"{type(layer).__name__}: graphed layers need gradient checkpointing (reentrant)")
            func = getattr(layer, "_gradient_checkpointing_func", None)
            kw = getattr(func, "keywords", {}) or {}
            if kw.get("use_reentrant") is False:
                raise ValueError("graphed layers need use_reentrant=True checkpointing")
            layer.forward = self._forward_of(layer, layer.forward)

    def _forward_of(self, layer, orig):
        cache = {}

        def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            if (not layer.training or not hidden_states.is_cuda or past_key_values is not None
                    or position_embeddings is None or any(v is not None for v in kwargs.values())):
                self.stats["eager"] += 1
                return orig(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
            cos, sin = position_embeddings
            tensors = [hidden_states, cos, sin, attention_mask, position_ids]
            present = tuple(t is not None for t in tensors)
            tensors = [t for t in tensors if t is not None]
            key = (present, tuple((tuple(t.shape), t.dtype) for t in tensors), torch.is_autocast_enabled("cuda"),
                   torch.get_autocast_dtype("cuda"))
            entry = cache.get(key)
            if entry is None:
                entry = cache[key] = self._capture(layer, orig, tensors, present)
            self.stats["replays"] += 1
            return _Replay.apply(entry, *tensors, *entry.params)
        return forward

    def _capture(self, layer, orig, tensors, present) -> _Entry:
        t0 = time.perf_counter()
        e = _Entry()
        e.params = tuple(p for p in layer.parameters() if p.requires_grad)
        e.inputs = [t.detach().clone() for t in tensors]
        e.inputs[0].requires_grad_(True)
        it = iter(e.inputs)
        hidden, cos, sin, mask, pos = (next(it) if p else None for p in present)

        def run():
            return orig(hidden, attention_mask=mask, position_ids=pos, past_key_values=None, use_cache=False,
                        position_embeddings=(cos, sin))
        wrt = (hidden,) + e.params
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        rng = torch.cuda.get_rng_state()
        adt, aen = torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda")
        with torch.cuda.stream(self.stream), torch.enable_grad(), \
                torch.autocast("cuda", dtype=adt, enabled=aen, cache_enabled=False):
            for _ in range(self.warmup):   # lazy initialisation (kernel compiles, cuBLAS workspace) outside capture
                out = run()
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
                del out
            e.fwd = torch.cuda.CUDAGraph()
            e.fwd.capture_begin(pool=self.pool)
            out = run()
            e.fwd.capture_end()
            e.gout = torch.empty_like(out)
            e.bwd = torch.cuda.CUDAGraph()
            e.bwd.capture_begin(pool=self.pool)
            grads = torch.autograd.grad(out, wrt, e.gout, allow_unused=True)
            e.bwd.capture_end()
        cur.wait_stream(self.stream)
        torch.cuda.set_rng_state(rng)
        e.out = out.detach()
        e.grads = (grads[0], None, None) + ((None,) if present[3] else ()) + ((None,) if present[4] else ()) \
            + tuple(grads[1:])
        e.grads = tuple(e.grads)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return e


def decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def install(model, warmup: int = 1) -> GraphedLayers:
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("no decoder layers (GradientCheckpointingLayer) found")
    return GraphedLayers(layers, warmup=warmup)
