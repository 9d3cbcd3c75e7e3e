"""An ms-swift plugin for GRPO benchmarks (`swift rlhf --rlhf_type grpo --external_plugins <this file>`): the rollout
returns, instantly, completions of exactly ``--max_completion_length`` random ordinary tokens (what an untrained model
that never stops would generate), and the ``swift_liger_bench_reward`` reward scores each by a hash of its text.

Generating 8 x 2k-8k tokens per step through the pt engine would take minutes per step; this keeps the training
phase at full length (policy, reference and old-policy log-probs, the loss, backward, the optimizer step) while the
generation costs nothing. The training phase is ms-swift's own code in every variant. Loaded by ms-swift, never
imported by swift_liger. With SWIFT_LIGER_BENCH_ROLLOUT=real (swift_cli run --rollout real) the rollout is
ms-swift's own (the pt engine generates) and only the reward is this file's.
"""
from __future__ import annotations

import hashlib
import os
import random

from swift.infer_engine.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage,
                                         RolloutOutput, UsageInfo)
from swift.rewards import ORM, orms
from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin

_rng = random.Random(0)


def _ordinary_ids(tokenizer) -> list:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _synthetic_infer(self, infer_requests, request_config=None, *, use_tqdm=False):
    tokenizer = self.template.tokenizer
    ids = getattr(self, "_bench_ordinary_ids", None)
    if ids is None:
        ids = self._bench_ordinary_ids = _ordinary_ids(tokenizer)
    n = int(request_config.max_tokens)
    out = []
    for _ in infer_requests:
        tokens = [_rng.choice(ids) for _ in range(n)]
        choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant",
                                                                            content=tokenizer.decode(tokens)),
                                              finish_reason="length", token_ids=tokens)
        response = ChatCompletionResponse(model="bench", choices=[choice],
                                          usage=UsageInfo(prompt_tokens=0, completion_tokens=n, total_tokens=n))
        out.append(RolloutOutput(response=response))
    return out


class BenchReward(ORM):
    def __call__(self, completions, **kwargs):
        return [int(hashlib.md5(c.encode()).hexdigest()[:8], 16) / 2 ** 32 for c in completions]


if os.environ.get("SWIFT_LIGER_BENCH_ROLLOUT", "instant") == "instant":   # "real": ms-swift's engine generates
    RolloutTrainerMixin._engine_infer = _synthetic_infer
orms["swift_liger_bench_reward"] = BenchReward
