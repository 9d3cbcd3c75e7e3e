"""The rolling-cache benchmark's CLI on CPU (--tiny: 2 layers, window 64, contexts 64/128/256): left-padded
matched-context rows and their report."""
import json

import pytest

from swift_liger.bench import rolling_cache


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def test_left_padded_matched_context(tmp_path):
    rolling_cache.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--pad-step", "5", "--batches", "3",
                        "--kinds", "rolling_absolute+graph,rolling_streaming,hf_dynamic_sliding",
                        "--long-kinds", "",
                        "--no-agreement", "--no-hybrid"])
    report = json.loads((tmp_path / "rolling_cache.json").read_text())
    rows = report["matched_context"]
    assert [(r["cache"], r["context"]) for r in rows] == [(k, c) for k in ("rolling_absolute+graph",
                                                                          "rolling_streaming", "hf_dynamic_sliding")
                                                          for c in (64, 128, 256)]
    assert all(r["padded"] and r["ms_per_token"] > 0 and not r.get("error") for r in rows), rows
    md = (tmp_path / "rolling_cache.md").read_text()
    assert "left-padded batches: row b starts with b x 5 pad columns" in md
    assert md.count("| 3 | rolling_streaming |") == 3
