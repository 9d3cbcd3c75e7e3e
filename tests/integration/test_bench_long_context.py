"""The long-context benchmark runs its whole pipeline on CPU: the parent sweep in-process, every (variant, length)
point in its own `python -m swift_liger.bench.long_context --one ...` subprocess, JSON and markdown written after
every point, and plain vs long_context (tiled MLP over 16-token tiles + offloaded checkpoints) train the same
losses from the same seed and batches."""
import json

from swift_liger.bench import long_context


def test_long_context_bench_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")   # reference ops: the pipeline, not the kernels, is tested
    # tiles of 16 tokens, so the MLP really runs tiled at 32 and 64 tokens (the default 8192 would not tile)
    long_context.main(["--model", "tiny", "--device", "cpu", "--seqs", "32,64", "--variants", "plain,long_context",
                       "--steps", "1", "--tiled-mlp", "16", "--out", str(tmp_path)])

    data = json.loads((tmp_path / "long_context.json").read_text())
    rows = data["rows"]
    assert [(r["variant"], r["seq"]) for r in rows] == [("plain", 32), ("long_context", 32), ("plain", 64),
                                                        ("long_context", 64)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["layers"] == 2 and len(r["losses"]) == 2   # 1 warm-up + 1 measured
        assert r["tokens_per_s"] > 0 and r["seconds_per_step"] > 0
        assert r["peak_allocated_gib"] is None and r["peak_reserved_gib"] is None   # no memory numbers on CPU
    for seq in (32, 64):
        plain, ours = (next(r for r in rows if r["variant"] == v and r["seq"] == seq)
                       for v in ("plain", "long_context"))
        assert max(abs(a - b) for a, b in zip(plain["losses"], ours["losses"])) < 1e-4, (plain, ours)
        assert "tiled_mlpx2" in ours["patch"] and "offload_checkpointsx2" in ours["patch"], ours["patch"]
        assert ours["call_counts"]["offloaded_checkpoints"]["offloaded"] == 4   # 2 layers x 2 steps
        assert plain["patch"] is None
    assert data["longest"] == {"plain": {"seq": 64, "stopped_by": None},
                               "long_context": {"seq": 64, "stopped_by": None}}
    assert data["environment"]["command"].startswith("python -m swift_liger.bench.long_context --model tiny")
    assert "projection" not in data   # only with --project-layers

    md = (tmp_path / "long_context.md").read_text()
    assert "longest trained: plain 64, long_context 64" in md
    assert md.count("\n| 32 |") == 2 and md.count("\n| 64 |") == 2
    assert "No plot" in md and not (tmp_path / "long_context.png").exists()
