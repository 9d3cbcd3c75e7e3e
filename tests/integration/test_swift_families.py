"""End-to-end: `swift sft` LoRA on tiny Gemma-2 (GeGLU, (1 + w) norms, four norms per layer, sliding-window layers,
final-logit softcap through the fused linear CE) and Qwen3-MoE (the experts' fused gate, router logits untouched,
one dense layer) models, stock vs --use_liger with the real Triton kernels in the interpreter, and the long_context
preset on Qwen3 (tiled MLP, offloaded checkpoints, gradient checkpointing on) and save_attention on Qwen3. Seven CLI
runs, two at a time;
Qwen3-MoE with lora_dropout 0 (PEFT's LoRA on the experts' 3-D parameters refuses dropout, patched or not).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_liger.testing import tiny

from swift_runner import CPU_FLAGS, run_swift

pytestmark = pytest.mark.slow

STEPS = 4
SMALL = ["--per_device_train_batch_size", "1", "--max_length", "64", "--learning_rate", "2e-3", "--report_to",
         "none", "--save_strategy", "no", "--max_steps", str(STEPS)]
ARCHS = {"gemma2": [], "qwen3_moe": ["--lora_dropout", "0"]}
# the long_context preset (tiled MLP, offloaded checkpoints) on qwen3, tiles of 16 tokens; dropout 0: tiles draw
# their own masks (tests/fusions/test_tiled_mlp.py)
LONG = ["--gradient_checkpointing", "true", "--lora_dropout", "0"]
LONG_LIGER = ["--liger_config", "long_context", "--liger_tiled_mlp", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_runs")
    specs = {}
    for arch, extra in ARCHS.items():
        info = tiny.build(str(root / f"tiny_{arch}"), arch)
        argv = [*info["swift_flags"], "--dataset", info["sft"], "--tuner_type", "lora", *CPU_FLAGS, *SMALL, *extra]
        specs[(arch, "liger")] = argv + ["--use_liger"]
        specs[(arch, "base")] = argv
    info = tiny.build(str(root / "tiny_qwen3"), "qwen3")
    argv = [*info["swift_flags"], "--dataset", info["sft"], "--tuner_type", "lora", *CPU_FLAGS, *SMALL, *LONG]
    specs[("long", "liger")] = argv + ["--use_liger", *LONG_LIGER]
    specs[("save_attention", "liger")] = argv + ["--use_liger", "--liger_save_attention", "true"]
    specs[("long", "base")] = argv
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run_swift, "sft", argv, str(root / f"{key[0]}_{key[1]}"))
                   for key, argv in specs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_trains_patched_with_the_stock_losses(runs, arch):
    base, liger = runs[(arch, "base")].check(), runs[(arch, "liger")].check()
    b, p = base.steps(), liger.steps()
    assert [r["step"] for r in b] == [r["step"] for r in p] == list(range(1, STEPS + 1))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(b, p)]
    assert max(diffs) <= 1e-4, diffs
    assert b[0]["loss"] != b[-1]["loss"]
    report = liger.patch_record()["models"]["policy"]["report"]
    assert report["model_type"] == arch and report["cross_entropy_mode"] == "fused_linear"
    assert report["patched"]["rms_norm"] > 0 and report["patched"]["rope"] == 2 and report["patched"]["swiglu"] == 2
    assert not [s for s in report["skipped"] if s["problem"]], report["skipped"]
    if arch == "qwen3_moe":
        assert report["patched"]["qk_norm_rope"] == 2
    total = liger.patch_record()["runtime"]["total"]["policy"]
    assert total["fused_linear_cross_entropy"] == STEPS and total["lm_head_logits"] == 0, total


def _same_losses(base, liger):
    """Both runs logged STEPS steps with losses within 1e-4."""
    b, p = base.steps(), liger.steps()
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(b, p)]
    assert len(b) == len(p) == STEPS and max(diffs) <= 1e-4, diffs


def test_long_context_preset_tiles_and_offloads(runs):
    base, liger = runs[("long", "base")].check(), runs[("long", "liger")].check()
    _same_losses(base, liger)
    record = liger.patch_record()
    report = record["models"]["policy"]["report"]
    assert report["patched"]["tiled_mlp"] == 2 and report["patched"]["offload_checkpoints"] == 2, report
    assert record["config"]["tiled_mlp"] == 16 and record["config"]["offload_checkpoints"] is True
    # counted: both layers' inputs went to the host every step, the first layer's came back ahead of its recompute
    first = record["runtime"]["first_step"]["policy"]["offloaded_checkpoints"]
    assert first == {"offloaded": 2, "prefetched": 1, "fetched_late": 1}, first
    assert "offload_checkpoints in the first step: 2 decoder-layer inputs kept on the host" in liger.log


def test_save_attention_keeps_each_layers_attention_output(runs):
    base, liger = runs[("long", "base")].check(), runs[("save_attention", "liger")].check()
    _same_losses(base, liger)
    record = liger.patch_record()
    assert record["models"]["policy"]["report"]["patched"]["save_attention"] == 2
    assert record["runtime"]["first_step"]["policy"]["saved_attention"] == {"kept": 2}
    assert "save_attention in the first step: 2 attention outputs kept in the forward for the recompute" in liger.log
