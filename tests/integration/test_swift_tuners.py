"""Tuners beside plain LoRA, end to end on the tiny Llama on CPU (fp32 compute), each with and without --use_liger:
- QLoRA, `swift sft --quant_method bnb --quant_bits 4` (NF4, double quant): every LoRA projection of the patched run
  goes through ops.lora_linear over the 4-bit base; losses, every logged metric and the saved adapter equal stock's.
- GaLore (`--tuner_type full --use_galore true`) and DoRA (`--use_dora true`, which runs PEFT's forward beside our
  other fusions): the same losses as stock."""
from __future__ import annotations

import glob
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_runner import CPU_FLAGS, run_swift

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.slow

STEPS = 6
SKIP_METRICS = {"step_time(s)", "tokens/s", "rss(GiB)", "elapsed_time", "remaining_time", "train_speed(s/it)",
                "global_step/max_steps", "memory(GiB)"}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora_runs")
    argv = [*tiny_llama["swift_flags"], "--dataset", tiny_llama["sft"], "--tuner_type", "lora", *CPU_FLAGS,
            "--per_device_train_batch_size", "2", "--max_length", "64", "--learning_rate", "2e-3",
            "--quant_method", "bnb", "--quant_bits", "4", "--bnb_4bit_quant_type", "nf4",
            "--bnb_4bit_use_double_quant", "true", "--target_modules", "all-linear", "--lora_dropout", "0.1",
            "--max_steps", str(STEPS), "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS),
            "--save_only_model", "true"]
    short = [*tiny_llama["swift_flags"], "--dataset", tiny_llama["sft"], *CPU_FLAGS, "--per_device_train_batch_size",
             "2", "--max_length", "64", "--learning_rate", "2e-3", "--max_steps", "3", "--report_to", "none",
             "--save_strategy", "no"]
    galore = short + ["--tuner_type", "full", "--use_galore", "true", "--galore_rank", "4",
                      "--galore_update_proj_gap", "2"]
    dora = short + ["--tuner_type", "lora", "--use_dora", "true", "--target_modules", "all-linear"]
    specs = {"base": argv, "liger": argv + ["--use_liger"], "galore_base": galore,
             "galore_liger": galore + ["--use_liger"], "dora_base": dora, "dora_liger": dora + ["--use_liger"]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, "sft", a, str(root / name)) for name, a in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_qlora_losses_and_metrics_match_stock(runs):
    base, liger = runs["base"].check().steps(), runs["liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    for a, b in zip(base, liger):
        for key, value in a.items():
            if key in SKIP_METRICS or not isinstance(value, (int, float)) or key == "token_acc":
                continue
            assert key in b, (key, sorted(b))
            assert abs(value - b[key]) <= 1e-4 * max(1.0, abs(value)), (a["step"], key, value, b[key])
    assert base[0]["loss"] != base[-1]["loss"]


def test_qlora_projections_run_fused_over_the_4bit_base(runs):
    liger = runs["liger"].check()
    for name in ("base", "liger"):
        with open(os.path.join(runs[name].run_dir, "args.json")) as f:
            args = json.load(f)
        assert args["quant_method"] == "bnb" and args["quant_bits"] == 4, name
    fusion = re.search(r"lora_fusion in the first step: (\d+) LoRA projection calls through ops.lora_linear, "
                       r"(\d+) through PEFT", liger.log)
    assert fusion and int(fusion.group(1)) > 0 and fusion.group(2) == "0", fusion
    report = liger.patch_record()["models"]["policy"]["report"]
    assert report["patched"]["swiglu"] > 0 and report["patched"]["rms_norm"] > 0, report


def test_qlora_adapter_equals_the_stock_adapter(runs):
    import torch
    from safetensors.torch import load_file
    saved = []
    for name in ("base", "liger"):
        (ckpt,) = glob.glob(os.path.join(runs[name].check().run_dir, f"checkpoint-{STEPS}"))
        saved.append(load_file(os.path.join(ckpt, "adapter_model.safetensors")))
    base, liger = saved
    assert base.keys() == liger.keys() and all("lora_" in k for k in base)
    for k in base:
        torch.testing.assert_close(liger[k], base[k], atol=2e-5, rtol=2e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("tuner", ["galore", "dora"])
def test_galore_and_dora_train_with_the_other_fusions(runs, tuner):
    base, liger = runs[f"{tuner}_base"].check(), runs[f"{tuner}_liger"].check()
    a, b = base.steps(), liger.steps()
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) <= 1e-5
    report = liger.patch_record()["models"]["policy"]["report"]
    assert report["patched"]["swiglu"] > 0 and report["cross_entropy_mode"] == "fused_linear", report
    if tuner == "dora":   # DoRA's projections: PEFT's own forward, said in the log
        assert re.search(r"lora_fusion in the first step: 0 LoRA projection calls through ops.lora_linear, [1-9]",
                         liger.log)
