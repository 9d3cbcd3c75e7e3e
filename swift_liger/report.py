"""PatchReport: what `apply` did to one model; its counters come from the fusion registry."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .fusions import BY_KEY, COUNTED
from .patching.families import FAMILIES


@dataclass
class PatchReport:
    """What `apply` did to one model. `str(report)` is the one-line summary; `to_dict()` is JSON-serialisable.

    patched:  modules swapped per fusion. `rope` counts every attention whose rotation runs our kernel,
              `qk_norm_rope` those of them that also fuse q_norm/k_norm; `cross_entropy` is 1 when the loss is ours,
              `rolling_cache` 1 when generate() uses RollingKVCache, `compile_layers` the decoder layers that
              will run through torch.compile.
    skipped:  {fusion, reason, count, problem}. problem=False: not applicable here (switched off, no such module,
              activation without a kernel). problem=True: asked for but impossible (unexpected forward structure,
              kernel missing, module already patched by another tool); these warn, and raise under strict=True.
    """
    model_type: Optional[str]
    model_class: str
    supported: bool
    config: Dict[str, Any]
    patched: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    cross_entropy_mode: str = "off"
    activation: Optional[str] = None
    skipped: List[Dict[str, Any]] = field(default_factory=list)
    already_applied: bool = False

    def skip(self, fusion: str, reason: str, *, problem: bool = False) -> None:
        for item in self.skipped:  # one entry per distinct reason, however many layers hit it
            if item["fusion"] == fusion and item["reason"] == reason:
                item["count"] += 1
                return
        self.skipped.append({"fusion": fusion, "reason": reason, "count": 1, "problem": problem})

    @property
    def problems(self) -> List[Dict[str, Any]]:
        return [item for item in self.skipped if item["problem"]]

    @property
    def num_patched(self) -> int:
        return sum(self.patched.values())

    def to_dict(self) -> Dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def summary(self) -> str:
        if not self.supported:
            return (f"swift_liger: {self.model_class} (model_type={self.model_type!r}) is not supported (swift_liger "
                    f"patches {', '.join(sorted(FAMILIES))}); model left unpatched")
        parts = []
        for name, count in self.patched.items():
            if not count:
                continue
            label = BY_KEY[name].label
            parts.append(label(count, self) if label is not None else f"{name}x{count}")
        text = f"swift_liger: patched {self.model_class} ({self.model_type}): " + (", ".join(parts) or "nothing")
        if self.skipped:
            text += "; skipped: " + "; ".join(f"{s['fusion']} ({s['reason']})" for s in self.skipped)
        if self.already_applied:
            text += " [already applied]"
        return text

    __str__ = summary
