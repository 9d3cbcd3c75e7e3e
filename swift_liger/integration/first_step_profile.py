"""SWIFT_LIGER_PROFILE_FIRST_STEP=N: where a slow first step's host time goes.

A cProfile of the training thread from the start of training to the end of the first optimizer step: the N
functions with the most cumulative time and the N with the most own time go to liger_patch.json
(runtime.first_step.profile) and the top 8 of each to the log. The first step pays one-time work the later steps do
not (Triton builds or loads, counted apart by compile_watch.py; graph_layers' timing, warm-up and captures; library
plans and lazy CUDA module loads), and this names the Python frames it happens under, without a GPU profiler.
cProfile slows the step's Python, so a profiled run's step times are not comparable with an unprofiled one's.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
from typing import Optional

ENV = "SWIFT_LIGER_PROFILE_FIRST_STEP"
LOGGED = 8   # rows of each list in the log line


def rows_from_env() -> int:
    """The number of rows SWIFT_LIGER_PROFILE_FIRST_STEP asks for (0: off); ValueError naming it otherwise."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return 0
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{ENV} must be a number of rows (0 = off), got {value!r}")
    return int(value)


class FirstStepProfile:
    """start() when training begins, stop() after the first optimizer step -> {"total_s", "cumulative", "own"} or
    None (off, or another profiler was active so none could start)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.profile = None

    def start(self) -> None:
        if not self.rows or self.profile is not None:
            return
        if sys.getprofile() is not None:   # another profiler is active in this thread (Python < 3.12)
            return
        profile = cProfile.Profile()
        try:
            profile.enable()
        except ValueError:   # another profiler is active (Python 3.12+: sys.monitoring's profiler slot)
            return
        self.profile = profile

    def stop(self) -> Optional[dict]:
        profile, self.profile = self.profile, None
        if profile is None:
            return None
        profile.disable()
        stats = pstats.Stats(profile)

        def row(key, value):
            path, line, name = key
            return {"function": f"{os.path.basename(path)}:{line}({name})", "calls": value[1],
                    "own_s": round(value[2], 4), "cumulative_s": round(value[3], 4)}
        entries = list(stats.stats.items())
        cumulative = sorted(entries, key=lambda kv: -kv[1][3])[:self.rows]
        own = sorted(entries, key=lambda kv: -kv[1][2])[:self.rows]
        return {"total_s": round(stats.total_tt, 3), "cumulative": [row(k, v) for k, v in cumulative],
                "own": [row(k, v) for k, v in own]}


def describe(profile: Optional[dict]) -> Optional[str]:
    if not profile:
        return None

    def top(rows, key):
        return ", ".join(f"{r['function']} {r[key]:.2f} s" for r in rows[:LOGGED])
    return (f"first-step profile ({ENV}, cProfile, {profile['total_s']:.2f} s profiled): most own time: "
            f"{top(profile['own'], 'own_s')}; most cumulative time: {top(profile['cumulative'], 'cumulative_s')}")
