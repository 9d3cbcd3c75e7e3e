"""Decoder layers of a right-padded batch run SDPA's causal path without the padding mask (patching/pad_mask.py):
real tokens compute the same (no real token sees a later key under causal attention), pad positions' outputs
differ and every ms-swift loss drops them. The mask is checked once per mask tensor (one host sync); left padding,
packed rows, sliding windows, KV caches and attention other than SDPA keep their masks. With graph_layers a padded
batch then replays the key of an unpadded one instead of capturing a key of its own.

On under ms-swift's --use_liger (its collators label pads -100 and its losses mask them), except where a logged
metric reads pad positions (trl's CPO/ORPO/SimPO logits means: integration/arguments.py turns it off there) and for
commands that do not train; off for `swift_liger.apply`, where a loop's loss may read pad positions
(labels=input_ids with padding)."""
from __future__ import annotations

from .base import Fusion, read_counters


def patch(ctx) -> None:
    from ..patching import layer_forward, pad_mask   # lazy: the spec loads without torch
    layers = layer_forward.decoder_layers(ctx, "drop_pad_mask", False, "not combined with compile_layers: the "
                                          "compiled layer keeps its mask")
    if not layers:
        return
    config = getattr(getattr(layers[0], "self_attn", None), "config", None)
    if config is None:
        ctx.report.skip("drop_pad_mask", f"{type(layers[0]).__name__}.self_attn has no config", problem=False)
        return
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        ctx.report.skip("drop_pad_mask", f"attention implementation {impl!r} keeps its masks (SDPA only: there no mask "
                        "means causal)", problem=False)
        return
    masks = pad_mask.PadMasks(config)
    n = sum(layer_forward.attach(ctx, "drop_pad_mask", layer, "_liger_pad_masks", lambda: masks) for layer in layers
            if getattr(getattr(layer, "self_attn", None), "config", None) is config)
    ctx.state.parts["drop_pad_mask"] = masks
    ctx.report.patched["drop_pad_mask"] += n


def _counters(masks, reset) -> dict:
    if masks is None:
        return {}
    return {"pad_masks": read_counters(masks.stats, ("dropped", "kept"), reset)}


FUSION = Fusion(key="drop_pad_mask", default=False, swift_default=True,
                label=lambda count, report: f"right-padded batches without their masks in {count} decoder layers",
                help="Right-padded batches (ms-swift's training padding) run SDPA's causal kernels without the padding "
                     "mask: real tokens compute the same, pad positions (every ms-swift loss drops them) differ; "
                     "checked once per mask tensor, other masks kept; with graph_layers a padded batch replays an "
                     "unpadded shape. On under --use_liger (not for cpo/orpo/simpo, whose logged logits means read "
                     "pads, nor swift infer); off in swift_liger.apply (a loop's loss may read pads).",
                applies_to="decoder layers with SDPA self-attention", order=93, patch=patch, say_off=False,
                counters=_counters)
