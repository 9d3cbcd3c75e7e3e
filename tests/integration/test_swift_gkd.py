"""End-to-end: `swift rlhf --rlhf_type gkd` (distillation from a teacher model) on the tiny offline models: the
qwen3-shaped student learns from the llama-shaped teacher (the same tokenizer), 4 optimizer steps of 2 micro-batches.
With --use_liger the generalized JSD comes from both models' hidden states (preference.GKDSeam,
ops.fused_linear_jsd): every logged metric must equal the unpatched run's, and no lm_head materialises [rows,
positions, V] logits in training (the probe of test_swift_rlhf.py counts them in every process; the one-position
heads of on-policy generation's decode steps are left out).

Cases: LoRA JSD (beta 0.5, temperature 0.9) through the real Triton kernels in the interpreter; full fine-tuning
with forward KL (beta 0) plus the student's own loss (sft_alpha 0.5); reverse KL (beta 1) on the student's own
generations (lmbda 1: ms-swift's pt engine generates on CPU, logits there are the decoder's) on the CPU reference
backend (SWIFT_LIGER_BACKEND=torch); top-k distillation (--gkd_logits_topk 8: the divergence over the teacher's 8
largest logits per token) on the reference backend; a teacher served by API (--teacher_model_server: the same
tiny teacher behind teacher_server.py's HTTP routes, the top-k log-probs of every position arriving with the batch)
through the real kernels; self-distillation without a teacher model (the student itself, detached, scores each
row's teacher_prompt in place of the user turn: OPSD) and rows on-policy with probability 0.5 (--lmbda 0.5) on the
reference backend.
"""
from __future__ import annotations

import json

import pytest

from swift_runner import CPU_FLAGS, compare_metrics, model_vocab, paired_specs, run_probed

pytestmark = pytest.mark.slow

STEPS = 4
NOT_COMPARED = {"step_time(s)", "tokens/s", "rss(GiB)", "elapsed_time", "remaining_time", "train_speed(s/it)",
                "memory(GiB)", "global_step/max_steps", "peak_alloc(GiB)", "peak_reserved(GiB)", "step_time"}
# name: (flags, backend of the patched run)
CASES = {
    "jsd_lora": (["--tuner_type", "lora", "--beta", "0.5", "--temperature", "0.9", "--lmbda", "0"], "triton"),
    "fkl_full_sft": (["--tuner_type", "full", "--beta", "0", "--sft_alpha", "0.5", "--lmbda", "0"], "torch"),
    "rkl_on_policy": (["--tuner_type", "lora", "--beta", "1", "--lmbda", "1", "--max_completion_length", "8"],
                      "torch"),
    "topk_lora": (["--tuner_type", "lora", "--beta", "0.5", "--gkd_logits_topk", "8", "--lmbda", "0"], "torch"),
    "api_topk_lora": (["--tuner_type", "lora", "--beta", "0.5", "--gkd_logits_topk", "8", "--lmbda", "0"], "triton"),
    # no teacher: ms-swift distils from the student itself (teacher = student), which sees each row's teacher_prompt
    # in place of the user turn (OPSD); on the same prompt the two would be equal, the divergence and its gradient 0
    "self_opsd_lora": (["--tuner_type", "lora", "--beta", "0.5", "--lmbda", "0"], "torch"),
    # each step on the student's own generations with probability 0.5, else on the dataset's responses
    "mixed_on_policy": (["--tuner_type", "lora", "--beta", "0.5", "--lmbda", "0.5", "--max_completion_length", "8"],
                        "torch"),
}
@pytest.fixture(scope="module")
def runs(tiny_qwen3, tiny_llama, teacher_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd_runs")
    base = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], *CPU_FLAGS, "--rlhf_type", "gkd",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_length", "64",
            "--max_steps", str(STEPS), "--report_to", "none", "--learning_rate", "1e-4", "--save_strategy", "no",
            "--use_vllm", "false"]
    url, plugin, _ = teacher_server
    teacher = {"local": ["--teacher_model", tiny_llama["model"], "--teacher_model_type", "llama"],
               "api": ["--teacher_model_server", url, "--external_plugins", plugin], "self": []}
    cases = {name: (base + teacher[name.split("_")[0] if name.startswith(("api", "self")) else "local"] + flags,
                    backend) for name, (flags, backend) in CASES.items()}
    opsd = root / "opsd.jsonl"   # the same rows, each with a longer prompt for the teacher
    with open(tiny_qwen3["sft"]) as src, open(opsd, "w") as dst:
        for line in src:
            row = json.loads(line)
            user = next(m["content"] for m in row["messages"] if m["role"] == "user")
            dst.write(json.dumps({**row, "teacher_prompt": "Answer as an expert would. " + user}) + "\n")
    argv = cases["self_opsd_lora"][0]
    argv[argv.index(tiny_qwen3["sft"])] = str(opsd)
    # heads over completions count; the one-position decode steps of on-policy rows do not
    return run_probed("rlhf", paired_specs(cases, root, model_vocab(tiny_qwen3["model"]), min_positions=2), root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_metric_matches_unpatched(runs, case):
    base, liger = runs[f"{case}_base"].check().steps(), runs[f"{case}_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    compared = compare_metrics(base, liger, NOT_COMPARED)
    assert {"loss", "grad_norm", "epoch"} <= compared, compared
    assert base[0]["loss"] != base[-1]["loss"]   # it trained


@pytest.mark.parametrize("case", sorted(CASES))
def test_divergence_from_hidden_states_and_the_record_says_so(runs, case):
    base, liger = runs[f"{case}_base"].check(), runs[f"{case}_liger"].check()
    total = liger.patch_record()["runtime"]["total"]
    passes = total["trainer"]["log_prob_passes"]
    assert passes["fused_linear_jsd"] == 2 * STEPS and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert total["policy"]["fused_linear_jsd"] == 2 * STEPS, total["policy"]
    assert total["policy"]["fused_linear_cross_entropy"] == (2 * STEPS if "sft" in case else 0), total["policy"]
    assert "in the first step GKDTrainer computed 2 distillation losses (generalized JSD) from hidden states (the " \
           "student's; the teacher's, or its top-k log-probs when served by API; no [tokens, vocab] logits) and 0 " \
           "from materialised logits" in liger.log
    if case.startswith("self"):   # the student is its own teacher: no second model
        assert "teacher model:" not in liger.log
    elif case.startswith("api"):   # no teacher model in the process: its top-k log-probs came over HTTP
        assert "the top-k log-probs its teacher server returns" in liger.log
        assert "teacher model:" not in liger.log
        api = total["trainer"]["teacher_api_positions"]   # the server scores all but each row's closing tokens
        assert 0.5 * api["trained"] < api["scored"] < api["trained"], api
        assert "in the first step the teacher server's top-k log-probs covered" in liger.log
        assert "under half" not in liger.log
    else:
        assert "teacher model: cross_entropy=fused_linear for GKD's divergence from its hidden states" in liger.log
    # every case, on-policy ones included: generation samples from one position per row, which the probe leaves out
    assert base.probe["lm_head_logits"] > 0 and liger.probe["lm_head_logits"] == 0, (base.probe, liger.probe)


def test_the_api_teacher_scored_every_micro_batch(runs, teacher_server):
    """Both API runs posted each micro-batch's rows to the server (STEPS steps x 2 micro-batches x 1 row each)."""
    runs["api_topk_lora_base"].check(), runs["api_topk_lora_liger"].check()
    with open(teacher_server[2]) as f:
        assert sum(int(n) for n in f.read().split()) == 2 * STEPS * 2
