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
    assert "left-padded batches (batch > 1): row b starts with b x 5 pad columns" in md
    assert md.count("| 3 | rolling_streaming |") == 3


def test_profile_section_with_our_kernels(tmp_path):
    rolling_cache.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--profile-steps", "2", "--no-matched",
                        "--liger",
                        "--batches", "1,2", "--pad-step", "3", "--kinds", "rolling_streaming+graph,dynamic",
                        "--long-kinds", "", "--no-agreement", "--no-hybrid"])
    report = json.loads((tmp_path / "rolling_cache.json").read_text())
    rows = report["profile"]
    assert [(r["batch"], r["cache"], r["padded"]) for r in rows] == [
        (1, "rolling_streaming+graph", False), (1, "dynamic", False),
        (2, "rolling_streaming+graph", True), (2, "dynamic", True)]
    # on CPU there are no device kernels: host time only
    assert all(r["ms_per_token"] > 0 and r["wall_ms"] > 0 and r["device_ms"] == 0 and r["launches"] == 0
               for r in rows), rows
    assert report["matched_context"] == []
    # --liger: our kernels in the (shared) decode model, counted from the patch report
    assert ("swift_liger kernels applied to every cache's model (rms_norm 5, rope 2, swiglu 2 modules)"
            in report["model"])
    md = (tmp_path / "rolling_cache.md").read_text()
    assert "## Where a decode step's time goes" in md and "## Decode latency and KV memory at matched" not in md


@pytest.mark.parametrize("name, group", [
    ("_kv_ring_write_kernel", "ring write"), ("_kv_sink_refresh_kernel", "ring write"),
    ("_decode_split_kernel", "decode attention"), ("_decode_merge_kernel", "decode attention"),
    ("pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "sdpa"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"), ("nvjet_tst_64x8_64x16_4x1_v", "gemm"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "cat / copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other")])
def test_kernel_groups(name, group):
    assert rolling_cache.kernel_group(name) == group


def test_liger_kinds_beside_the_stock_model(tmp_path):
    """'+liger' kinds run with our kernels patched in for their rows only (reverted after): one run compares the
    stock model's HF caches with `swift infer --use_liger`'s stack, and the same-model column isolates the cache."""
    rolling_cache.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "1", "--rounds", "3",
                        "--steps", "2", "--profile-steps", "2",
                        "--kinds", "rolling_absolute+liger,hf_dynamic_sliding,hf_static_sliding,"
                                   "hf_dynamic_sliding+liger,rolling_streaming",
                        "--long-kinds", "", "--no-agreement", "--no-hybrid"])
    report = json.loads((tmp_path / "rolling_cache.json").read_text())
    rows = {(r["cache"], r["context"]): r for r in report["matched_context"]}
    assert len(rows) == 5 * 3 and not any(r.get("error") for r in rows.values())
    for (kind, _), r in rows.items():
        assert (r["liger_modules"] > 0) == kind.endswith("+liger"), (kind, r["liger_modules"])
        assert len(r["ms_rounds"]) == 3 and r["ms_per_token"] == sorted(r["ms_rounds"])[1]
    sp = {(s["cache"], s["context"]): s for s in report["speedups"]}
    assert set(sp) == {(k, c) for k in ("rolling_absolute+liger", "rolling_streaming") for c in (64, 128, 256)}
    s = sp[("rolling_absolute+liger", 128)]
    best = min(rows[(k, 128)]["ms_per_token"] for k in ("hf_dynamic_sliding", "hf_static_sliding"))
    ours = rows[("rolling_absolute+liger", 128)]["ms_per_token"]
    assert s["speedup_vs_best_hf_sliding"] == pytest.approx(best / ours)
    assert s["speedup_vs_best_hf_sliding_same_model"] == pytest.approx(
        rows[("hf_dynamic_sliding+liger", 128)]["ms_per_token"] / rows[("rolling_absolute+liger", 128)]["ms_per_token"])
    t = report["targets"]
    assert set(t["min_speedup_vs_hf_sliding"]) == {"rolling_absolute+liger", "rolling_streaming"}
    # the profile runs where the rings are full: the first context >= window + sinks (tiny: 64 + 4 -> 128)
    assert {r["context"] for r in report["profile"]} == {128}
    assert all("top_kernels" in r and "top_host_ops" in r for r in report["profile"])
    md = (tmp_path / "rolling_cache.md").read_text()
    assert "vs best HF sliding, same model" in md and "| 1 | 128 | absolute+liger |" in md


