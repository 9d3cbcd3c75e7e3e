"""End-to-end: `swift rlhf --rlhf_type grpo` on the tiny offline model, generating through ms-swift's pt engine on CPU
(no vLLM) with a length reward, 4 optimizer steps of 2 micro-batches; the CPU reference backend runs the patched
runs (SWIFT_LIGER_BACKEND=torch). With --use_liger the per-token log-probs of policy, old policy and reference come
from hidden states (preference.GRPOSeam): every logged metric must equal the unpatched run's. The step metrics count
the tokens of the generated rows the loss trained on (GRPO's training_step gets prompts only) and the completion
tokens among them. A pair of runs with --log_entropy and --top_entropy_quantile 0.5 asks for entropies too: the
patched one takes them from the same pass of the head (entropy metrics, threshold and the masked loss equal the
unpatched run's). Another pair changes the loss settings ms-swift owns (dr_grpo, epsilon_high, two-sided delta,
sequence-level importance sampling), and a pair per other loss_type (bnpo, dapo with beta 0, cispo, sapo): every
metric equal again, since only the log-probs come from us; with a teacher model (OPD-RL) its log-probs come from
its hidden states too. And `--padding_free true --use_liger` (no flash-attn: our packed-row attention) logs the
padded run's metrics, and rollouts that generate on a RollingKVCache sized per call (--liger_rolling_cache exact)
log the plain run's. With --num_iterations 2 the old policy's log-probs differ from the current ones, so the
importance ratio is off 1 and clipping acts: dr_grpo with a narrow clip range, the rloo and reinforce_plus_plus
advantage estimators (sequence_token importance sampling with rloo), beta 0, and two-turn rollouts from a
multi-turn scheduler; every metric equal again, and the logits probe (heads over two or more positions per row)
counts none in the patched runs.
"""
from __future__ import annotations

import pytest

from swift_runner import CPU_FLAGS, compare_metrics, model_vocab, paired_specs, probed, run_probed, swift_env

pytestmark = pytest.mark.slow

REWARD = '''
from swift.rewards import ORM, orms
from swift.rollout import MultiTurnScheduler, multi_turns


class LengthReward(ORM):
    def __call__(self, completions, **kwargs):
        return [len(c) / 10.0 for c in completions]


orms["length_reward"] = LengthReward


class TwoTurns(MultiTurnScheduler):
    """Multi-turn rollouts: after each first answer the user asks again, and the model answers a second time."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Go on."})
        return {"infer_request": infer_request}


multi_turns["two_turns"] = TwoTurns
'''
GENERATIONS, COMPLETION, BATCH, ACCUM, STEPS = 2, 8, 2, 2, 4


SETTINGS = ["--loss_type", "dr_grpo", "--epsilon_high", "0.28", "--delta", "3.0", "--importance_sampling_level",
            "sequence"]
NOT_COMPARED = {"step_time(s)", "tokens/s", "completion_tokens/s", "rss(GiB)", "elapsed_time", "remaining_time",
                "train_speed(s/it)", "memory(GiB)", "global_step/max_steps", "step_time"}


def grpo_argv(tiny_qwen3, root) -> list:
    plugin = root / "reward.py"
    plugin.write_text(REWARD)
    return [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], *CPU_FLAGS, "--rlhf_type", "grpo",
            "--tuner_type", "lora", "--use_vllm", "false", "--external_plugins", str(plugin),
            "--reward_funcs", "length_reward", "--num_generations", str(GENERATIONS),
            "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps", str(ACCUM),
            "--max_completion_length", str(COMPLETION), "--max_length", "64", "--max_steps", str(STEPS),
            "--report_to", "none", "--save_strategy", "no"]


