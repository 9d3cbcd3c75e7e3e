"""LigerConfig: which fusions the patcher applies. Shared by `swift_liger.apply` and the ms-swift plugin.

No torch import: the ms-swift flags and `swift-liger flags` build on it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from .fusions import REGISTRY



def closest(name: str, known) -> str:
    """' (did you mean X?)' for the nearest known name (a prefix of one counts), else ''."""
    import difflib
    known = list(known)
    prefixed = [k for k in known if k.startswith(name)]
    match = prefixed if len(prefixed) == 1 else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _post_init(self):
    for fusion in REGISTRY:
        setattr(self, fusion.key, fusion.check(getattr(self, fusion.key)))
    if not isinstance(self.strict, bool):
        raise TypeError(f"LigerConfig.strict must be true or false, got {self.strict!r}")


def _field_names(cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")


def _check_keys(cls, keys) -> None:
    unknown = sorted(set(keys) - set(cls.field_names()))
    if unknown:
        hints = "".join(closest(k, cls.field_names()) for k in unknown[:1])
        raise ValueError(f"unknown swift_liger config key(s): {', '.join(unknown)}{hints}; "
                         f"known keys: {', '.join(cls.field_names())}")


def _from_dict(cls, data: Mapping[str, Any]):
    cls.check_keys(data)
    return cls(**dict(data))


def read_yaml(path: str) -> dict:
    """The mapping a config file holds (keys not yet checked); errors name the file."""
    import yaml
    if not os.path.isfile(path):
        raise FileNotFoundError(f"liger_config: no such file {path!r}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"liger_config {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"liger_config {path!r} must hold a mapping of keys, got {type(data).__name__}")
    return dict(data)


def _from_yaml(cls, path: str):
    return cls.from_dict(read_yaml(path))


def _to_dict(self) -> dict:
    return {name: getattr(self, name) for name in self.field_names()}


_TYPES = {"bool": bool, "choice": str, "mapping": Optional[dict], "int": int, "mode": object}

# LigerConfig: one field per fusion of the registry (swift_liger/fusions/), then strict. Generated so a new fusion
# is one module: its key, default, checks and help reach the config, the flags, YAML and the docs from there.
LigerConfig = dataclasses.make_dataclass(
    "LigerConfig",
    [(f.key, _TYPES[f.kind], dataclasses.field(default=f.default)) for f in REGISTRY]
    + [("strict", bool, dataclasses.field(default=False)),
       ("extra", dict, dataclasses.field(default_factory=dict, repr=False))],
    namespace={"__post_init__": _post_init, "field_names": classmethod(_field_names),
               "check_keys": classmethod(_check_keys),
               "from_dict": classmethod(_from_dict), "from_yaml": classmethod(_from_yaml), "to_dict": _to_dict,
               "__module__": __name__})
LigerConfig.__doc__ = (
    "Which fusions the patcher applies (one switch per fusion; swift_liger/fusions/).\n\n"
    + "\n".join(f"    {f.key}: {f.help} Default {f.default!r}." for f in REGISTRY)
    + "\n    strict: an unsupported model type, or a fusion that cannot apply, is an error instead of a warning.")
