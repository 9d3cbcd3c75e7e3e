"""Per-instance model patcher: `apply(model, config)` swaps in swift_liger kernels, `revert(model)` undoes it."""
from ..config import LigerConfig
from .families import ACTIVATIONS, FAMILIES, Family, family_for, register_family
from .patcher import apply, revert
from .record import PatchReport
from .state import call_counts, get_report, is_patched, keep_logits

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "Family",
    "LigerConfig",
    "PatchReport",
    "apply",
    "call_counts",
    "family_for",
    "get_report",
    "is_patched",
    "keep_logits",
    "register_family",
    "revert",
]
