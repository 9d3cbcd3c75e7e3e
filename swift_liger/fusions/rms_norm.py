"""RMSNorm: each RMSNorm module's forward -> ops.rms_norm (weight * x / rms(x), Llama casting)."""
from __future__ import annotations

from .base import Fusion


def _make_forward(rms_norm):
    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")
    return forward


def patch(ctx) -> None:
    from ..models.state import foreign_forward, load_op, set_forward
    norms = ctx.of(ctx.family.rms_norm)
    if not norms:
        return
    op, reason = load_op("rms_norm")
    forward = _make_forward(op) if op is not None else None
    for norm in norms:
        why = reason or foreign_forward(norm)
        if why is None and not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
            why = f"{type(norm).__name__} has no weight/variance_epsilon"
        if why:
            ctx.report.skip("rms_norm", why, problem=True)
            continue
        set_forward(ctx.state, norm, forward)
        ctx.report.patched["rms_norm"] += 1


FUSION = Fusion(key="rms_norm", default=True, help="Triton RMSNorm.",
                applies_to="RMSNorm modules (weight, variance_epsilon)", order=20, patch=patch)
