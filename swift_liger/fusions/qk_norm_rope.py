"""Fused q_norm/k_norm + RoPE (Qwen3-style attention): applied by the rope patch, which rebuilds the attention."""
from __future__ import annotations

from .base import Fusion


def explain(ctx) -> None:
    """What the report says about qk_norm_rope whatever the rope patch does."""
    config, family, report = ctx.config, ctx.family, ctx.report
    if not config.rope and config.qk_norm_rope and family.qk_norm:
        report.skip("qk_norm_rope", "needs rope=True")
    if not family.qk_norm:
        report.skip("qk_norm_rope", f"{family.name} attention has no q_norm/k_norm")
    elif not config.qk_norm_rope:
        report.skip("qk_norm_rope", "switched off")


FUSION = Fusion(key="qk_norm_rope", default=True,
                help="Qwen3-style q_norm/k_norm fused with the rotation (needs liger_rope).",
                applies_to="attentions with q_norm/k_norm RMSNorms over head_dim (families with qk_norm)",
                applied_by=("rope",), explain=explain, say_off=False)