def liger_env() -> dict:
    env = swift_env(SWIFT_LIGER_BACKEND="torch")
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_runs")
    argv = grpo_argv(tiny_qwen3, root)
    env = liger_env()
    entropy = ["--log_entropy", "true", "--top_entropy_quantile", "0.5"]
    specs = {"base": (argv, swift_env()), "liger": (argv + ["--use_liger"], env),
             "entropy_base": (argv + entropy, swift_env()),
             "entropy_liger": (argv + entropy + ["--use_liger"], env),
             "settings_base": (argv + SETTINGS, swift_env()),
             "settings_liger": (argv + SETTINGS + ["--use_liger"], env),
             # --use_liger picks --attn_impl swift_liger: each batch's rows as one packed row, no padding
             "padding_free_liger": (argv + ["--padding_free", "true", "--use_liger"], env),
             # rollouts generate on a RollingKVCache of each call's prompt + new tokens: exact attention
             "rolling_liger": (argv + ["--use_liger", "--liger_rolling_cache", "exact"], env)}
    return run_probed("rlhf", probed(specs, root, model_vocab(tiny_qwen3["model"]), min_positions=2), root)


def test_every_metric_matches_unpatched(runs):
    base, liger = runs["base"].check().steps(), runs["liger"].check().steps()
    assert [s["step"] for s in base] == [s["step"] for s in liger] == list(range(1, STEPS + 1))
    compared = compare_metrics(base, liger, NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "kl", "completions/mean_length"} <= compared, compared
    # the probe: no [rows, positions, V] logits in the patched run's training passes, the unpatched run's counted
    assert runs["base"].probe["lm_head_logits"] > 0 and runs["liger"].probe["lm_head_logits"] == 0, \
        (runs["base"].probe, runs["liger"].probe)


def test_log_probs_from_hidden_states_and_the_record_says_so(runs):
    liger = runs["liger"].check()
    trainer = liger.patch_record()["runtime"]["total"]["trainer"]
    passes = trainer["log_prob_passes"]
    assert passes["fused_linear_logprobs"] + passes["fused_linear_logprobs_no_grad"] > 0, passes
    assert passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert "GRPOTrainer took" in liger.log and "and 0 from materialised logits" in liger.log


