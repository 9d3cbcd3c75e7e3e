"""The dependency versions swift_liger is tested with, checked where they are first needed. Torch-free: it reads
installed versions from package metadata and imports nothing of theirs.

The ranges match pyproject.toml (tests/test_versions.py checks that) and what runs them:
  torch        2.11 (GPU suite on the H200) to 2.13 (both CPU CI legs)
  triton       3.6 and 3.9 (GPU: tests/ops + tests/cache on the H200, FastLaunch's GPU tests included) to 3.9
               (second CPU CI leg; 3.7 in the first)
  transformers 5.17 (GPU suite) to 5.19 (CPU CI legs); ms-swift 4.6.0 allows < 5.20
  ms-swift     4.6.x
A version outside its range raises ImportError naming the package, the version and the range, before any kernel
loads (``swift_liger.ops``), any model is patched (``swift_liger.apply``) or, under ``--use_liger``, before ms-swift
loads the model. ``SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS=1`` turns the error into one warning per package.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Dict, Optional, Tuple

# distribution name -> (lowest tested, first version not supported), compared on (major, minor[, patch])
SUPPORTED: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = {
    "torch": ((2, 11), (2, 14)),
    "triton": ((3, 6), (3, 10)),
    "transformers": ((5, 17), (5, 20)),
    "ms-swift": ((4, 6), (4, 7)),
}
ALLOW_ENV = "SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS"
_WARNED = set()


def parse(version: str) -> Tuple[int, ...]:
    """Leading release numbers of a version string: "2.13.0+cpu" -> (2, 13, 0), "3.9.0rc1" -> (3, 9, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        numbers.append(int(m.group()))
        if m.end() < len(part):   # "0rc1": the pre-release tag ends the release numbers
            break
    return tuple(numbers)


def installed(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None when it is not installed."""
    from importlib import metadata   # lazy: the ms-swift start-up hook imports the package root, not this module
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def problem(name: str, version: Optional[str]) -> Optional[str]:
    """Why ``version`` of ``name`` is outside the tested range, or None when it is inside (or not installed)."""
    if version is None:
        return None
    low, high = SUPPORTED[name]
    v = parse(version)
    if low <= v[:len(low)] and v[:len(high)] < high:
        return None
    return (f"swift_liger is tested with {name} >={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; "
            f"{version} is installed")


def require(*names: str) -> None:
    """Raise ImportError (or warn once, under SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS=1) for each installed package of
    ``names`` outside its tested range. Packages that are not installed are left to their importers."""
    allow = os.environ.get(ALLOW_ENV, "0").strip()
    if allow not in ("0", "1"):
        raise ValueError(f"{ALLOW_ENV} must be 0 or 1, got {allow!r}")
    for name in names:
        why = problem(name, installed(name))
        if why is None:
            continue
        if allow == "1":
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"{why} ({ALLOW_ENV}=1: running anyway)", stacklevel=2)
            continue
        raise ImportError(f"{why}. Install a version in that range, or set {ALLOW_ENV}=1 to run untested.")
