"""The long-context benchmark runs its whole pipeline on CPU: the parent sweep in-process, every (variant, length,
batch) point in its own `python -m swift_liger.bench.long_context --one ...` subprocess, JSON and markdown written
after every point, and plain vs long_context (tiled MLP over 16-token tiles + offloaded checkpoints) train the same
losses from the same seed and batches. A --batches sweep runs [b, seq] batches at one length, and --tuner qlora
trains LoRA over a bitsandbytes NF4 base (quantized on CPU too)."""
import json
import math

import pytest

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
        assert r["layers"] == 2 and r["batch"] == 1 and len(r["losses"]) == 2   # 1 warm-up + 1 measured
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



def test_long_context_bench_batch_sweep_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    long_context.main(["--model", "tiny", "--device", "cpu", "--seqs", "32", "--batches", "1,2", "--variants", "plain",
                       "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])

    data = json.loads((tmp_path / "long_context.json").read_text())
    rows = data["rows"]
    assert [(r["variant"], r["seq"], r["batch"]) for r in rows] == [("plain", 32, 1), ("plain", 32, 2)]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isclose(r["tokens_per_s"] * r["seconds_per_step"], 32 * r["batch"], rel_tol=1e-6), r
    assert data["setup"]["batches"] == [1, 2]
    assert data["largest_batch"] == {"plain": {"batch": 2, "stopped_by": None}} and "longest" not in data

    md = (tmp_path / "long_context.md").read_text()
    assert md.startswith("# Largest batch at 32: tiny lora")
    assert "largest batch at 32: plain 2" in md and "batch 1/2," in md
    assert "| seq | batch |" in md and "\n| 32 | 1 |" in md and "\n| 32 | 2 |" in md


def test_long_context_batches_share_the_first_row():
    one = long_context.make_batches(2, 32, 256, "cpu")
    four = long_context.make_batches(2, 32, 256, "cpu", 4)
    assert [tuple(b.shape) for b in four] == [(4, 32), (4, 32)]
    assert all((a[0] == b[0]).all() for a, b in zip(one, four))


def test_long_context_bench_qlora_cpu(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    long_context.main(["--model", "tiny", "--device", "cpu", "--seqs", "32", "--variants", "plain,swift_liger",
                       "--tuner", "qlora", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])

    data = json.loads((tmp_path / "long_context.json").read_text())
    plain, ours = data["rows"]
    lora = long_context.run_point("plain", 32, shape=long_context.MODELS["tiny"], layers=2, steps=1, warmup=0,
                                  tuner="lora", device="cpu", dtype_name="fp32", mem_fraction=None,
                                  mem_cap_gib=None, tiled_mlp=8192)
    assert lora["status"] == "ok", lora
    for r in (plain, ours):
        assert r["status"] == "ok", r
        assert r["quantized_linears"] == 14   # 7 linears x 2 layers; lm_head stays full precision
        assert len(r["losses"]) == 1 and all(math.isfinite(x) for x in r["losses"]), r
        assert r["trainable_params"] == lora["trainable_params"]   # same r on the same linears
    assert abs(plain["losses"][0] - ours["losses"][0]) < 1e-4, (plain, ours)
    assert ours["call_counts"]["lora_fused"] > 0 and ours["call_counts"]["lora_peft"] == 0   # bnb bases fused
    assert data["setup"]["qlora"]["quant_type"] == "nf4" and data["environment"]["bitsandbytes"]
    assert "QLoRA: NF4 double-quant base (bitsandbytes), LoRA r=16" in (tmp_path / "long_context.md").read_text()


def test_long_context_bench_fp8_base_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    monkeypatch.setenv("SWIFT_LIGER_FP8_EMULATE", "1")   # torch's CPU FP8 GEMM stands in for the GPU's
    long_context.main(["--model", "tiny", "--device", "cpu", "--dtype", "bf16", "--seqs", "32", "--variants",
                       "swift_liger,swift_liger_fp8", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    bf16, fp8 = json.loads((tmp_path / "long_context.json").read_text())["rows"]
    assert bf16["status"] == fp8["status"] == "ok", (bf16, fp8)
    assert fp8["fp8_weights"] == 14 and fp8["fp8_kept_16bit"] == {}   # 7 LoRA bases x 2 layers
    assert "fp8_weights" not in bf16 and fp8["trainable_params"] == bf16["trainable_params"]
    assert abs(fp8["losses"][0] - bf16["losses"][0]) < 0.05 * abs(bf16["losses"][0]), (bf16, fp8)

    monkeypatch.delenv("SWIFT_LIGER_FP8_EMULATE")
    assert "SWIFT_LIGER_FP8_EMULATE=1" in long_context._skip_reason("swift_liger_fp8", "cpu")
    assert "not --tuner qlora" in long_context._skip_reason("swift_liger_fp8", "cpu", "qlora")


@pytest.mark.parametrize("extra, needle", [
    (["--seqs", "32,64", "--batches", "1,2"], "--seqs must have exactly one value"),
    (["--seqs", "32", "--batches", "2,2"], "--batches must be strictly increasing"),
    (["--seqs", "32", "--batches", "4,2"], "--batches must be strictly increasing"),
])
def test_long_context_bench_batches_argparse_errors(tmp_path, capsys, extra, needle):
    with pytest.raises(SystemExit) as exc:
        long_context.main(["--model", "tiny", "--device", "cpu", "--out", str(tmp_path)] + extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "--batches" in err, err
    assert not (tmp_path / "long_context.json").exists()
