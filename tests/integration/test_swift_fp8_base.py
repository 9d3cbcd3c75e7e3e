"""`--liger_fp8_base` through the real `swift sft` / `swift rlhf` CLI on the tiny Qwen3 (bf16 weights; on CPU the
FP8 GEMMs are torch's reference `_scaled_mm`, allowed by SWIFT_LIGER_FP8_EMULATE=1): every LoRA base becomes FP8
after the tuner (logged, counted in the first step), the losses stay within FP8 rounding of the 16-bit `--use_liger`
run, DPO's reference pass (adapters disabled) runs the FP8 base forward and gives the policy's log-probs exactly at
the first step (loss ln 2: both sides multiply by the same FP8 weights), `all` stores a GKD teacher's linears too, and
the saved adapter has the 16-bit run's files, keys, shapes and dtypes."""
from __future__ import annotations

import glob
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_runner import run_swift, swift_env

pytestmark = pytest.mark.slow

STEPS = 4
LAYERS = 2          # swift_liger.testing.tiny
BF16 = ["--torch_dtype", "bfloat16", "--fp16", "false", "--bf16", "false", "--check_model", "false",
        "--gradient_accumulation_steps", "1", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
        "--logging_steps", "1", "--seed", "42", "--report_to", "none", "--per_device_train_batch_size", "2",
        "--max_length", "64", "--learning_rate", "2e-3", "--tuner_type", "lora", "--target_modules", "all-linear",
        "--max_steps", str(STEPS)]


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_runs")
    sft = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], *BF16, "--save_strategy", "steps",
           "--save_steps", str(STEPS), "--save_only_model", "true", "--use_liger"]
    dpo = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["pref"], *BF16, "--rlhf_type", "dpo",
           "--save_strategy", "no", "--use_liger"]
    gkd = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], *BF16, "--rlhf_type", "gkd",
           "--teacher_model", tiny_llama["model"], "--teacher_model_type", "llama", "--lmbda", "0",
           "--use_vllm", "false", "--save_strategy", "no", "--use_liger", "--liger_fp8_base", "all"]
    fp8 = ["--liger_fp8_base", "true"]
    specs = {"sft": ("sft", sft), "sft_fp8": ("sft", sft + fp8), "dpo_fp8": ("rlhf", dpo + fp8),
             "gkd_fp8_all": ("rlhf", gkd)}
    env = swift_env(SWIFT_LIGER_FP8_EMULATE="1")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, cmd, argv, str(root / name), env) for name, (cmd, argv) in
                   specs.items()}
        return {name: f.result().check() for name, f in futures.items()}


def first_step(run) -> dict:
    return run.patch_record()["runtime"]["first_step"]["policy"]


def test_sft_fp8_bases_train_within_fp8_rounding_of_16bit(runs):
    ref, fp8 = runs["sft"], runs["sft_fp8"]
    n = 7 * LAYERS
    assert re.search(rf"fp8_base: the policy model's {n} LoRA base weights in FP8 e4m3 \(.* -> .* on the device",
                     fp8.log), fp8.log[-3000:]
    assert f"fp8_base in the first step: {n} frozen weights in FP8" in fp8.log
    assert "LoRA base weights in FP8" not in ref.log and "fp8_base in the first step" not in ref.log
    counts = first_step(fp8)
    assert (counts["fp8_weights"], counts["lora_fused"], counts["lora_peft"], counts["fp8_base_calls"]) == (n, 2 * n,
                                                                                                           0, 0)
    a, b = ref.steps(), fp8.steps()
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 0.01 * max(1.0, abs(x["loss"])), (x["step"], x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 0.05 * x["grad_norm"], (x["step"], x["grad_norm"], y)


def test_dpo_reference_pass_runs_the_fp8_base_forward(runs):
    run = runs["dpo_fp8"]
    n = 7 * LAYERS
    counts = first_step(run)
    # the policy pass through ops.lora_linear, the reference pass (adapters disabled) through PEFT -> FP8 base forward
    assert (counts["fp8_weights"], counts["lora_fused"], counts["lora_peft"], counts["fp8_base_calls"]) == (n, 2 * n,
                                                                                                           n, n)
    steps = run.steps()
    assert len(steps) == STEPS and abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[0]["rewards/margins"] == 0
    assert all(math.isfinite(r["loss"]) for r in steps)


def test_saved_adapter_is_what_the_16bit_run_saves(runs):
    from safetensors.torch import load_file
    dirs = [glob.glob(os.path.join(runs[name].run_dir, f"checkpoint-{STEPS}"))[0] for name in ("sft", "sft_fp8")]
    assert sorted(os.listdir(dirs[0])) == sorted(os.listdir(dirs[1]))
    a, b = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in dirs)
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    configs = []
    for d in dirs:
        with open(os.path.join(d, "adapter_config.json")) as f:
            configs.append(json.load(f))
            configs[-1]["target_modules"] = sorted(configs[-1]["target_modules"])   # saved from a set
    assert configs[0] == configs[1]


def test_gkd_all_stores_the_teacher_in_fp8_too(runs):
    """`--liger_fp8_base all` in GKD: the student's LoRA bases and the teacher's attention and MLP linears (frozen by
    ms-swift as it loads it) in FP8; the divergence still comes from both models' hidden states."""
    run = runs["gkd_fp8_all"]
    n = 7 * LAYERS
    for role in ("policy", "teacher"):
        assert re.search(rf"fp8_base: the {role} model's {n} frozen linear weights in FP8 e4m3", run.log), role
    total = run.patch_record()["runtime"]["total"]
    assert total["trainer"]["log_prob_passes"]["fused_linear_jsd"] == STEPS
    steps = run.steps()
    assert len(steps) == STEPS and all(math.isfinite(r["loss"]) for r in steps)
