"""Tiled MLP for long sequences: each MLP (with its LoRA, and with the swiglu fusion's kernel when that is on) runs
over tiles of `tiled_mlp` tokens, each tile under its own non-reentrant checkpoint, so its [tokens, intermediate]
activations exist for one tile at a time, forward and backward (the recompute of one tile, then its backward).

Per MLP call this keeps the input [T, H] and the output [T, H]; the gate/up/product buffers shrink from T to `tile`
rows: at Llama-3-8B shapes (I = 14336, bf16) three [T, I] buffers are 84 KiB per token, 42 GiB at 512k tokens,
against 2 GiB for tiles of 8192 tokens. The price is one more forward of the MLP per backward (the tile recompute),
about a third more MLP FLOPs under layer checkpointing, and nothing when T <= tile (the MLP runs as it is).

Per-token math is unchanged (an MLP never mixes tokens): the same losses; weight gradients are summed over tiles
in a different order (rounding). LoRA dropout inside the MLP draws its masks tile by tile, so they differ from an
untiled run's (same distribution); the recompute draws the forward's masks again (torch.utils.checkpoint restores
the RNG and autocast state), so the gradients are those of the loss computed.
"""
from __future__ import annotations

from .base import Fusion, is_count, switch_word

DEFAULT_TILE = 8192   # tokens; [8192, 14336] bf16 = 224 MiB per intermediate buffer


def normalize(value):
    if value is None or value is False:
        return 0
    if value is True:
        return DEFAULT_TILE
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"LigerConfig.tiled_mlp must be tokens per tile (an integer >= 0; 0 = off, true = "
                         f"{DEFAULT_TILE}), got {value!r}")
    return value


def parse_flag(value):
    if value is None or isinstance(value, (int, bool)):
        return value
    text = str(value).strip().lower()
    word = switch_word(text)
    if word is not None:
        return DEFAULT_TILE if word else 0
    if not is_count(text):
        raise ValueError(f"--liger_tiled_mlp must be tokens per tile (an integer >= 0; 0 = off, true = "
                         f"{DEFAULT_TILE}), got {value!r}")
    return int(text)


def _checkpoint(forward, part):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(forward, part, use_reentrant=False)


def tiled(forward, x, tile: int):
    """forward(x) computed over tiles of `tile` tokens of x [..., H] (each tile checkpointed when grad is on)."""
    import torch

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= tile:
        return forward(x)
    if not torch.is_grad_enabled():
        outs = [forward(part) for part in rows.split(tile)]
    else:
        outs = [_checkpoint(forward, part) for part in rows.split(tile)]
    out = torch.cat(outs)
    return out.view(*x.shape[:-1], out.shape[-1])


def _make_forward(inner, tile: int):
    # `inner` is a plain function called with self: a deep copy's bound forward then runs the copy's modules
    def forward(self, x):
        return tiled(lambda part: inner(self, part), x, tile)
    return forward


def patch(ctx) -> None:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.state import forward_attr, foreign_forward, set_forward
    tile = ctx.config.tiled_mlp
    for mlp in ctx.of(ctx.family.mlp):
        attr = forward_attr(mlp)
        current = mlp.__dict__.get(attr)
        ours = current is not None and any(obj is mlp and name == attr for obj, name, *_ in ctx.state.saved)
        why = None if ours else foreign_forward(mlp)
        if why:
            ctx.report.skip("tiled_mlp", why, problem=True)
            continue
        inner = current.__func__ if ours else type(mlp).forward   # the swiglu fusion's forward, or HF's
        set_forward(ctx.state, mlp, _make_forward(inner, tile))
        ctx.report.patched["tiled_mlp"] += 1


FUSION = Fusion(key="tiled_mlp", default=0, kind="int", off=0,
                help=f"Run each MLP over tiles of this many tokens (forward and backward): long sequences without "
                     f"[tokens, intermediate] activations; 0 = off, true = {DEFAULT_TILE}.",
                applies_to="dense MLP modules (the family's MLP classes; MoE experts are not tiled)", order=35,
                patch=patch, say_off=False, normalize=normalize, parse_flag=parse_flag)
