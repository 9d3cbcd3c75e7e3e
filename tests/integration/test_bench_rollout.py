"""The rollout benchmark (swift_liger.bench.rollout, tools/gpu_rollout.sh) on CPU: ms-swift's pt engine generates a
GRPO group on a tiny build for each variant (stock, patched, patched on the exact ring; the graph variant runs the
ring eagerly without CUDA), rounds interleaved, and `report` merges the JSONs into markdown, JSON and a PNG. The
numbers are not checked; what ran is (tokens returned, the ring's counted calls and forwards)."""
from __future__ import annotations

import json
import os

import pytest

from swift_liger.bench import rollout, swift_cli

pytestmark = pytest.mark.slow
NEW, GENERATIONS = 6, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_rollout")
    build = str(root / "build")
    assert swift_cli.main(["build", build, "--shape", "qwen2.5-1.5b", "--hidden", "64", "--vocab", "2304", "--layers",
                           "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--seq", "256", "--rows",
                           "4", "--pref-rows", "4", "--device", "cpu"]) == 0
    out = str(root / "rollout.json")
    mp = pytest.MonkeyPatch()
    mp.setenv("SWIFT_LIGER_BACKEND", "torch")   # the PyTorch reference ops: the interpreter is slow for generate
    try:
        assert rollout.main([f"{build}/model", f"{build}/grpo.jsonl", "--new-tokens", str(NEW), "--generations",
                             str(GENERATIONS), "--rounds", "2", "--device", "cpu", "--out", out]) == 0
    finally:
        mp.undo()
    return root, json.load(open(out))


def test_every_variant_generates_a_group_per_round(result):
    _, res = result
    assert [r["variant"] for r in res["rows"]] == list(rollout.VARIANTS) + list(rollout.VARIANTS)[::-1]
    for r in res["rows"]:
        assert 0 < r["completion_tokens"] <= NEW * GENERATIONS and r["tokens_per_s"] > 0
        ring = r.get("rolling_cache")
        if r["variant"] in ("swift_liger_ring", "swift_liger_graph"):   # one exact ring per call, eager on CPU
            assert ring["generate"] == 1 and 1 < ring["forwards"] <= NEW and ring["graph_steps"] == 0, ring
        else:
            assert ring is None, r
    assert set(res["summary"]) == set(rollout.VARIANTS) and res["summary"]["plain"]["vs_plain"] == 1.0
    assert res["window"] == res["prompt_tokens"] + NEW
    assert {"rms_norm", "rope", "swiglu"} <= set(res["patched"])
    assert res["command"].startswith("python -m swift_liger.bench.rollout ") and "--new-tokens 6" in res["command"]


def test_report_merges_points(result, tmp_path):
    root, _ = result
    text = rollout.report([str(root / "rollout.json")], str(tmp_path / "r"), note="a note")
    assert "| build | 2 x 6 " in text   # the point is named by its build directory
    assert "stock pt engine" in text and "a note" in text and "python -m swift_liger.bench.rollout" in text
    data = json.load(open(tmp_path / "r.json"))
    assert len(data["points"]) == 1 and data["note"] == "a note"
    assert os.path.getsize(tmp_path / "r.png") > 0