def test_unknown_kind_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        rolling_cache.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "x"), "--kinds", "rolling_abs+liger"])
    assert not (tmp_path / "x").exists()


def test_kernels_for_patches_one_kind_and_reverts():
    import argparse

    import torch

    from swift_liger.patching.state import find_states
    args = argparse.Namespace(tiny=True, layers=2, liger=False)
    model = rolling_cache.build_model(rolling_cache.model_config(args), torch.device("cpu"), torch.float32)
    with rolling_cache.kernels_for("rolling_absolute+graph+liger", model, args) as k:
        assert k.modules > 0 and find_states(model)
    assert not find_states(model)
    with rolling_cache.kernels_for("hf_dynamic_sliding", model, args) as k:
        assert k.modules == 0 and not find_states(model)
    assert rolling_cache.split_kind("rolling_absolute+graph+liger") == ("rolling_absolute+graph", True)


def test_merge_runs_of_separate_calls(tmp_path):
    common = ["--tiny", "--device", "cpu", "--steps", "2", "--kinds", "rolling_absolute,hf_dynamic_sliding",
              "--long-kinds", "", "--no-agreement", "--no-hybrid"]
    rolling_cache.main(common + ["--out", str(tmp_path / "a"), "--batches", "1"])
    rolling_cache.main(common + ["--out", str(tmp_path / "b"), "--batches", "2"])
    assert rolling_cache.main(["--merge", str(tmp_path / "a" / "rolling_cache.json"),
                               str(tmp_path / "b" / "rolling_cache.json"), "--out", str(tmp_path / "m")]) == 0
    report = json.loads((tmp_path / "m" / "rolling_cache.json").read_text())
    assert len(report["matched_context"]) == 2 * 3 + 2 * 3
    assert {(s["batch"], s["context"]) for s in report["speedups"]} == {(b, c) for b in (1, 2) for c in (64, 128, 256)}
    assert report["settings"]["batches"] == [1, 2]
    assert "rolling_absolute" in report["targets"]["min_speedup_vs_hf_sliding"]
    md = (tmp_path / "m" / "rolling_cache.md").read_text()
    assert md.count("- command: `") == 2 and "| 2 | 256 | absolute |" in md
    assert "8 x 1 / 8 x 1 (steps x rounds per command)" in md   # --tiny: 8 steps
    # the summary: one row per cache, one column per batch, over the contexts past the window (tiny: 64 + 4)
    head = md[md.index("## Summary: ms/token past the window (contexts >= 68"):]
    head = head[:head.index("\n## ")]
    assert "| cache | batch 1 | batch 2 |" in head and head.count("| rolling_absolute | ") == 1
    with pytest.raises(SystemExit, match="--merge: no such file"):
        rolling_cache.main(["--merge", str(tmp_path / "nope.json"), "--out", str(tmp_path / "m2")])


def test_fused_projections_in_the_liger_kinds(tmp_path):
    rolling_cache.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "1", "--fused-projections",
                        "--kinds", "rolling_absolute+liger,hf_dynamic_sliding", "--long-kinds", "", "--no-agreement",
                        "--no-hybrid"])
    report = json.loads((tmp_path / "rolling_cache.json").read_text())
    mods = {r["cache"]: r["liger_modules"] for r in report["matched_context"]}
    # tiny: 2 layers -> rms_norm 5, rope 2, swiglu 2, fused_projections 2 x 2
    assert mods == {"rolling_absolute+liger": 5 + 2 + 2 + 4, "hf_dynamic_sliding": 0}
    assert "fused_projections" in report["model"]
