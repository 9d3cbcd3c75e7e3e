"""The FP8-base accuracy benchmark end to end on CPU, on a small slice of the stdlib corpus: pretraining, both LoRA
arms (bf16 base, FP8 base through torch's CPU _scaled_mm), the JSON, markdown and plot written."""
import json
import math

import torch

from swift_liger.bench import fp8_accuracy


def test_quick_run_writes_both_arms(tmp_path, monkeypatch):
    for name, value in (("SWIFT_LIGER_FP8_EMULATE", "1"), ("SWIFT_LIGER_BACKEND", "torch"), ("RAYON_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)                # main sets these on CPU; monkeypatch restores them after
    threads = torch.get_num_threads()
    try:
        fp8_accuracy.main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--max-files", "20",
                           "--pretrain-steps", "10", "--lora-steps", "4", "--eval-every", "2", "--eval-windows", "4",
                           "--batch", "4", "--seq", "64", "--vocab", "512", "--layers", "2"])
    finally:
        torch.set_num_threads(threads)
    r = json.loads((tmp_path / "fp8_accuracy.json").read_text())
    assert set(r["arms"]) == {"bf16", "fp8"}
    assert r["arms"]["fp8"]["fp8_record"]["fp8_weights"] == 7 * r["config"]["layers"] == 14
    assert r["arms"]["fp8"]["fp8_record"]["kept_16bit"] == {}
    assert r["adapters_identical_at_start"]
    for arm in r["arms"].values():
        assert arm["eval_step"] == [0, 2, 4] and len(arm["train_loss"]) == 4
        assert all(math.isfinite(x) for x in arm["eval_loss"] + arm["train_loss"])
    # the FP8 base changes the numbers (it ran), by little
    assert r["arms"]["fp8"]["eval_loss"][0] != r["arms"]["bf16"]["eval_loss"][0]
    assert math.isfinite(r["rel_diff"]) and abs(r["rel_diff"]) < 0.05
    assert r["pretrain"]["eval_loss"][-1] < r["pretrain"]["eval_loss"][0]
    assert all(r["corpus"][p]["files"] == 20 and r["corpus"][p]["tokens"] > 0
               for p in ("pretrain", "lora_train", "lora_eval"))
    assert "--quick" in r["environment"]["command"]
    assert "within 1%" in (tmp_path / "fp8_accuracy.md").read_text()
