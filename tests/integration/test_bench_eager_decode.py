"""The interleaved eager-decode benchmark's CLI on CPU (--tiny: 2 layers, window 64): every kind timed at every
batch and context, its turns recorded, the ratios and the report written."""
import json

import pytest

from swift_liger.bench import eager_decode


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def test_interleaved_rows_ratios_and_report(tmp_path):
    eager_decode.main(["--tiny", "--layers", "2", "--batches", "1,2", "--contexts", "40,80", "--rounds", "3",
                       "--turn-steps", "2", "--warmup", "2", "--prefill-chunk", "32", "--out", str(tmp_path),
                       "--kinds", "stock:hf_dynamic_sliding,ours:rolling_absolute,ours:rolling_streaming"])
    report = json.loads((tmp_path / "eager_decode.json").read_text())
    rows = report["rows"]
    assert [(r["batch"], r["context"], r["kind"]) for r in rows] == [
        (b, c, k) for b in (1, 2) for c in (40, 80)
        for k in ("stock:hf_dynamic_sliding", "ours:rolling_absolute", "ours:rolling_streaming")]
    assert all(len(r["turns"]) == 3 and r["ms_per_token"] > 0 for r in rows)
    assert len(report["ratios"]) == 8 and all(q["best_hf_stock"] == "stock:hf_dynamic_sliding" and q["vs_stock"] > 0
                                              for q in report["ratios"])
    assert "--kinds" in report["environment"]["command"]
    # CPU reference ops: nothing takes the direct launch path, and the report says so (counted, not configured)
    assert all(r["direct_launches_per_step"] == 0 for r in rows)
    assert report["ours_patched"].get("rms_norm", 0) > 0
    md = (tmp_path / "eager_decode.md").read_text()
    assert md.count("| 2 | 80 |") == 3   # the ms/token row and one ratio row per ring


def test_bad_kind_is_refused_before_any_work(tmp_path):
    for kind in ("rolling_absolute", "ours:rolling_sideways", "best:hf_dynamic_sliding"):
        with pytest.raises(SystemExit, match="model:cache"):
            eager_decode.main(["--tiny", "--kinds", kind, "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
