"""Replay each decoder layer's forward and backward as CUDA graphs (patching/layer_graphs.py), where training runs
it under reentrant gradient checkpointing (ms-swift's default on one GPU), and the forward alone of autograd-off
passes (DPO/GRPO reference and old-policy forwards, evaluation). Everything else runs the layer as it is,
counted by reason in call_counts()["graph_layers"]["eager"]. Captured at a layer's first call of each batch shape
(lengths padded to 8 buckets per octave); a shape whose replay is not faster than the eager layer (timed in its
first layer at the capture and again at its 5th replayed first pass: GPU-bound 7B-8B steps) runs eagerly, and one
whose eager forward the host issues in under half its GPU time is not captured at all."""
from __future__ import annotations

from .base import Fusion


def patch(ctx) -> None:
    from ..patching import layer_forward, layer_graphs   # lazy: the spec loads without torch
    layers = layer_forward.decoder_layers(ctx, "graph_layers", True, "not combined with compile_layers (a compiled "
                                          "layer is replayed by torch.compile's own code)")
    if not layers:
        return
    import torch   # lazy: the spec loads without torch
    if not torch.cuda.is_available() and layer_graphs.LayerGraphs.backend_for == layer_graphs._Backend.of:
        ctx.report.skip("graph_layers", "no CUDA device (CUDA graphs replay on one only)")
        return
    shared = layer_graphs.Shared()
    n = sum(layer_forward.attach(ctx, "graph_layers", layer, "_liger_graphs", lambda: layer_graphs.LayerGraphs(shared))
            for layer in layers)
    ctx.state.parts["graph_layers"] = shared
    ctx.report.patched["graph_layers"] += n


def _outside_torch_mib(shared):
    """Device memory in use that this process's torch allocator does not hold (CUDA context, cuBLAS, the captured
    graphs' own memory, which grows with the graphs kept, and any other process on the GPU), MiB; None off CUDA or
    before a capture."""
    backend = next((m.backend for m in shared.members if m.backend is not None), None)
    stream = getattr(backend, "stream", None)
    if stream is None:
        return None
    import torch   # lazy: the spec loads without torch
    free, total = torch.cuda.mem_get_info(stream.device)
    return round((total - free - torch.cuda.memory_reserved(stream.device)) / 2 ** 20)


def _counters(shared, reset) -> dict:
    if shared is None:
        return {}
    stats = shared.stats
    out = {"graph_layers": {"captures": stats["captures"], "capture_s": round(stats["capture_s"], 3),
                            "capture_parts_s": {k: round(v, 3) for k, v in stats["capture_parts_s"].items()},
                            "replays": stats["replays"], "eager": dict(stats["eager"]),
                            "measured": list(stats["measured"]), "inferred": stats["inferred"],
                            "no_grad_replays": stats["no_grad_replays"],
                            "keys_replayed": len(shared.slots),
                            "static_mib": round(shared.store.nbytes() / 2 ** 20, 1),
                            "device_outside_torch_mib": _outside_torch_mib(shared),
                            **{k: stats[k] for k in ("compiled_ahead", "compile_ahead_failed", "compile_ahead_error")}}}
    if reset:
        from ..patching.layer_graphs import new_stats   # lazy: the spec loads without torch
        stats.update(new_stats())
    return out


FUSION = Fusion(key="graph_layers", default=True,
                label=lambda count, report: f"CUDA graphs of {count} decoder layers",
                help="Replay each decoder layer's forward and backward as CUDA graphs under reentrant gradient "
                     "checkpointing, and the forward of reference, old-policy and evaluation passes (one capture per "
                     "batch shape, kept where its first layer times faster than eager; adapters only, not full "
                     "fine-tuning).",
                applies_to="decoder layers (GradientCheckpointingLayer)", order=95, patch=patch, say_off=False,
                counters=_counters)