def test_entropies_from_hidden_states_match_unpatched(runs):
    base, liger = runs["entropy_base"].check(), runs["entropy_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "entropy/mean", "entropy/max", "entropy/min", "entropy/threshold"} <= compared, \
        compared
    trainer = liger.patch_record()["runtime"]["total"]["trainer"]
    passes = trainer["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert not trainer["logits_fallback_reasons"], trainer


def test_loss_settings_stay_ms_swifts(runs):
    base, liger = runs["settings_base"].check(), runs["settings_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "kl"} <= compared, compared
    passes = liger.patch_record()["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["logits"] == passes["logits_no_grad"] == 0, passes


def test_padding_free_logs_the_padded_runs_metrics(runs):
    base, run = runs["base"].check(), runs["padding_free_liger"].check()
    compared = compare_metrics(base.steps(), run.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "kl", "completions/mean_length"} <= compared, compared
    assert "--padding_free with --use_liger and no --attn_impl: using --attn_impl swift_liger" in run.log
    runtime = run.patch_record()["runtime"]["total"]
    passes = runtime["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert runtime["attention"]["impl"] == "swift_liger" and runtime["attention"]["varlen"] > 0, runtime


# The other loss_types ms-swift 4.6 trains (grpo and dr_grpo run above), dapo with beta 0 (no reference pass). Its
# real and fipo stop at the first step in the unpatched run too ("OPD-RL (teacher) does not support loss_type"):
# ms-swift 4.6.0 counts every GRPO run without a teacher as dynamic self-distillation.
LOSS_TYPES = {"bnpo": [], "dapo": ["--beta", "0"], "cispo": [], "sapo": []}


@pytest.fixture(scope="module")
def loss_runs(tiny_qwen3, tiny_llama, teacher_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_loss_runs")
    argv = grpo_argv(tiny_qwen3, root)
    cases = {loss_type: ["--loss_type", loss_type, *extra] for loss_type, extra in LOSS_TYPES.items()}
    # OPD-RL: a teacher model's per-token log-probs of the sampled tokens join the advantage
    cases["teacher"] = ["--teacher_model", tiny_llama["model"], "--teacher_model_type", "llama"]
    cases["teacher_api"] = ["--teacher_model_server", teacher_server[0]]   # the same teacher, served by HTTP
    specs = {}
    for name, extra in cases.items():
        run_argv = list(argv)
        if name == "teacher_api":   # the client plugin beside the reward plugin
            at = run_argv.index("--external_plugins") + 2
            run_argv[at:at] = [teacher_server[1]]
        specs[f"{name}_base"] = (run_argv + extra, swift_env())
        specs[f"{name}_liger"] = (run_argv + extra + ["--use_liger"], liger_env())
    return run_probed("rlhf", probed(specs, root, model_vocab(tiny_qwen3["model"]), min_positions=2), root)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_matches_unpatched(loss_runs, loss_type):
    base, liger = loss_runs[f"{loss_type}_base"].check(), loss_runs[f"{loss_type}_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward"} <= compared, compared
    assert ("kl" in compared) == (loss_type != "dapo"), compared   # beta 0: no KL term, no reference pass
    passes = liger.patch_record()["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert base.probe["lm_head_logits"] > 0 and liger.probe["lm_head_logits"] == 0, (base.probe, liger.probe)


def test_teacher_log_probs_from_hidden_states(loss_runs):
    """OPD-RL (--teacher_model): the teacher's log-probs come from its hidden states too (it is patched with the
    fused head for that); every metric, teacher_kl included, equals the unpatched run's."""
    base, liger = loss_runs["teacher_base"].check(), loss_runs["teacher_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "teacher_kl"} <= compared, compared
    runtime = liger.patch_record()["runtime"]["total"]
    passes = runtime["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs_no_grad"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert "teacher model: cross_entropy=fused_linear for GRPO's teacher log-probs (OPD-RL)" in liger.log


def test_teacher_served_by_api(loss_runs, teacher_server):
    """OPD-RL with --teacher_model_server: the sampled tokens' teacher log-probs arrive over HTTP, the policy's come
    from hidden states; every metric, teacher_kl included, equals the unpatched run's, and both runs asked the
    server."""
    base, liger = loss_runs["teacher_api_base"].check(), loss_runs["teacher_api_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "teacher_kl"} <= compared, compared
    passes = liger.patch_record()["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert "teacher model:" not in liger.log
    with open(teacher_server[2]) as f:
        assert len(f.read().split()) >= 2 * 2   # each run posts at least once per step


def test_grpo_logs_tokens_and_completion_tokens_per_second(runs):
    steps = runs["liger"].check().steps()
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        seconds, tokens, completion = s["step_time(s)"], s["tokens/s"], s["completion_tokens/s"]
        # every step trains BATCH * ACCUM generated rows of at most COMPLETION completion tokens, after a prompt
        assert 0 < completion * seconds <= BATCH * ACCUM * COMPLETION * 1.001
        assert tokens > completion


def test_rollouts_on_an_exact_rolling_cache_match_unpatched(runs):
    """--liger_rolling_cache exact: every generate call of the pt engine runs on a fresh RollingKVCache of its prompt
    + max new tokens (nothing evicted), so the sampled completions, rewards and every metric equal the plain run's;
    the record counts the calls and their forwards (no CUDA graph on CPU). Without CUDA no default is taken: the plain
    --use_liger run's rollouts keep transformers' cache and the log says why."""
    base, run = runs["base"].check(), runs["rolling_liger"].check()
    compared = compare_metrics(base.steps(), run.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "kl", "completions/mean_length"} <= compared, compared
    ring = run.patch_record()["runtime"]["total"]["rolling_cache"]
    # STEPS steps x 2 micro-batches: each generates its prompts' GENERATIONS completions in one call
    assert ring["generate"] >= 2 and ring["own_cache"] == ring["unsized"] == ring["graph_steps"] == 0, ring
    assert ring["generate"] < ring["forwards"] <= ring["generate"] * COMPLETION, ring
    assert "generate on a ring of each call's prompt + new tokens: exact attention" in run.log
    assert "generate calls of the policy on a fresh RollingKVCache" in run.log
    import torch
    if not torch.cuda.is_available():
        liger = runs["liger"].check()
        assert "rolling_cache off: the grpo rollouts (pt engine) keep transformers' cache (no CUDA GPU)" in liger.log
        assert "rolling_cache" not in liger.patch_record()["runtime"]["total"]


# --num_iterations 2: each generated batch trains twice, so at steps 2 and 4 the old policy's log-probs (taken
# through our seam when the batch was generated) differ from the current policy's: the importance ratio leaves 1 and
# the clipping (epsilon, epsilon_high), delta and the importance-sampling level act on the loss and its gradient. With
# ms-swift's defaults (one iteration, steps_per_generation = gradient accumulation) the old log-probs are the current
# ones detached and the ratio is exactly 1, so the cases above cannot see a wrong old-policy pass.
RATIO_CASES = {
    # dr_grpo, delta, sequence IS, and a clip range narrow enough for the ratio to leave it
    "clipped": SETTINGS + ["--epsilon", "0.003", "--epsilon_high", "0.006"],
    "rloo": ["--advantage_estimator", "rloo", "--importance_sampling_level", "sequence_token"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_plus_plus"],
    "beta0": ["--beta", "0"],                                        # loss_type grpo without the reference pass
    # two turns per rollout (the plugin's scheduler): the completion holds both answers and the user turn between
    # them, which the loss mask leaves out
    "multi_turn": ["--multi_turn_scheduler", "two_turns", "--max_turns", "2"],
}

# Where our head cannot apply: a trained copy of lm_head (PEFT's modules_to_save wrapper) replaces the patched head.
FALLBACK_CASES = {"head_wrapped": ["--modules_to_save", "lm_head"]}


@pytest.fixture(scope="module")
def ratio_runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_ratio_runs")
    argv = grpo_argv(tiny_qwen3, root) + ["--num_iterations", "2"]
    cases = {**RATIO_CASES, **FALLBACK_CASES}
    # heads over completions count; the one-position decode steps of the rollouts do not
    return run_probed("rlhf", paired_specs({name: (argv + extra, "torch") for name, extra in cases.items()}, root,
                                           model_vocab(tiny_qwen3["model"]), min_positions=2), root)


@pytest.mark.parametrize("case", sorted(RATIO_CASES))
def test_importance_ratio_off_one_matches_unpatched(ratio_runs, case):
    """Every metric (loss, grad_norm: the Liger-Kernel #1082 failure mode, kl, clip ratios) equals the unpatched run's
    at every one of the STEPS steps while the ratio is off 1, with gradient accumulation; the probe counts no [rows,
    positions, V] logits in the patched run's training passes (the unpatched one's are counted, so it sees them)."""
    base, liger = ratio_runs[f"{case}_base"].check(), ratio_runs[f"{case}_liger"].check()
    assert [s["step"] for s in base.steps()] == [s["step"] for s in liger.steps()] == list(range(1, STEPS + 1))
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "clip_ratio/region_mean"} <= compared, compared
    assert ("kl" in compared) == (case != "beta0"), compared
    if case == "clipped":   # the ratio left [1 - epsilon, 1 + epsilon_high] at some tokens: it is not 1
        assert any(s["clip_ratio/region_mean"] > 0 for s in base.steps()), base.steps()
    if case == "multi_turn":   # the generating steps (1 and 3) log their rollouts' turns
        assert [s["num_turns"] for s in liger.steps() if "num_turns" in s] == [2.0, 2.0], liger.steps()
    passes = liger.patch_record()["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert base.probe["lm_head_logits"] > 0, base.probe
    assert liger.probe["lm_head_logits"] == 0, liger.probe


def test_a_wrapped_head_runs_ms_swifts_own_path_and_says_why(ratio_runs):
    """--modules_to_save lm_head: PEFT puts a trained copy of the head in place of the patched one, so GRPO's
    log-probs come from the trainer's own code on real logits; every metric equals the unpatched run's, the record
    counts those passes as logits (none as fused) and the first-step log says why."""
    base, liger = ratio_runs["head_wrapped_base"].check(), ratio_runs["head_wrapped_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "kl"} <= compared, compared
    trainer = liger.patch_record()["runtime"]["total"]["trainer"]
    passes = trainer["log_prob_passes"]
    assert passes["logits"] > 0 and passes["fused_linear_logprobs"] == passes["fused_linear_logprobs_no_grad"] == 0, \
        passes
    assert liger.probe["lm_head_logits"] > 0, liger.probe
    assert any("modules_to_save" in r for r in trainer["logits_fallback_reasons"]), trainer
    assert "--modules_to_save covers lm_head, so the tuner wraps it and the fused linear loss head stands aside" \
        in liger.log
    assert "took 0 log-prob passes from hidden states" in liger.log and "because lm_head was replaced after " \
        "patching (LoRA or modules_to_save on lm_head?)" in liger.log
