"""`swift-liger ab`: real `swift sft` runs without and with --use_liger and with one fusion off, one table, a plot."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_ab_runs_stock_liger_and_each_fusion_off(tiny_qwen3, tmp_path, monkeypatch, capsys):
    from swift_liger.cli import main
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")   # the CPU reference: this tests the command, not kernels
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for key in ("SWIFT_LIGER_DISABLE_HOOK", "TENSORBOARD_LOGGING_DIR", "SWIFT_CONFIG_FILE"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "ab"
    swift = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--tuner_type", "lora", "--torch_dtype",
             "float32", "--fp16", "false", "--bf16", "false", "--check_model", "false", "--max_steps", "3",
             "--max_length", "64", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy",
             "no", "--dataloader_num_workers", "0", "--logging_steps", "1", "--gradient_accumulation_steps", "1",
             "--seed", "42"]
    assert main(["ab", "--out", str(out), "--each", "--fusions", "swiglu", "--", *swift]) == 0
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[0] for ln in lines[1:]] == ["| stock", "| --use_liger", "| --use_liger, swiglu off"]
    for line in lines[2:]:   # the patched runs train like the stock one
        assert float(line.rstrip(" |").rsplit("| ", 1)[1]) <= 1e-4, line
    assert os.path.getsize(out / "ab.png") > 10_000
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["no_swiglu", "stock", "use_liger"]


@pytest.mark.parametrize("argv, message", [
    (["ab", "--", "--model", "m", "--use_liger"], "--use_liger is set by ab itself"),
    (["ab", "--", "--model", "m", "--output_dir", "x"], "give the parent directory with --out"),
    (["ab", "--fusions", "warp", "--", "--model", "m"], None),
])
def test_ab_refuses_what_it_sets_itself(argv, message, capsys):
    from swift_liger.cli import main
    if message is None:
        assert main(argv) == 2 and "--fusions: unknown warp" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit, match=message):
        main(argv)
