"""End-to-end: the real `swift sft` CLI on the tiny offline models, patched runs executing the real Triton kernels
in Triton's interpreter. Seven CLI runs in all, two at a time, shared by the tests below (`swift rlhf`:
test_swift_rlhf.py).
"""
from __future__ import annotations

import glob
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_liger.config import LigerConfig

from swift_runner import CPU_FLAGS, run_swift, swift_env

pytestmark = pytest.mark.slow

FUSIONS = ("rms_norm", "rope", "qk_norm_rope", "swiglu", "cross_entropy")
METRIC_KEYS = ("step_time(s)", "tokens/s", "rss(GiB)")
STEPS = 10
# batch 1 x <=64 tokens keeps the interpreter (~1 ms per Triton program) at a few seconds per step
SMALL = ["--per_device_train_batch_size", "1", "--max_length", "64"]
PAIRS = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--report_to", "none", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("swift_runs")
    sft = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--tuner_type", "lora", *CPU_FLAGS, *SMALL,
           "--learning_rate", "2e-3"]
    bad_preset = root / "bad_preset.yaml"
    bad_preset.write_text("rms_norm: true\nfused_everything: true\n")
    yaml_cfg = root / "minimal_plus_swiglu.yaml"
    yaml_cfg.write_text("use_liger: true\nliger_config: minimal\nliger_swiglu: true\n")
    specs = {  # longest first: the two patched multi-step runs
        "liger": ("sft", sft + ["--max_steps", str(STEPS), "--use_liger", "--report_to", "tensorboard",
                                "--save_strategy", "steps", "--save_steps", str(STEPS), "--save_only_model", "true"]),
        "base": ("sft", sft + ["--max_steps", str(STEPS), "--report_to", "none", "--save_strategy", "no"]),
        "yaml": ("sft", [str(yaml_cfg), *sft, "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
                         "--liger_metrics", "false"]),
        "kernel_clash": ("sft", sft + ["--max_steps", "1", "--use_liger", "--use_liger_kernel", "true"]),
        "bad_preset": ("sft", sft + ["--max_steps", "1", "--use_liger", "--liger_config", str(bad_preset)]),
        # two rows per batch: right padding, which drop_pad_mask (on under --use_liger) runs without the mask
        "padded": ("sft", sft + [*PAIRS, "--use_liger"], swift_env(SWIFT_LIGER_PROFILE_FIRST_STEP="6")),
        "padded_base": ("sft", sft + [*PAIRS]),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, spec[0], spec[1], str(root / name), *spec[2:])
                   for name, spec in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_patched_losses_match_unpatched(runs):
    base, liger = runs["base"].check().steps(), runs["liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base, liger)]
    assert max(diffs) <= 1e-5, diffs
    assert base[0]["loss"] != base[-1]["loss"]  # it trained


def test_patch_record_log_and_metrics(runs):
    liger = runs["liger"].check()
    record = liger.patch_record()
    assert record["config"] == LigerConfig(drop_pad_mask=True).to_dict() and record["notes"] == []
    assert record["backend"] == {"SWIFT_LIGER_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    report = record["models"]["policy"]["report"]
    assert all(report["patched"][f] > 0 for f in FUSIONS), report
    assert report["cross_entropy_mode"] == "fused_linear" and set(record["models"]) == {"policy"}
    # counted, not configured: the fused linear CE ran every micro-batch, no lm_head logits were materialised
    total = record["runtime"]["total"]["policy"]
    assert total["fused_linear_cross_entropy"] == STEPS and total["lm_head_logits"] == 0, total
    assert total["cross_entropy"] == total["fused_linear_logprobs"] == 0, total
    assert liger.log.count("swift_liger: patched the policy model") == 1
    # lora_fusion (on by default) took every LoRA projection call of the first step
    fusion = re.search(r"lora_fusion in the first step: (\d+) LoRA projection calls through ops.lora_linear, "
                       r"(\d+) through PEFT", liger.log)
    assert fusion and int(fusion.group(1)) > 0 and fusion.group(2) == "0", fusion
    with open(os.path.join(liger.run_dir, "args.json")) as f:
        args = json.load(f)
    assert args["use_liger"] is True and args["use_liger_kernel"] is False

    for name in ("base", "liger"):  # metrics with and without --use_liger: fair comparison
        for row in runs[name].steps():
            assert all(isinstance(row.get(k), float) and row[k] > 0 for k in METRIC_KEYS), (name, row)
            assert "peak_alloc(GiB)" not in row and "MFU" not in row  # CPU: no CUDA numbers, never made up
            # non-padding tokens of one micro-batch (batch 1, max_length 64)
            assert 0 < row["tokens/s"] * row["step_time(s)"] <= 64 * 1.01, row
    # fused_linear returns no logits in training: token_acc comes from the fused head's arg max (SFTSeam), the same
    # metric ms-swift computes from the stock run's logits
    base_acc = [r["token_acc"] for r in runs["base"].steps()]
    liger_acc = [r["token_acc"] for r in runs["liger"].steps()]
    assert len(base_acc) == len(liger_acc) == STEPS and any(a > 0 for a in base_acc), base_acc
    assert all(abs(a - b) <= 1e-6 for a, b in zip(base_acc, liger_acc)), (base_acc, liger_acc)


def test_right_padded_pairs_match_unpatched_without_their_masks(runs):
    """Batches of two rows of different lengths: --use_liger drops the right-padding masks (counted) and logs the
    losses and token accuracy of the stock run, whose layers keep the masks. The run also profiles its first step."""
    base, liger = runs["padded_base"].check().steps(), runs["padded"].check().steps()
    assert len(base) == len(liger) == 3
    for a, b in zip(base, liger):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["token_acc"] - b["token_acc"]) <= 1e-6, (a, b)
    runtime = runs["padded"].patch_record()["runtime"]
    total = runtime["total"]["policy"]
    assert total["pad_masks"]["dropped"] >= 1 and total["pad_masks"]["kept"] == 0, total["pad_masks"]
    # SWIFT_LIGER_PROFILE_FIRST_STEP=6 on this run: the first step's cProfile, in the record and the log
    profile = runtime["first_step"]["profile"]
    assert len(profile["cumulative"]) == len(profile["own"]) == 6 and profile["total_s"] > 0, profile
    assert "swift_liger: first-step profile (SWIFT_LIGER_PROFILE_FIRST_STEP" in runs["padded"].log


def test_liger_metrics_false_is_obeyed_under_use_liger(runs):
    """--liger_metrics false turns the per-step metrics off with --use_liger too (the yaml run: use_liger in YAML)."""
    rows = runs["yaml"].check().steps()
    assert rows and all("loss" in r for r in rows)
    assert not any(k in r for r in rows for k in (*METRIC_KEYS, "peak_alloc(GiB)", "MFU")), rows


def test_metrics_reach_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = glob.glob(os.path.join(runs["liger"].run_dir, "runs", "**", "events.out.tfevents.*"), recursive=True)
    assert events, "no TensorBoard event file"
    tags = set()
    for path in events:
        acc = EventAccumulator(path)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/tokens/s", "train/step_time(s)", "train/loss"} <= tags, tags


def test_adapter_from_patched_run_loads_into_unpatched_model(runs, tiny_qwen3):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import swift_liger

    (ckpt,) = glob.glob(os.path.join(runs["liger"].check().run_dir, f"checkpoint-{STEPS}"))
    keys = load_file(os.path.join(ckpt, "adapter_model.safetensors")).keys()
    assert keys and all("lora_" in k and "liger" not in k for k in keys)

    ids = torch.tensor([[5, 17, 200, 33, 1024, 7, 99, 400, 12, 3, 800, 61]])
    logits = []
    for patch in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3["model"], dtype=torch.float32)
        if patch:
            swift_liger.apply(model)  # the patched training-time model, for reference
        model = PeftModel.from_pretrained(model, ckpt).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    unpatched, patched = logits
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen3["model"]), ckpt)
    assert any(float(p.abs().max()) > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # not a no-op
    torch.testing.assert_close(unpatched, patched, atol=1e-5, rtol=1e-5)


def test_yaml_config_switches_exactly_the_configured_fusions(runs):
    yaml_run = runs["yaml"].check()
    record = yaml_run.patch_record()
    expected = LigerConfig(rms_norm=True, rope=True, swiglu=True, qk_norm_rope=False, cross_entropy="off",
                           lora_fusion=False, graph_layers=False)     # the minimal preset turns these off
    assert record["config"] == expected.to_dict()
    patched = record["models"]["policy"]["report"]["patched"]
    assert {f for f in FUSIONS if patched[f] > 0} == {"rms_norm", "rope", "swiglu"}, patched
    assert all("token_acc" in r for r in yaml_run.steps())  # cross_entropy off: logits stay


@pytest.mark.parametrize("name, message", [
    ("kernel_clash", "--use_liger (swift_liger's Triton kernels) and --use_liger_kernel"),
    ("bad_preset", "unknown swift_liger config key(s): fused_everything"),
])
def test_bad_flags_fail_before_the_model_loads(runs, name, message):
    run = runs[name]
    assert run.returncode != 0
    assert message in run.log
    assert "model_info" not in run.log and "Loading weights" not in run.log  # failed while parsing arguments
    assert run.seconds < 120


def test_plot_overlays_two_runs(runs, tmp_path):
    from swift_liger.cli import main
    out = tmp_path / "cmp.png"
    assert main(["plot", runs["base"].output_dir, runs["liger"].output_dir, "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000
