"""End-to-end: `swift sft` with per-token loss weights (a non-binary `--loss_scale`, `--enable_dft_loss`,
`--enable_channel_loss`) or `--label_smoothing_factor` on the tiny offline model, patched (--use_liger: losses from
hidden states, preference.SFTSeam) against unpatched, 4 optimizer steps of 2 micro-batches. Every logged metric must
agree except timing (token_acc included: the patched run takes it from the fused head's arg max); the probe
(probe/sitecustomize.py) counts the [rows, V] logits any lm_head materialised. The loss_scale and smoothing runs
execute the real Triton kernels in the interpreter, the other two the CPU reference backend.
"""
from __future__ import annotations

import json

import pytest

from swift_runner import CPU_FLAGS, compare_metrics, model_vocab, paired_specs, run_probed

pytestmark = pytest.mark.slow

STEPS = 4
NOT_COMPARED = {"step_time(s)", "tokens/s", "rss(GiB)", "elapsed_time", "remaining_time", "train_speed(s/it)",
                "memory(GiB)", "global_step/max_steps"}
CASES = {   # name: (flags, backend of the patched run)
    "loss_scale": (["--loss_scale", "react"], "triton"),
    "dft": (["--enable_dft_loss", "true"], "torch"),
    "channel": (["--enable_channel_loss", "true"], "torch"),
    "smoothing": (["--label_smoothing_factor", "0.1"], "triton"),
}


def _react_rows(n: int) -> list:
    """Chat rows whose answers carry ReAct keywords (loss_scale react weights "Action:" 2.0), in two channels."""
    rows = []
    for i in range(n):
        answer = f"Thought: {i % 4}\nAction: go\nAction Input: {i % 7}\nFinal Answer: {i * 3 % 11}"
        rows.append({"messages": [{"role": "user", "content": f"{i} + {i % 5}?"},
                                  {"role": "assistant", "content": answer}],
                     "channel": "math" if i % 2 else "chat"})
    return rows


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_weight_runs")
    data = root / "react.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _react_rows(64)))
    base_argv = [*tiny_qwen3["swift_flags"], "--dataset", str(data), "--tuner_type", "lora", *CPU_FLAGS,
                 "--per_device_train_batch_size", "1", "--max_length", "96", "--gradient_accumulation_steps", "2",
                 "--max_steps", str(STEPS), "--report_to", "none", "--save_strategy", "no", "--learning_rate", "1e-3"]
    cases = {name: (base_argv + flags, backend) for name, (flags, backend) in CASES.items()}
    return run_probed("sft", paired_specs(cases, root, model_vocab(tiny_qwen3["model"])), root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_metric_matches_unpatched(runs, case):
    base, liger = runs[f"{case}_base"].check().steps(), runs[f"{case}_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    compared = compare_metrics(base, liger, NOT_COMPARED)
    assert {"loss", "grad_norm", "token_acc"} <= compared, compared   # token_acc: the fused head's arg max
    if case == "channel":   # ms-swift's per-channel losses, from our per-token losses
        assert {"loss_math", "loss_chat"} <= compared, compared
    assert base[0]["loss"] != base[-1]["loss"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_logits_materialised_and_the_record_says_so(runs, case):
    base, liger = runs[f"{case}_base"].check(), runs[f"{case}_liger"].check()
    assert base.probe["lm_head_logits"] > 0, base.probe
    assert liger.probe["processes"] >= 1 and liger.probe["lm_head_logits"] == 0, liger.probe
    record = liger.patch_record()
    assert record["config"]["cross_entropy"] == "fused_linear"
    passes = record["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] == 2 * STEPS and passes["logits"] == 0, passes
    assert "Seq2SeqTrainer took 2 log-prob passes from hidden states" in liger.log
