"""integration/preference.py and runtime.py in-process: the log-prob seam against ms-swift's own implementation
(padded and packed shapes), the trainer subclasses, the fallback to real logits, and what the first-step log says."""
from __future__ import annotations

import copy
import types

import pytest
import torch

import swift_liger
from swift_liger.integration import preference, runtime
from swift_liger.integration.preference import teacher_api_scored
from swift_liger.integration.arguments import cross_entropy_fallback_reasons, preference_fused
from swift_liger.config import LigerConfig
from swift_liger import call_counts

pytest.importorskip("swift")
from swift.rlhf_trainers.rlhf_mixin import RLHFTrainerMixin  # noqa: E402

from test_patcher import ALL_OFF, VOCAB, build  # noqa: E402  (tests/test_patcher.py: the tiny random models)


class _Base:
    """The two pieces of ms-swift's DPOTrainer the seam sits between: its model call and RLHFTrainerMixin's
    get_per_token_logps."""
    get_per_token_logps = RLHFTrainerMixin.get_per_token_logps
    is_encoder_decoder = False

    def __init__(self, sp=1):
        self.template = types.SimpleNamespace(sequence_parallel_size=sp)

    def concatenated_forward(self, model, batch):
        logits = model(input_ids=batch["input_ids"]).logits
        labels = torch.roll(batch["labels"], shifts=-1, dims=1)
        return self.get_per_token_logps(logits, labels, reduction=batch.get("reduction", "mean"))


class _Trainer(preference.DPOSeam, _Base):
    pass


