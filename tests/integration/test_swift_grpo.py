"""End-to-end: `swift rlhf --rlhf_type grpo` on the tiny offline model, generating through ms-swift's pt engine on CPU
(no vLLM) with a length reward, 2 optimizer steps of 2 micro-batches; the CPU reference backend runs the patched
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
log the plain run's.
"""
from __future__ import annotations

import pytest

from concurrent.futures import ThreadPoolExecutor

from swift_runner import CPU_FLAGS, compare_metrics, run_swift, swift_env

pytestmark = pytest.mark.slow

REWARD = '''
from swift.rewards import ORM, orms


class LengthReward(ORM):
    def __call__(self, completions, **kwargs):
        return [len(c) / 10.0 for c in completions]


orms["length_reward"] = LengthReward
'''
GENERATIONS, COMPLETION, BATCH, ACCUM = 2, 8, 2, 2


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
            "--max_completion_length", str(COMPLETION), "--max_length", "64", "--max_steps", "2",
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
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(run_swift, "rlhf", a, str(root / n), e) for n, (a, e) in specs.items()}
        return {n: f.result() for n, f in futures.items()}


def test_every_metric_matches_unpatched(runs):
    base, liger = runs["base"].check().steps(), runs["liger"].check().steps()
    assert [s["step"] for s in base] == [s["step"] for s in liger] == [1, 2]
    compared = compare_metrics(base, liger, NOT_COMPARED)
    assert {"loss", "grad_norm", "reward", "kl", "completions/mean_length"} <= compared, compared


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
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(run_swift, "rlhf", a, str(root / n), e) for n, (a, e) in specs.items()}
        return {n: f.result() for n, f in futures.items()}


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_matches_unpatched(loss_runs, loss_type):
    base, liger = loss_runs[f"{loss_type}_base"].check(), loss_runs[f"{loss_type}_liger"].check()
    compared = compare_metrics(base.steps(), liger.steps(), NOT_COMPARED)
    assert {"loss", "grad_norm", "reward"} <= compared, compared
    assert ("kl" in compared) == (loss_type != "dapo"), compared   # beta 0: no KL term, no reference pass
    passes = liger.patch_record()["runtime"]["total"]["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes


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
    assert [s["step"] for s in steps] == [1, 2]
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
    # 2 steps x 2 micro-batches: each generates its prompts' GENERATIONS completions in one call
    assert ring["generate"] >= 2 and ring["own_cache"] == ring["unsized"] == ring["graph_steps"] == 0, ring
    assert ring["generate"] < ring["forwards"] <= ring["generate"] * COMPLETION, ring
    assert "generate on a ring of each call's prompt + new tokens: exact attention" in run.log
    assert "generate calls of the policy on a fresh RollingKVCache" in run.log
    import torch
    if not torch.cuda.is_available():
        liger = runs["liger"].check()
        assert "rolling_cache off: the grpo rollouts (pt engine) keep transformers' cache (no CUDA GPU)" in liger.log
        assert "rolling_cache" not in liger.patch_record()["runtime"]["total"]
