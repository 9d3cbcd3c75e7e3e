"""What one fusion declares. The registry (fusions/__init__.py) lists them; LigerConfig, the --liger_* flags and
YAML keys, the patch report's counters, the README flags table and `swift-liger ab --each` are all derived from it.

A fusion module holds its spec (this dataclass, torch-free so config and flags load without torch) and its patch
function, which imports what it needs when it runs. Adding a fusion: one module here, one line in the registry,
its tests. A fusion that counts what happens at run time keeps its counters in `state.parts[key]` and declares a
`counters` hook; `call_counts` and the report's summary read every fusion the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

SAME = "same as default"   # Fusion.swift_default: no ms-swift default of its own


@dataclasses.dataclass(frozen=True)
class Fusion:
    key: str                          # LigerConfig field and YAML key; the flag is --liger_<key>
    default: Any                      # value in LigerConfig() (and the default preset unless swift_default)
    help: str                         # for --help, the README table and LigerConfig's docstring
    applies_to: str                   # which modules of a family it changes
    kind: str = "bool"                # "bool" | "choice" | "mapping" | "int" | "mode" (normalize checks int/mode)
    choices: Tuple[str, ...] = ()     # kind "choice": the allowed values
    off: Any = False                  # the value that switches it off (presets, `swift-liger ab --each`)
    order: int = 0                    # patch order (attention first: it folds q_norm/k_norm before RMSNorm runs)
    patch: Optional[Callable] = None  # patch(ctx: PatchContext) -> None; None: `applied_by`'s patch reads the key
    applied_by: Tuple[str, ...] = ()
    counted: bool = True              # the patch report counts the modules it swapped
    say_off: bool = True              # the report says "switched off" when it is
    explain: Optional[Callable] = None     # explain(ctx): report skips that apply whether or not it is on
    normalize: Optional[Callable] = None   # config value -> canonical value; raises ValueError / TypeError
    parse_flag: Optional[Callable] = None  # flag or YAML string -> config value
    counters: Optional[Callable] = None    # counters(part, reset) -> {name: value} for call_counts; part is
                                           # state.parts.get(key) (None when the patch did not run)
    label: Optional[Callable] = None       # label(count, report) -> the report summary's entry (default key x count)
    swift_default: Any = SAME              # the value under ms-swift's --use_liger where no preset or flag sets it
                                           # (SAME: `default`); for what is safe only with ms-swift's losses

    @property
    def flag(self) -> str:
        return f"liger_{self.key}"

    def check(self, value):
        """The canonical value, or ValueError / TypeError naming LigerConfig.<key> and what is allowed."""
        if self.normalize is not None:
            value = self.normalize(value)
        if self.kind == "bool" and not isinstance(value, bool):
            raise TypeError(f"LigerConfig.{self.key} must be true or false, got {value!r}")
        if self.kind == "choice" and value not in self.choices:
            raise ValueError(f"LigerConfig.{self.key} must be one of {', '.join(self.choices)}, got {value!r}")
        return value


@dataclasses.dataclass
class PatchContext:
    """What a fusion's patch sees: the causal LM root of one model instance, its family table, the config, the
    patch state (every change goes through state.set so revert restores it), the report, and the modules."""
    root: Any
    family: Any
    config: Any
    state: Any
    report: Any
    modules: list
    consumed: set = dataclasses.field(default_factory=set)   # ids of modules an earlier patch folded away

    def of(self, class_names) -> list:
        return [m for m in self.modules if type(m).__name__ in class_names and id(m) not in self.consumed]


def read_counters(part, names, reset: bool) -> dict:
    """{name: part[name]} for a counters dict (zeros when `part` is None); zeroes them when `reset`."""
    out = {name: (part or {}).get(name, 0) for name in names}
    if reset and part is not None:
        part.update(dict.fromkeys(part, 0))
    return out


def is_count(text: str) -> bool:
    """True for ASCII digits only: str.isdigit() also accepts '²' or '①', which int() then refuses."""
    return text.isascii() and text.isdigit()


OFF_WORDS = ("false", "no", "off", "none", "")   # a flag or YAML string that switches a fusion off; YAML 1.1 reads an
ON_WORDS = ("true", "yes", "on")                 # unquoted `off` as false, which ms-swift passes on as "False"


def switch_word(text: str) -> Optional[bool]:
    """False for an off word, True for an on word (any case, spaces ignored), None for anything else (a count, a
    mode) that the fusion's own parse_flag reads."""
    text = text.strip().lower()
    return False if text in OFF_WORDS else True if text in ON_WORDS else None