def _models():
    stock = build("llama")
    patched = copy.deepcopy(stock)
    swift_liger.apply(patched, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    return stock, patched


def _batch(shape, reduction="mean"):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, shape, generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[..., -2:] = -100
    return {"input_ids": ids, "labels": labels, "reduction": reduction}


@pytest.mark.parametrize("shape", [(2, 9), (1, 17)], ids=["padded_pair", "packed_row"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_seam_equals_ms_swift_on_real_logits(shape, reduction):
    stock, patched = _models()
    batch = _batch(shape, reduction)
    expected = _Base().concatenated_forward(stock, batch)
    trainer = _Trainer()
    got = trainer.concatenated_forward(patched, batch)
    for name, e, g in zip(("per_token_logps", "reduced_logits", "loss_mask"), expected, got):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g.to(e.dtype), e, atol=2e-5, rtol=2e-5, msg=name)
    assert trainer.liger_calls["fused_linear_logprobs"] == 1 and trainer.liger_calls["logits"] == 0
    with torch.no_grad():
        trainer.concatenated_forward(patched, batch)
    assert trainer.liger_calls["fused_linear_logprobs_no_grad"] == 1
    assert call_counts(patched)["lm_head_logits"] == 0


def test_falls_back_to_real_logits_and_says_why():
    stock, patched = _models()
    batch = _batch((2, 9))
    trainer = _Trainer()
    got = trainer.concatenated_forward(stock, batch)   # an unpatched model: ms-swift's own code on its logits
    expected = _Base().concatenated_forward(stock, batch)
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert trainer.liger_calls["logits"] == 1 and trainer.liger_calls["fused_linear_logprobs"] == 0
    assert any("not patched" in r for r in preference.fallback_reasons(trainer))
    sp = _Trainer(sp=2)   # sequence parallel gathers log-probs from logits across ranks: left to ms-swift
    assert sp._liger_handle(patched) is None
    assert any("sequence parallel" in r for r in preference.fallback_reasons(sp))


def test_trainer_class_keeps_the_name_ms_swift_branches_on():
    class ORPOTrainer:
        pass
    cls = preference.trainer_class(ORPOTrainer)
    assert cls.__name__ == "ORPOTrainer" and issubclass(cls, ORPOTrainer) and issubclass(cls, preference.ORPOSeam)
    assert preference.trainer_class(ORPOTrainer) is cls


def test_config_resolution_per_rlhf_type():
    cfg = LigerConfig()
    for rlhf_type in preference.RLHF_TYPES:
        args = types.SimpleNamespace(rlhf_type=rlhf_type, sequence_parallel_size=1, task_type="causal_lm")
        assert preference_fused(args, cfg) and cross_entropy_fallback_reasons(args) == []
    sp = types.SimpleNamespace(rlhf_type="dpo", sequence_parallel_size=2, task_type="causal_lm")
    assert "sequence_parallel_size=2" in cross_entropy_fallback_reasons(sp)[0]
    ppo = types.SimpleNamespace(rlhf_type="ppo", sequence_parallel_size=1, task_type="causal_lm")
    assert not preference_fused(ppo, cfg) and "rlhf_type=ppo" in cross_entropy_fallback_reasons(ppo)[0]
    assert not preference_fused(types.SimpleNamespace(rlhf_type="dpo"), LigerConfig(cross_entropy="fused"))


def test_first_step_lines_say_what_ran():
    snap = {"trainer": {"class": "DPOTrainer", "logits_fallback_reasons": {},
                        "log_prob_passes": {"fused_linear_logprobs": 16, "fused_linear_logprobs_no_grad": 16,
                                            "logits": 0, "logits_no_grad": 0}},
            "policy": {"cross_entropy_mode": "fused_linear", "fused_linear_cross_entropy": 0, "cross_entropy": 0,
                       "fused_linear_logprobs": 32, "lm_head_logits": 0},
            "ref": {"cross_entropy_mode": "fused", "fused_linear_cross_entropy": 0, "cross_entropy": 0,
                    "fused_linear_logprobs": 0, "lm_head_logits": None}}
    lines = runtime.describe(snap)
    assert lines[0].startswith("in the first step DPOTrainer took 32 log-prob passes from hidden states")
    assert "16 with gradient, 16 without) and 0 from materialised logits" in lines[0]
    assert lines[1] == ("in the first step the policy model's loss head ran fused_linear_logprobs 32; its lm_head "
                        "materialised logits 0 times")
    # installed but never called: said so, and no lm_head count where the head is not patched
    assert "(cross_entropy=fused) ran none of swift_liger's losses" in lines[2] and "lm_head" not in lines[2]


# ---------------------------------------------------------------------------------------------------------------
# GKD: GKDSeam.compute_loss against ms-swift's own GKDTrainer.compute_loss on the stock models' logits
# ---------------------------------------------------------------------------------------------------------------

def _gkd_classes():
    from swift.rlhf_trainers.gkd_trainer import GKDTrainer

    class Base:   # what GKDTrainer.compute_loss reads from the trainer
        compute_loss = GKDTrainer.compute_loss
        _compute_jsd_loss = GKDTrainer._compute_jsd_loss
        is_encoder_decoder = False

        def __init__(self, teacher, beta, temperature, sft_alpha=0.0, self_distillation=False):
            self.args = types.SimpleNamespace(sft_alpha=sft_alpha, report_to=[], gradient_checkpointing_kwargs=None,
                                              offload_teacher_model=False)
            self.template = types.SimpleNamespace(sequence_parallel_size=1)
            self.teacher_model, self.beta, self.temperature = teacher, beta, temperature
            self.gkd_logits_topk, self.use_teacher_api, self.use_liger_gkd_loss = None, False, False
            self._is_self_distillation, self._teacher_use_disable_adapter = self_distillation, False
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True)

        def get_use_logits_to_keep(self, default_value=True):
            return False

    class Trainer(preference.GKDSeam, Base):
        pass

    return Base, Trainer


def _gkd_inputs(opsd=False, source="dataset"):
    from swift.rlhf_trainers.gkd_loss import DataSource
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (2, 10), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, -2:] = -100
    student = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    teacher = student
    if opsd:   # the teacher scores the same completions after a 3-token longer prompt
        t_ids = torch.cat([torch.randint(2, VOCAB, (2, 3), generator=gen), ids], 1)
        t_labels = torch.cat([torch.full((2, 3), -100), labels], 1)
        teacher = {"input_ids": t_ids, "attention_mask": torch.ones_like(t_ids), "labels": t_labels}
    return {"model_inputs": student, "teacher_model_inputs": teacher,
            "gkd_batch": types.SimpleNamespace(data_source=DataSource(source))}


