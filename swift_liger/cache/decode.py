"""The decode runner of a RollingKVCache: planned single-token steps attend with the split-KV decode kernel
(``swift_liger.ops.decode_attention``) and, with ``cuda_graph=True``, run as replays of one CUDA graph of the decoder.
Holds the attention function registered with transformers, the decode methods (DecodeRunner, mixed into
RollingKVCache in ring.py) and the decoder's instance-level forward wrapper that enters them.

Decode speed (CUDA). A maskless single-token step (fast path or padded decode) attends with
``swift_liger.ops.decode_attention`` (split-KV, GQA heads share their K/V reads) instead of SDPA: the decoder's
``forward`` is wrapped on this instance and the model's attention implementation is switched by name for that call
only. With ``cuda_graph=True`` every such step after the ring is full is one replay of a CUDA graph of the decoder,
its positions, slots and sink angles read from a device counter (one per row in a padded batch). H200,
Llama-3-8B shapes, 32 layers, with swift_liger's kernels in the model: 5.6 ms/token at batch 1 and 6.5 at batch 8
against 37-45 and 32-37 for transformers' sliding-window caches, whose eager steps (and ours without the graph) are
set by the host's Python (docs/benchmarks/rolling_cache.md).
"""
from __future__ import annotations

import functools
import types
import warnings

import torch

from ..ops.decode_attention_kernel import decode_attention_unchecked, decode_attention_write_unchecked
from ..ops.kv_ring_write_kernel import kv_sink_rotate_unchecked
from .support import SUPPORTED_ATTENTION

_GRAPH_ATTR = "_swift_liger_rolling_graph_forward"


# ---------------------------------------------------------------------------------------------------------------
# Decode attention for graph steps (registered with transformers' AttentionInterface under its own name)
# ---------------------------------------------------------------------------------------------------------------

_DECODE_ATTENTION = "swift_liger_rolling_decode"


# Graph steps: [B] keys visible per row (min(stream length, capacity)), computed inside the graph from the step
# counter and read by every layer's decode attention, so one captured graph serves the steps before the ring is
# full (a prefix of the storage) and after it (all of it). Set only while a graph step's decoder runs.
STEP_LENS: list = [None]

# Eager decode: RollingLayer.update leaves each layer's new token here (keyed by id of the keys it returned) and
# the layer's attention call below stores it in the same launch as the attention (ring write + decode attention
# in 2 launches instead of 3: ~40 us of host time per layer and step on the H200 host).
PENDING_WRITES: dict = {}


