"""Per-instance model patcher: `apply(model, config)` swaps in swift_liger kernels, `revert(model)` undoes it."""
from ..config import LigerConfig
from .families import ACTIVATIONS, FAMILIES, Family, family_for, register_family
from .patcher import PatchReport, apply, get_report, is_patched, keep_logits, revert

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "Family",
    "LigerConfig",
    "PatchReport",
    "apply",
    "family_for",
    "get_report",
    "is_patched",
    "keep_logits",
    "register_family",
    "revert",
]
