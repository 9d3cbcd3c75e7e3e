"""Gated MLP: down(act(gate(x)) * up(x)) with act and the product fused (ops.swiglu for SiLU, ops.geglu for
tanh-GELU). gate and up are fresh projection outputs only the activation reads, so its backward writes their
gradients into them: two [tokens, intermediate] buffers fewer at the peak (2 x 224 MiB for Llama-3-8B at 8k).
Packed projections (Phi-3, GLM-4: one gate_up_proj whose output is [gate | up]) are read in place as two row-strided
halves. MoE experts with packed weights (Qwen3-MoE) get the same kernel through their `_apply_gate` hook, which
transformers' grouped_mm and batched_mm experts call; the router and the expert matmuls stay transformers'. With
lora_fusion the PEFT LoRA projections of a dense MLP run through ops.lora_linear (patching/lora.py)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from ..patching.families import ACTIVATIONS
from .base import Fusion
from .lora_fusion import lora_calls


def _make_forward(gated_act: Callable, layout, lora_fusion: bool) -> Callable:
    gate_name, up_name, down_name = layout.gate, layout.up, layout.down
    if lora_fusion:
        # lazy: the spec loads without torch; the patch imports the toolkit when it runs
        from ..patching.lora import project

        if gate_name is None:
            def forward(self, x):
                gate, up = project(self, getattr(self, up_name), x).chunk(2, dim=-1)
                return project(self, getattr(self, down_name), gated_act(gate, up, inplace_backward=True))
            return forward

        def forward(self, x):
            gate, up = project(self, getattr(self, gate_name), x), project(self, getattr(self, up_name), x)
            return project(self, getattr(self, down_name), gated_act(gate, up, inplace_backward=True))
        return forward

    # children are looked up at call time, so LoRA-wrapped projections are used
    if gate_name is None:
        def forward(self, x):
            gate, up = getattr(self, up_name)(x).chunk(2, dim=-1)
            return getattr(self, down_name)(gated_act(gate, up, inplace_backward=True))
        return forward

    def forward(self, x):
        gate = getattr(self, gate_name)(x)
        return getattr(self, down_name)(gated_act(gate, getattr(self, up_name)(x), inplace_backward=True))
    return forward


def _make_apply_gate(gated_act: Callable) -> Callable:
    def _apply_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)   # [S, 2I] -> two [S, I] halves, read in place
        return gated_act(gate, up, inplace_backward=True)
    return _apply_gate


def _kernel_for(module, act_name: str) -> Tuple[Optional[str], Optional[str], bool]:
    """(kernel, reason, problem) for the activation module `module.<act_name>`: no kernel is no problem."""
    act = getattr(module, act_name)
    kernel = ACTIVATIONS.get(type(act).__name__)
    if kernel is None:
        return None, f"activation {type(act).__name__} has no fused gated kernel", False
    return kernel, None, False


def _patch_experts(ctx, cache) -> None:
    import types

    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.state import load_op
    for experts in ctx.of(ctx.family.experts):
        why, problem = None, True
        if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "act_fn")
                and hasattr(type(experts), "_apply_gate")):
            why = f"{type(experts).__name__} has no gate_up_proj/act_fn/_apply_gate"
        elif not getattr(experts, "has_gate", True) or not getattr(experts, "is_concatenated", True):
            why = f"{type(experts).__name__} weights are not packed as [gate | up]"
        elif "_apply_gate" in experts.__dict__:
            why = f"{type(experts).__name__} already has an instance-level _apply_gate (patched by another tool)"
        else:
            impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
            if impl not in ("grouped_mm", "batched_mm"):
                why, problem = (f"experts_implementation {impl!r} computes act_fn(gate) * up inline (grouped_mm and "
                                f"batched_mm call the fused kernel)"), False
        if why is None:
            kernel, why, problem = _kernel_for(experts, "act_fn")
        if why:
            ctx.report.skip("swiglu", why, problem=problem)
            continue
        if ("experts", kernel) not in cache:
            op, reason = load_op(kernel)
            cache[("experts", kernel)] = (_make_apply_gate(op) if op is not None else None), reason
        fn, why = cache[("experts", kernel)]
        if why:
            ctx.report.skip("swiglu", why, problem=True)
            continue
        ctx.state.set(experts, "_apply_gate", types.MethodType(fn, experts))
        ctx.report.patched["swiglu"] += 1
        ctx.report.activation = kernel


def patch(ctx) -> None:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.lora import share_counters
    from ..patching.state import foreign_forward, load_op, set_forward
    lora_fusion = ctx.config.lora_fusion
    layout = ctx.family.mlp_layout
    names = tuple(n for n in (layout.gate, layout.up, layout.down, layout.act) if n is not None)
    cache: Dict[tuple, Tuple[Optional[Callable], Optional[str]]] = {}  # kernel -> (MLP forward, reason)
    for mlp in ctx.of(ctx.family.mlp):
        missing = [n for n in names if not hasattr(mlp, n)]
        if missing:
            ctx.report.skip("swiglu", f"{type(mlp).__name__} has no {', '.join(missing)}", problem=True)
            continue
        kernel, why, problem = _kernel_for(mlp, layout.act)
        if why:
            ctx.report.skip("swiglu", why, problem=problem)
            continue
        if kernel not in cache:
            op, why = load_op(kernel)
            cache[kernel] = (_make_forward(op, layout, lora_fusion) if op is not None else None), why
        forward, why = cache[kernel]
        why = why or foreign_forward(mlp)
        if why:
            ctx.report.skip("swiglu", why, problem=True)
            continue
        set_forward(ctx.state, mlp, forward)
        if lora_fusion:
            share_counters(ctx.state, mlp, lora_calls(ctx.state))
        ctx.report.patched["swiglu"] += 1
        ctx.report.activation = kernel
    if ctx.family.experts:
        _patch_experts(ctx, cache)


FUSION = Fusion(key="swiglu", default=True, help="Fused SwiGLU/GeGLU MLP activation.",
                label=lambda count, report: f"{report.activation or 'swiglu'}x{count}",
                applies_to="gated MLPs (gate_proj/up_proj or a packed gate_up_proj, down_proj) and packed MoE experts "
                           "with SiLU or tanh-GELU",
                order=30, patch=patch)
