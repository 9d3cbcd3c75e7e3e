"""Patch one built Hugging Face model instance with swift_liger kernels; revert it.

`apply` finds the family table of the model type (patching/families.py), then runs each enabled fusion's patch from the
registry (swift_liger/fusions/) in order on the causal-LM root. Every change goes through the PatchState
(patching/state.py), stored on the root, so `revert` restores the exact eager model; classes, modeling-module globals,
parameters and buffers are never touched and `state_dict` is identical.

Deep copies of a patched model are patched copies (PatchState.__deepcopy__ re-runs what must be rebuilt for the
copy). Not supported while patched: nn.DataParallel replicas and pickling the whole module (`torch.save(model)`);
save the state_dict.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Dict, Mapping, Optional

import torch

from .versions import require

require("transformers")   # the family tables and patches follow transformers' module layout of these versions

from .config import LigerConfig
from .fusions import PATCHES, REGISTRY, PatchContext, enabled
from .ops import _launch
from .patching.families import FAMILIES, family_for
from .patching.state import STATE_ATTR, PatchState, class_in, find_states
from .report import PatchReport

logger = logging.getLogger("swift_liger")


def _resolve_config(config, overrides: Dict[str, Any]) -> LigerConfig:
    if config is None:
        config = LigerConfig()
    elif isinstance(config, Mapping):
        config = LigerConfig.from_dict(config)
    elif not isinstance(config, LigerConfig):
        raise TypeError(f"config must be a LigerConfig, a dict or None, got {type(config).__name__}")
    if overrides:
        LigerConfig.check_keys(overrides)
        config = dataclasses.replace(config, **overrides)
    return config


def _modules_outside(root: torch.nn.Module, untouched) -> list:
    """root.modules() without the subtrees of `untouched` classes (a vision tower keeps its own norms and MLPs)."""
    out, stack, seen = [], [root], set()
    while stack:
        module = stack.pop()
        if id(module) in seen or class_in(module, untouched):
            continue
        seen.add(id(module))
        out.append(module)
        stack.extend(reversed(list(module.children())))
    return out


def apply(model: torch.nn.Module, config=None, **overrides) -> PatchReport:
    """Patch this model instance (and nothing else) with swift_liger kernels.

    config: LigerConfig, dict or None (defaults); keyword overrides are LigerConfig fields. Applying the same
    config twice does nothing; a different config reverts first. Apply before wrapping with PEFT: LoRA layers
    inserted afterwards are picked up. Returns a PatchReport (also logged once on logger "swift_liger").
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"swift_liger.apply expects a torch.nn.Module, got {type(model).__name__}")
    config = _resolve_config(config, overrides)
    states = find_states(model)
    if states:
        _, st = states[0]
        if st.config.to_dict() == config.to_dict():
            report = copy.deepcopy(st.report)
            report.already_applied = True
            return report
        revert(model)

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_for(model_type)
    report = PatchReport(model_type=model_type, model_class=type(model).__name__, supported=family is not None,
                         config=config.to_dict())
    if family is None:
        message = (f"swift_liger: model type {model_type!r} ({type(model).__name__}) is not supported (swift_liger "
                   f"patches {', '.join(sorted(FAMILIES))}); the model is left unpatched")
        if config.strict:
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=2)
        return report

    root = next((m for m in model.modules() if class_in(m, family.causal_lm)), model)
    report.model_class = type(root).__name__
    st = PatchState(config, report)
    ctx = PatchContext(root=root, family=family, config=config, state=st, report=report,
                       modules=_modules_outside(root, family.untouched))
    try:
        for fusion in REGISTRY:   # what the report says whether or not a fusion runs, in registry order
            if fusion.explain is not None:
                fusion.explain(ctx)
            elif fusion.say_off and not enabled(fusion, config):
                report.skip(fusion.key, "switched off")
        for fusion in PATCHES:
            if enabled(fusion, config):
                fusion.patch(ctx)
    except BaseException:
        st.restore()
        raise
    if report.problems:
        message = "swift_liger: " + "; ".join(
            f"{p['fusion']} skipped on {p['count']} module(s): {p['reason']}" for p in report.problems)
        if config.strict:
            st.restore()
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=2)
    if st.saved or st.undo:
        root.__dict__[STATE_ATTR] = st  # after `_modules` in __dict__ order: deepcopy copies modules first
        first = next(root.parameters(), None)
        if first is not None and first.is_cuda:   # Triton's cache key, hashed while the trainer is set up
            _launch.warm_cache_key()
    logger.info("%s", report.summary())
    return report


def revert(model: torch.nn.Module) -> None:
    """Undo `apply` on this model (or on the patched model inside a PEFT wrapper). No-op when not patched."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"swift_liger.revert expects a torch.nn.Module, got {type(model).__name__}")
    for module, st in find_states(model):
        st.restore()
        module.__dict__.pop(STATE_ATTR, None)
        logger.info("swift_liger: reverted %s", type(module).__name__)


def call_counts(model: torch.nn.Module, reset: bool = False) -> Optional[Dict[str, Any]]:
    """The run-time counters of the patched model inside `model` (None when it is not patched): each fusion's
    `counters` hook in registry order (the loss head's cross_entropy_mode and calls, LoRA calls, offloaded
    checkpoints, kept attention outputs). `reset` zeroes them after reading."""
    states = find_states(model)
    if not states:
        return None
    st = states[0][1]
    out: Dict[str, Any] = {}
    for fusion in REGISTRY:
        if fusion.counters is not None:
            out.update(fusion.counters(st.parts.get(fusion.key), reset))
    return out
