"""torch.compile each decoder layer of this instance (lazily, at its first call), recorded so revert undoes it."""
from __future__ import annotations

from .base import Fusion


def recompile(layer) -> None:
    """deepcopy: the copied entry would still call the original layer."""
    import torch   # lazy: the spec loads without torch
    layer.__dict__["_compiled_call_impl"] = torch.compile(layer._call_impl)


def patch(ctx) -> None:
    """What nn.Module.compile() does. PEFT wraps the layers' Linear children later; dynamo traces whatever children
    a layer has at its first call."""
    import torch
    layers = ctx.of(ctx.family.decoder_layer)
    if not layers:
        ctx.report.skip("compile_layers", f"no {'/'.join(ctx.family.decoder_layer)} module found", problem=True)
        return
    for layer in layers:
        if layer.__dict__.get("_compiled_call_impl") is not None:
            ctx.report.skip("compile_layers", f"{type(layer).__name__} is already compiled", problem=True)
            continue
        ctx.state.set(layer, "_compiled_call_impl", torch.compile(layer._call_impl))
        ctx.state.on_deepcopy(recompile, layer)
        ctx.report.patched["compile_layers"] += 1


FUSION = Fusion(key="compile_layers", default=False,
                label=lambda count, report: f"torch.compile on {count} decoder layers",
                help="torch.compile each decoder layer (our ops stay single custom-op nodes inside); first steps pay "
                     "the compile time.",
                applies_to="decoder layers", order=90, patch=patch, say_off=False)
