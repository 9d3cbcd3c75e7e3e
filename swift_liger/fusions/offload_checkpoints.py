"""Offloaded gradient checkpoints: each decoder layer's checkpointed input waits in pinned CPU memory, copied out
while the layer computes and back while the next-later layer recomputes (models/offload.py). Takes effect where
gradient checkpointing is on (`--gradient_checkpointing true`, ms-swift's default): the patch swaps the checkpoint
function of every decoder layer now, and again whenever the model's gradient checkpointing is (re)enabled.

`true` offloads every decoder layer's checkpoint; an integer N only the first N layers' (the rest stay on the device,
as HF keeps them). Partial offload trades device memory for host memory: Llama-3-8B at 512k tokens has a 4 GiB
checkpoint per layer, 128 GiB in all, which is all the host memory of a 128 GiB machine; offloading 16 layers puts
64 GiB on each side."""
from __future__ import annotations

import functools

from .base import Fusion, is_count, read_counters, switch_word


def normalize(value):
    if value is None or value is False or value == 0:
        return False
    if value is True or (isinstance(value, int) and value > 0):
        return value
    raise ValueError(f"LigerConfig.offload_checkpoints must be true, false or a number of decoder layers to offload "
                     f"(the first N; an integer >= 1), got {value!r}")


def parse_flag(value):
    if value is None or isinstance(value, (int, bool)):
        return value
    text = str(value).strip().lower()
    word = switch_word(text)
    if word is not None:
        return word
    if text in ("0", "all"):
        return text == "all"
    if not is_count(text):
        raise ValueError(f"liger_offload_checkpoints must be true, false or a number of decoder layers (the first "
                         f"N), got {value!r}")
    return int(text)


def chosen(layers, value) -> list:
    return list(layers) if value is True else list(layers)[:value]


def patch(ctx) -> None:
    from ..patching import checkpoint_funcs   # lazy: the spec loads without torch
    from ..patching.offload import Offloader, checkpoint_offloaded
    layers = checkpoint_funcs.checkpointed_layers(ctx, "offload_checkpoints")
    if not layers:
        return
    layers = chosen(layers, ctx.config.offload_checkpoints)
    offloader = Offloader()
    checkpoint_funcs.install(ctx, layers, functools.partial(checkpoint_offloaded, offloader))
    ctx.state.parts["offload_checkpoints"] = offloader
    ctx.report.patched["offload_checkpoints"] = len(layers)


def _counters(offloader, reset) -> dict:
    # layer inputs sent to the host, and how they came back; absent when the patch did not run
    if offloader is None:
        return {}
    return {"offloaded_checkpoints": read_counters(offloader.calls, tuple(offloader.calls), reset)}


FUSION = Fusion(key="offload_checkpoints", default=False, kind="int", off=False,
                help="Keep gradient checkpoints (each decoder layer's input) in pinned CPU memory, copied out and "
                     "prefetched back on a side stream; true = every layer, N = the first N layers; needs gradient "
                     "checkpointing on.",
                applies_to="decoder layers (GradientCheckpointingLayer)", order=85, patch=patch, say_off=False,
                normalize=normalize, parse_flag=parse_flag, counters=_counters)
