"""RoPE: the attention's module-global rotary function -> ops.apply_rope (one launch for q and k; GLM's interleaved
pairs where the family says so), or, where the family has q_norm/k_norm and qk_norm_rope is on, ops.qk_norm_rope
(the norms folded into the rotation, weighted as the family's norm says; the two RMSNorm modules then return their
input). The attention forward is HF's own code object run with a globals dict in
which that one name points at our kernel (models/rebind.py). With lora_fusion, the attention's PEFT LoRA q/k/v/o
projections run through ops.lora_linear for the length of each call (patching/lora.py)."""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Dict, Optional, Tuple

from .base import Fusion
from .lora_fusion import lora_calls

_EXTRA_PARAMS = {"unsqueeze_dim", "position_ids"}


def _extra_params(rope_fn: Callable) -> Tuple[Optional[Tuple[str, ...]], Optional[str]]:
    """Names after (q, k, cos, sin) in the HF rope function, so ours accepts the same calls."""
    try:
        names = list(inspect.signature(rope_fn).parameters)
    except (TypeError, ValueError):
        return None, "cannot read the signature of the rope function"
    extra = tuple(names[4:])
    if len(names) < 4 or set(extra) - _EXTRA_PARAMS:
        return None, f"unexpected rope function signature ({', '.join(names)})"
    return extra, None


def _unsqueeze_dim(extra: Tuple[str, ...], args: tuple, kwargs: dict) -> int:
    if not args and not kwargs:
        return 1
    values = dict(zip(extra, args))
    values.update(kwargs)
    return values.get("unsqueeze_dim", 1)


def _make_rope(apply_rope: Callable, extra: Tuple[str, ...], interleaved: bool) -> Callable:
    if interleaved:
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            return apply_rope(q, k, cos, sin, unsqueeze_dim=_unsqueeze_dim(extra, args, kwargs), interleaved=True)
        return apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        return apply_rope(q, k, cos, sin, unsqueeze_dim=_unsqueeze_dim(extra, args, kwargs))
    return apply_rotary_pos_emb


def _make_qk_rope(attention, qk_norm_rope: Callable, extra: Tuple[str, ...], norm) -> Callable:
    casting, offset, eps = norm.casting, norm.offset, norm.eps

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # weights read at call time: never a stale copy (ZeRO-3 keeps these tiny norm weights persistent)
        q_norm, k_norm = attention.q_norm, attention.k_norm
        return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps=getattr(q_norm, eps), offset=offset,
                            casting=casting, unsqueeze_dim=_unsqueeze_dim(extra, args, kwargs))
    return apply_rotary_pos_emb


def identity_forward(self, hidden_states):
    # q_norm/k_norm under fused qk-norm rope: the normalisation happens inside the rope kernel
    return hidden_states


def _build_qk_forward(attention, base: Callable, spec: dict) -> Callable:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.lora import with_lora_projections
    from ..patching.rebind import rebuild_with_globals
    rope = _make_qk_rope(attention, spec["op"], spec["extra"], spec["norm"])
    new, reason = rebuild_with_globals(base, {spec["name"]: rope}, spec["required"])
    if new is None:  # checked at apply time; only reachable if the class changed under us
        raise RuntimeError(f"swift_liger: cannot rebuild {type(attention).__name__}.forward: {reason}")
    return with_lora_projections(new) if spec.get("lora_fusion") else new


def _rebuild_qk(attention, attr: str, base: Callable, spec: dict) -> None:
    """deepcopy: the fused qk-norm rope function closes over *its* attention instance; rebuild it for the copy."""
    attention.__dict__[attr] = types.MethodType(_build_qk_forward(attention, base, spec), attention)


def _qk_norm_problem(attention, family) -> Optional[str]:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.state import class_in, foreign_forward
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    eps = family.norm.eps
    for label, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is None or not class_in(norm, family.rms_norm):
            return f"{type(attention).__name__}.{label} is not a {'/'.join(family.rms_norm)}"
        if not (hasattr(norm, "weight") and hasattr(norm, eps)):
            return f"{type(attention).__name__}.{label} has no weight/{eps}"
        foreign = foreign_forward(norm)
        if foreign:
            return foreign
    if getattr(q_norm, eps) != getattr(k_norm, eps):
        return "q_norm and k_norm use different eps"
    return None


def patch(ctx) -> None:
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.lora import share_counters, with_lora_projections
    from ..patching.rebind import innermost, rebuild_with_globals
    from ..patching.state import forward_attr, foreign_forward, load_op, set_forward
    config, family, st, report = ctx.config, ctx.family, ctx.state, ctx.report
    attentions = ctx.of(family.attention)
    if not attentions:
        report.skip("rope", f"no {'/'.join(family.attention)} module found", problem=True)
        return
    want_qk = config.qk_norm_rope and family.qk_norm and not family.rope_interleaved
    apply_rope, rope_reason = load_op("apply_rope")
    qk_op, qk_reason = load_op("qk_norm_rope") if want_qk else (None, None)
    name = family.rope_function
    plain_cache: Dict[int, Any] = {}  # one rebuilt forward (and globals dict) per attention class
    for attention in attentions:
        foreign = foreign_forward(attention)
        if foreign:
            report.skip("rope", foreign, problem=True)
            continue
        base = type(attention).forward
        hf_rope = getattr(innermost(base), "__globals__", {}).get(name)
        extra, why = _extra_params(hf_rope) if hf_rope is not None else (None, f"{name} not found")
        if why:
            report.skip("rope", f"{type(attention).__name__}: {why}", problem=True)
            continue
        if config.lora_fusion:
            share_counters(st, attention, lora_calls(st))

        if want_qk:
            qk_why = qk_reason or _qk_norm_problem(attention, family)
            if qk_why is None:
                spec = {"op": qk_op, "extra": extra, "name": name, "required": (name, "q_norm", "k_norm"),
                        "lora_fusion": config.lora_fusion, "norm": family.norm}
                new, qk_why = rebuild_with_globals(base, {name: _make_qk_rope(attention, qk_op, extra, family.norm)},
                                                   spec["required"])
                if new is not None:
                    if config.lora_fusion:
                        new = with_lora_projections(new)
                    attr = forward_attr(attention)
                    set_forward(st, attention, new)
                    st.on_deepcopy(_rebuild_qk, attention, attr, base, spec)
                    for norm in (attention.q_norm, attention.k_norm):
                        set_forward(st, norm, identity_forward)
                        ctx.consumed.add(id(norm))
                    report.patched["rope"] += 1
                    report.patched["qk_norm_rope"] += 1
                    continue
            report.skip("qk_norm_rope", qk_why, problem=True)  # fall through to the plain rope kernel

        if rope_reason:
            report.skip("rope", rope_reason, problem=True)
            continue
        key = id(base)
        if key not in plain_cache:
            plain_cache[key] = rebuild_with_globals(
                base, {name: _make_rope(apply_rope, extra, family.rope_interleaved)}, (name,))
        new, why = plain_cache[key]
        if new is None:
            report.skip("rope", why, problem=True)
            continue
        set_forward(st, attention, with_lora_projections(new) if config.lora_fusion else new)
        report.patched["rope"] += 1


FUSION = Fusion(key="rope", default=True, help="One-launch q+k rotary embedding.",
                applies_to="attentions whose forward calls the family's rope function (apply_rotary_pos_emb)",
                order=10, patch=patch)