def _rolling_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-function contract: q [B, Hq, 1, D], k/v [B, Hkv, C, D] -> ([B, 1, Hq, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pending = PENDING_WRITES.pop(id(key), None) if PENDING_WRITES else None
    if pending is not None and pending[0] is key and pending[1] is value:
        _, _, k_new, v_new, slot, _ = pending
        return decode_attention_write_unchecked(query, key, value, float(scale), k_new, v_new, slot), None
    return decode_attention_unchecked(query, key, value, float(scale), STEP_LENS[0]), None


@functools.lru_cache(maxsize=None)
def _register_decode_attention() -> bool:
    try:
        from transformers import AttentionInterface  # lazy: older transformers lack it (caught below)
        AttentionInterface.register(_DECODE_ATTENTION, _rolling_decode_attention)
        return True
    except Exception:   # an older registry: graph steps keep the model's own attention
        return False


def _capturable(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


class DecodeRunner:
    """RollingKVCache's decode-step methods (the class in ring.py mixes them in): run the step the planner marked
    (``plan.graph`` / ``plan.decode_kernel``) with the decode attention, as a CUDA graph replay when asked."""

    def _graph_ok(self, device) -> bool:
        return (self.cuda_graph and device.type == "cuda" and self._joint_ready and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def _early_graph(self) -> bool:
        """Whether graph steps may start before the ring is full: the storage is handed to attention whole, so
        every layer must attend through our decode attention, which stops each row at its length (STEP_LENS).
        Not when a step would fall back to the model's own attention (see _call_with_decode_attention), nor for
        a window="model" cache (no graphs there)."""
        config = self._config
        impl = config.__dict__.get("_attn_implementation_internal")
        softcap = impl == "eager" and getattr(config, "attn_logit_softcapping", None) is not None
        return (self.cuda_graph and not self.own_window and impl in SUPPORTED_ATTENTION and not softcap
                and not self._wants_attentions and _register_decode_attention())

    def _graph_body(self, original, kwargs: dict):
        """One decode step of the decoder, every step-dependent value read from device buffers (capturable)."""
        plan = self._plan
        plan.done.clear()
        B = self._batch
        per_row = plan.layout == "rows"
        step = self._g_counts if per_row else self._g_step      # [B] row stream indices, or [1] for all rows
        plan.pos_t = step.view(B, 1) if per_row else step.view(1, 1).expand(B, 1)
        plan.end_t = (step + 1).expand(B).contiguous()     # the kernel reads end[b] at stride 1
        plan.lens_t = plan.end_t.clamp_max(self.capacity)   # keys visible per row once this step's token is stored
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
        STEP_LENS[0] = plan.lens_t if plan.graph else None
        try:
            out = original(**kwargs)
        finally:
            config._attn_implementation_internal = previous
            plan.defer_write = False
            STEP_LENS[0] = None
            left = [k for k, w in PENDING_WRITES.items() if w[5] is self]
            for k in left:   # a layer that did not attend through our function: store its token now
                keys, values, k_new, v_new, slot, _ = PENDING_WRITES.pop(k)
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
        if not _capturable(x) or any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states")):
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
        try:
            with torch.cuda.graph(graph, stream=stream):
                g_out = self._graph_body(original, static)
        except Exception as exc:   # something in the model cannot be captured: this step's output is the eager one
            self.cuda_graph = False           # above; the next steps plan eager (install_rolling_cache drops the
            self.graph_error = f"{type(exc).__name__}: {exc}"   # graph for later generate calls and says why)
            self._graph = None
            self.forwards[1] -= 1             # counted as what ran: an eager step
            self.forwards[0] += 1
            warnings.warn(f"RollingKVCache: capturing the decode step as a CUDA graph failed ({self.graph_error}); "
                          "decoding on eagerly", RuntimeWarning, stacklevel=2)
            return out
        self._graph = {"key": key, "inputs": inputs, "graph": graph, "out": g_out}
        return out


# ---------------------------------------------------------------------------------------------------------------
# Decoder forward wrapper
# ---------------------------------------------------------------------------------------------------------------

def _rolling_decoder_forward(self, *args, **kwargs):
    """The decoder's instance-level forward while a RollingKVCache knows it: planned decode steps go through the
    cache (graph replay, decode attention), everything else to the forward it replaced. Bound with MethodType and
    reading its state from the instance, so a deep copy runs the copy's own modules."""
    previous = self.__dict__[_GRAPH_ATTR][0]
    original = previous if previous is not None else functools.partial(type(self).forward, self)
    cache = kwargs.get("past_key_values")
    # DecodeRunner: only RollingKVCache (ring.py) mixes it in
    plan = cache._plan if isinstance(cache, DecodeRunner) and not args else None
    if plan is not None and plan.graph:
        return cache._graph_run(original, kwargs)
    if plan is not None and plan.decode_kernel:
        return cache._call_with_decode_attention(original, kwargs)
    return original(*args, **kwargs)


def ensure_forward_wrapper(decoder: torch.nn.Module) -> None:
    """Install _rolling_decoder_forward on this decoder instance (removable)."""
    if getattr(decoder, _GRAPH_ATTR, None) is not None:
        return
    previous = decoder.__dict__.get("forward")     # e.g. accelerate's hook wrapper; None: the class forward
    object.__setattr__(decoder, _GRAPH_ATTR, (previous,))
    object.__setattr__(decoder, "forward", types.MethodType(_rolling_decoder_forward, decoder))


def remove_forward_wrapper(decoder: torch.nn.Module) -> None:
    state = decoder.__dict__.get(_GRAPH_ATTR)
    if state is None:
        return
    if state[0] is not None:
        object.__setattr__(decoder, "forward", state[0])
    else:
        object.__delattr__(decoder, "forward")
    object.__delattr__(decoder, _GRAPH_ATTR)