def _gkd_pair(seed):
    stock = build("llama", seed=seed)
    with torch.no_grad():   # peaked next-token distributions (random init gives near-uniform ones, JSD ~0.003)
        stock.lm_head.weight.mul_(40.0)
    patched = copy.deepcopy(stock)
    swift_liger.apply(patched, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    return stock, patched


@pytest.mark.parametrize("beta, temperature, sft_alpha, opsd, self_distillation, topk", [
    (0.5, 1.0, 0.0, False, False, None), (0.0, 0.9, 0.0, False, False, None), (1.0, 1.3, 0.0, False, False, None),
    (0.3, 1.0, 0.5, False, False, None), (0.5, 1.0, 0.0, True, False, None), (0.7, 2.0, 0.2, True, True, None),
    (0.5, 1.0, 0.0, False, False, 5), (0.0, 0.9, 0.5, True, False, 8), (1.0, 1.2, 0.0, True, True, 3),
], ids=["jsd", "forward_kl", "reverse_kl", "sft_alpha", "opsd", "self_distillation_opsd", "topk",
        "topk_forward_kl_sft_alpha_opsd", "topk_reverse_kl_self_distillation_opsd"])
def test_gkd_seam_equals_ms_swift(beta, temperature, sft_alpha, opsd, self_distillation, topk):
    Base, Trainer = _gkd_classes()
    student_stock, student = _gkd_pair(0)
    teacher_stock, teacher = _gkd_pair(1)
    for m in (student_stock, student):
        m.train()
    inputs = _gkd_inputs(opsd)
    expected_trainer = Base(None if self_distillation else teacher_stock, beta, temperature, sft_alpha,
                            self_distillation)
    expected_trainer.gkd_logits_topk = topk
    expected = expected_trainer.compute_loss(student_stock, inputs)
    expected.backward()
    trainer = Trainer(None if self_distillation else teacher, beta, temperature, sft_alpha, self_distillation)
    trainer.gkd_logits_topk = topk
    grad_modes = []   # the teacher's forward runs without autograd, as ms-swift's
    hook = teacher.register_forward_pre_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    got = trainer.compute_loss(student, inputs)
    hook.remove()
    assert grad_modes == ([] if self_distillation else [False])
    got.backward()
    torch.testing.assert_close(got.detach(), expected.detach(), atol=1e-6, rtol=2e-5)
    assert float(expected) > 0.05   # the teacher differs from the student (self-distillation: its own longer prompt)
    for (name, p), (_, q) in zip(student_stock.named_parameters(), student.named_parameters()):
        scale = max(1e-3, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, atol=2e-5 * scale, rtol=2e-4, msg=name)
    assert trainer.liger_calls["fused_linear_jsd"] == 1 and trainer.liger_calls["logits"] == 0
    counts = call_counts(student)
    assert counts["fused_linear_jsd"] == 1 and counts["lm_head_logits"] == 0
    assert counts["fused_linear_cross_entropy"] == (1 if sft_alpha else 0)
    if not self_distillation:
        assert call_counts(teacher)["lm_head_logits"] == 0
        assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("beta, sft_alpha", [(0.5, 0.0), (0.0, 0.5), (1.0, 0.0)])
def test_gkd_seam_with_a_teacher_served_by_api(beta, sft_alpha):
    """--teacher_model_server: the teacher's top-k log-probs arrive with the batch (-inf where it did not cover a
    position); the student's logits at those ids come from its hidden states (ops.fused_linear_jsd_topk)."""
    Base, Trainer = _gkd_classes()
    student_stock, student = _gkd_pair(0)
    teacher_stock, _ = _gkd_pair(1)
    for m in (student_stock, student):
        m.train()
    inputs = _gkd_inputs()
    with torch.no_grad():
        top = torch.log_softmax(teacher_stock(input_ids=inputs["model_inputs"]["input_ids"]).logits, -1).topk(6, -1)
    values = top.values.clone()
    values[0, 5] = float("-inf")   # a scored position the teacher left uncovered: dropped, as ms-swift drops it
    inputs["gkd_batch"].teacher_topk_logprobs, inputs["gkd_batch"].teacher_topk_indices = values, top.indices
    expected_trainer = Base(None, beta, 0.9, sft_alpha)
    expected_trainer.use_teacher_api = True
    expected = expected_trainer.compute_loss(student_stock, inputs)
    expected.backward()
    trainer = Trainer(None, beta, 0.9, sft_alpha)
    trainer.use_teacher_api = True
    got = trainer.compute_loss(student, inputs)
    got.backward()
    torch.testing.assert_close(got.detach(), expected.detach(), atol=1e-6, rtol=2e-5)
    assert float(expected.detach()) > 0.05
    for (name, p), (_, q) in zip(student_stock.named_parameters(), student.named_parameters()):
        scale = max(1e-3, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, atol=2e-5 * scale, rtol=2e-4, msg=name)
    assert trainer.liger_calls["fused_linear_jsd"] == 1 and trainer.liger_calls["logits"] == 0
    assert call_counts(student)["lm_head_logits"] == 0
    # the record counts the trained positions the server scored (position 5 of row 0 left out when it is trained)
    trained = torch.roll(inputs["teacher_model_inputs"]["labels"], shifts=-1, dims=1) != -100
    assert teacher_api_scored(trainer) == {"scored": int(trained.sum()) - int(trained[0, 5]),
                                           "trained": int(trained.sum())}
    assert teacher_api_scored(Trainer(None, beta, 0.9, sft_alpha)) is None


@pytest.mark.parametrize("scored, warned", [(48, False), (11, True)])
def test_first_step_line_for_a_teacher_server(scored, warned):
    snap = {"trainer": {"class": "GKDTrainer", "logits_fallback_reasons": {},
                        "log_prob_passes": {"fused_linear_logprobs": 0, "fused_linear_logprobs_no_grad": 0,
                                            "fused_linear_jsd": 2, "logits": 0, "logits_no_grad": 0},
                        "teacher_api_positions": {"scored": scored, "trained": 60}}}
    line = runtime.describe(snap)[1]
    assert line.startswith(f"in the first step the teacher server's top-k log-probs covered {scored} of the 60 "
                           "trained positions")
    assert ("under half" in line) == warned


def test_gkd_seam_falls_back_and_says_why():
    Base, Trainer = _gkd_classes()
    student_stock, student = _gkd_pair(0)
    teacher_stock, teacher = _gkd_pair(1)
    inputs = _gkd_inputs()
    unpatched = Trainer(teacher_stock, 0.5, 1.0)   # a teacher we did not patch: its logits, ms-swift's loss
    student.train()
    unpatched.compute_loss(student, inputs)
    assert unpatched.liger_calls["logits"] == 1
    assert any("not patched" in r for r in preference.fallback_reasons(unpatched))
    for m in (student, student_stock):
        m.eval()
    ev = Trainer(teacher, 0.5, 1.0, sft_alpha=0.5)   # with labels: the patched student must keep its logits
    with torch.no_grad():
        got = ev.compute_loss(student, inputs)
        expected = Base(teacher_stock, 0.5, 1.0, sft_alpha=0.5).compute_loss(student_stock, inputs)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert ev.liger_calls["logits_no_grad"] == 1 and ev.liger_calls["fused_linear_jsd_no_grad"] == 0
    assert any("evaluation" in r for r in preference.fallback_reasons(ev))
