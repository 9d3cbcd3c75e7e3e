"""End-to-end: `swift rlhf --rlhf_type grpo --use_liger` on the tiny offline model, generating through ms-swift's pt
engine on CPU (no vLLM) with a length reward, 2 optimizer steps of 2 micro-batches. The step metrics count the
tokens of the generated rows the loss trained on (GRPO's training_step gets prompts only) and the completion tokens
among them. The CPU reference backend runs (SWIFT_LIGER_BACKEND=torch): the metrics, not the kernels, are the subject.
"""
from __future__ import annotations

import pytest

from swift_runner import CPU_FLAGS, run_swift, swift_env

pytestmark = pytest.mark.slow

REWARD = '''
from swift.rewards import ORM, orms


class LengthReward(ORM):
    def __call__(self, completions, **kwargs):
        return [len(c) / 10.0 for c in completions]


orms["length_reward"] = LengthReward
'''
GENERATIONS, COMPLETION, BATCH, ACCUM = 2, 8, 2, 2


def test_grpo_logs_tokens_and_completion_tokens_per_second(tiny_qwen3, tmp_path):
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    argv = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], *CPU_FLAGS, "--rlhf_type", "grpo",
            "--tuner_type", "lora", "--use_vllm", "false", "--external_plugins", str(plugin),
            "--reward_funcs", "length_reward", "--num_generations", str(GENERATIONS),
            "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps", str(ACCUM),
            "--max_completion_length", str(COMPLETION), "--max_length", "64", "--max_steps", "2",
            "--report_to", "none", "--save_strategy", "no", "--use_liger"]
    env = swift_env(SWIFT_LIGER_BACKEND="torch")
    env.pop("TRITON_INTERPRET", None)
    steps = run_swift("rlhf", argv, str(tmp_path / "grpo"), env).check().steps()
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        seconds, tokens, completion = s["step_time(s)"], s["tokens/s"], s["completion_tokens/s"]
        # every step trains BATCH * ACCUM generated rows of at most COMPLETION completion tokens, after a prompt
        assert 0 < completion * seconds <= BATCH * ACCUM * COMPLETION * 1.001
        assert tokens > completion
