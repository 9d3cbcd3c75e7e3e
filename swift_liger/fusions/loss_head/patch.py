"""The loss-head patch: installs forward.py's forwards and loss function on one causal LM instance."""
from __future__ import annotations

import functools
import inspect
import types
from typing import Callable, Optional

import torch

from ...patching.state import class_in, foreign_forward, load_op, set_forward
from . import forward as fwd
from .sharding import lm_head_cross_entropy
from .state import EMIT_HIDDEN_ATTR, KEY, HeadState


def _labels_index(forward: Callable) -> Optional[int]:
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if "labels" not in names:
        return None
    return names.index("labels") - 1  # minus self


def patch(ctx) -> None:
    root, family, st, report = ctx.root, ctx.family, ctx.state, ctx.report
    if not class_in(root, family.causal_lm):
        report.skip(KEY, f"{type(root).__name__} is not a {'/'.join(family.causal_lm)}")
        return
    ce, why = load_op("cross_entropy")
    if ce is None:
        report.skip(KEY, why, problem=True)
        return
    head = HeadState(mode=ctx.config.cross_entropy)
    head.ops["cross_entropy"] = ce
    if head.mode == "fused_linear":
        flce, why = load_op("fused_linear_cross_entropy")
        lm_head = root._modules.get(family.lm_head)
        labels_index = _labels_index(type(root).forward)
        if why is None and not isinstance(lm_head, torch.nn.Linear):
            why = f"{family.lm_head} is {type(lm_head).__name__}, not nn.Linear"
        if why is None:
            why = foreign_forward(lm_head) or foreign_forward(root)
        if why is None and labels_index is None:
            why = f"{type(root).__name__}.forward has no labels argument"
        if why is None:
            head.ops["fused_linear_cross_entropy"] = flce
            head.head_loss = lm_head_cross_entropy   # gathers a ZeRO-3 / FSDP2-sharded head
            head.lm_head, head.lm_head_name, head.labels_index = lm_head, family.lm_head, labels_index
            head.softcap_attr = family.logit_softcap
            st.set(lm_head, EMIT_HIDDEN_ATTR, False)
            set_forward(st, lm_head, fwd.lm_head_forward)
            original = fwd.causal_lm_forward
            wrapper = functools.update_wrapper(
                types.FunctionType(original.__code__, original.__globals__, original.__name__),
                type(root).forward)  # __wrapped__ keeps inspect.signature(model.forward) (Trainer columns) intact
            set_forward(st, root, wrapper)
        else:
            report.skip(KEY, f"fused_linear unavailable, using fused: {why}", problem=True)
            head.mode = "fused"
    st.parts[KEY] = head
    st.set(root, "_loss_function", types.MethodType(fwd.causal_lm_loss, root))
    report.patched[KEY] = 1
    report.cross_entropy_mode = head.mode
