"""Offloaded gradient checkpoints: a decoder layer's checkpointed input lives in pinned CPU memory between its
forward and its recompute, instead of on the GPU.

Gradient checkpointing keeps one [B, T, H] input per decoder layer until the backward pass: 32 layers x 4 GiB at
Llama-3-8B shapes and 512k tokens (bf16), 128 GiB. `checkpoint_offloaded(run, hidden, *args)` replaces the
checkpoint function of each decoder layer (HF calls ``layer._gradient_checkpointing_func(partial(layer.__call__,
**kwargs), hidden_states)``):

* forward: the input is copied device -> pinned host on a side stream (overlapping the layer's compute; the
  allocator is told the side stream still reads it), the layer runs without saving anything;
* backward of layer i: starts the host -> device copy of layer i-1's input on the side stream (so it lands while
  layer i recomputes and runs its backward), waits for its own input (prefetched by layer i+1), recomputes the
  layer with the forward's RNG and autocast state, and back-propagates through it.

Parameter gradients accumulate inside the backward, as torch's reentrant checkpoint does; a zero-size tensor that
requires grad makes the backward run even when the layer input does not require grad (frozen embeddings with LoRA).
On CPU tensors the "offload" is a copy: the same path, for tests.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, List

import torch


class Offloader:
    """Per model: the side stream and the checkpoints of the current step, in forward order (weakly held)."""

    def __init__(self):
        self.pending: List[weakref.ref] = []
        self.streams = {}
        self.calls = {"offloaded": 0, "prefetched": 0, "fetched_late": 0}

    def __deepcopy__(self, memo):   # a copied model gets its own streams and step list
        return type(self)()

    def stream(self, device):
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def push(self, ctx) -> None:
        self.pending = [r for r in self.pending if r() is not None and not r().fetched]
        self.pending.append(weakref.ref(ctx))

    def before(self, ctx):
        """The checkpoint run right before `ctx` in the forward (the next one the backward needs), if alive."""
        alive = [r() for r in self.pending]
        for i, c in enumerate(alive):
            if c is ctx:
                for prev in reversed(alive[:i]):
                    if prev is not None and not prev.fetched:
                        return prev
                return None
        return None


def _to_host(x: torch.Tensor, stream):
    if stream is None:
        return x.detach().clone(), None
    host = torch.empty(x.shape, dtype=x.dtype, layout=x.layout, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        host.copy_(x.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    x.record_stream(stream)   # the layer may free x before the copy is done
    return host, event


def _fetch(ctx, prefetch: bool) -> None:
    """Start (prefetch) or do the host -> device copy of ctx's input; idempotent."""
    if ctx.fetched:
        return
    ctx.fetched = True
    ctx.offloader.calls["prefetched" if prefetch else "fetched_late"] += 1
    host, stream = ctx.host, ctx.stream
    if stream is None:
        ctx.device_input = host
        return
    with torch.cuda.stream(stream):
        if ctx.d2h_event is not None:
            stream.wait_event(ctx.d2h_event)
        dev = torch.empty(host.shape, dtype=host.dtype, device=ctx.device)
        dev.copy_(host, non_blocking=True)
        ctx.h2d_event = torch.cuda.Event()
        ctx.h2d_event.record(stream)
    ctx.device_input = dev


def _rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def _restored(state, device):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
        yield


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offloader, always, hidden, *args):
        ctx.run, ctx.offloader, ctx.device = run, offloader, hidden.device
        ctx.stream = offloader.stream(hidden.device)
        ctx.rng = _rng_state(hidden.device)
        kind = hidden.device.type   # the recompute runs under the forward's autocast state for this device
        ctx.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))}
        ctx.host, ctx.d2h_event = _to_host(hidden, ctx.stream)
        ctx.fetched, ctx.device_input, ctx.h2d_event = False, None, None
        ctx.hidden_requires_grad = hidden.requires_grad
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.save_for_backward(*tensors)
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        offloader.push(ctx)
        offloader.calls["offloaded"] += 1
        with torch.no_grad():
            out = run(hidden, *args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        previous = ctx.offloader.before(ctx)
        if previous is not None:
            _fetch(previous, prefetch=True)   # lands while this layer recomputes
        _fetch(ctx, prefetch=False)
        if ctx.h2d_event is not None:
            torch.cuda.current_stream(ctx.device).wait_event(ctx.h2d_event)
            ctx.device_input.record_stream(torch.cuda.current_stream(ctx.device))
        hidden = ctx.device_input.detach().requires_grad_(ctx.hidden_requires_grad)
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if a is None else a for a in ctx.args]
        args = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]
        autocast = [torch.autocast(t, enabled=on, dtype=dt) for t, (on, dt) in ctx.autocast.items()]
        with _restored(ctx.rng, ctx.device), torch.enable_grad(), contextlib.ExitStack() as stack:
            for a in autocast:
                stack.enter_context(a)
            out = ctx.run(hidden, *args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.host = ctx.device_input = None
        arg_grads = [a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args]
        return (None, None, None, hidden.grad if ctx.hidden_requires_grad else None, *arg_grads)


def checkpoint_offloaded(offloader: Offloader, run, hidden, *args: Any):
    """run(hidden, *args) checkpointed with `hidden` kept on the host until its recompute."""
    if not torch.is_grad_enabled() or not torch.is_tensor(hidden):
        return run(hidden, *args)
    always = torch.empty(0, requires_grad=True)   # the backward runs even if no input requires grad
    return _OffloadedCheckpoint.apply(run, offloader, always, hidden, *args)
