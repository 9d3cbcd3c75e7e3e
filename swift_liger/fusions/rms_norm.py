"""RMSNorm: each RMSNorm module's forward -> ops.rms_norm, weighted and rounded as the family's table says
((offset + weight) * x / rms(x); Llama or Gemma casting)."""
from __future__ import annotations

from .base import Fusion


def _make_forward(rms_norm, norm):
    casting, offset, eps = norm.casting, norm.offset, norm.eps

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, getattr(self, eps), offset=offset, casting=casting)
    return forward


def patch(ctx) -> None:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.state import foreign_forward, load_op, set_forward
    norms = ctx.of(ctx.family.rms_norm)
    if not norms:
        return
    spec = ctx.family.norm
    op, reason = load_op("rms_norm")
    forward = _make_forward(op, spec) if op is not None else None
    for norm in norms:
        why = reason or foreign_forward(norm)
        if why is None and not (hasattr(norm, "weight") and hasattr(norm, spec.eps)):
            why = f"{type(norm).__name__} has no weight/{spec.eps}"
        if why:
            ctx.report.skip("rms_norm", why, problem=True)
            continue
        set_forward(ctx.state, norm, forward)
        ctx.report.patched["rms_norm"] += 1


FUSION = Fusion(key="rms_norm", default=True, help="Triton RMSNorm.",
                applies_to="RMSNorm modules (weight and eps; Llama or Gemma (1 + w) scaling)", order=20, patch=patch)
