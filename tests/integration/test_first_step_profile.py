"""SWIFT_LIGER_PROFILE_FIRST_STEP: the first step's cProfile (rows by cumulative and own time), the environment
variable's check, and an active profiler left alone."""
import cProfile
import time

import pytest

from swift_liger.integration import first_step_profile as fsp


def busy(seconds):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def outer():
    busy(0.05)
    return sum(range(1000))


def test_rows_name_the_frames_that_took_the_time():
    prof = fsp.FirstStepProfile(3)
    prof.start()
    outer()
    out = prof.stop()
    assert set(out) == {"total_s", "cumulative", "own"} and out["total_s"] > 0.04
    assert len(out["cumulative"]) == len(out["own"]) == 3
    assert any("(outer)" in r["function"] and r["cumulative_s"] >= 0.04 for r in out["cumulative"]), out
    assert out["own"][0]["own_s"] >= max(r["own_s"] for r in out["own"])
    assert all(r["function"].startswith("test_first_step_profile.py:") or ":" in r["function"] for r in out["own"])
    line = fsp.describe(out)
    assert line.startswith("first-step profile (SWIFT_LIGER_PROFILE_FIRST_STEP") and "outer" in line
    assert prof.stop() is None   # stopped once


def test_off_and_another_profiler_active():
    off = fsp.FirstStepProfile(0)
    off.start()
    assert off.stop() is None and fsp.describe(None) is None
    other = cProfile.Profile()
    other.enable()
    try:
        prof = fsp.FirstStepProfile(5)
        prof.start()   # cannot enable a second profiler: left off
        assert prof.stop() is None
    finally:
        other.disable()


@pytest.mark.parametrize("value,rows", [("", 0), ("0", 0), (" 12 ", 12)])
def test_the_environment_variable(monkeypatch, value, rows):
    monkeypatch.setenv(fsp.ENV, value)
    assert fsp.rows_from_env() == rows


@pytest.mark.parametrize("value", ["-1", "yes", "2.5", "²"])
def test_a_bad_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(fsp.ENV, value)
    with pytest.raises(ValueError, match="SWIFT_LIGER_PROFILE_FIRST_STEP must be a number of rows"):
        fsp.rows_from_env()
