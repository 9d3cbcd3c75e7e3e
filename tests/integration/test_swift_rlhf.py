"""End-to-end: the real `swift rlhf` CLI (dpo, orpo, cpo, simpo, kto; LoRA and full fine-tuning) on the tiny
offline models, patched (--use_liger: log-probs from hidden states) against unpatched, 5 optimizer steps of 2
micro-batches each. Every logged metric must agree; a probe outside swift_liger (probe/sitecustomize.py) counts the
[rows, V] logits any lm_head materialised.

Two runs use the real Triton kernels through the interpreter (dpo LoRA, kto LoRA); the rest the CPU reference
backend users without CUDA run (SWIFT_LIGER_BACKEND=torch), so the trainer plumbing is covered at CPU speed.
"""
from __future__ import annotations

import glob
import os

import pytest

from swift_runner import CPU_FLAGS, compare_metrics, model_vocab, paired_specs, run_probed

pytestmark = pytest.mark.slow

STEPS = 5
SMALL = ["--per_device_train_batch_size", "1", "--max_length", "64", "--gradient_accumulation_steps", "2",
         "--max_steps", str(STEPS), "--report_to", "none", "--learning_rate", "1e-4"]
# timing and process metrics differ between runs by nature; everything else ms-swift logs must agree
NOT_COMPARED = {"step_time(s)", "tokens/s", "rss(GiB)", "elapsed_time", "remaining_time", "train_speed(s/it)",
                "memory(GiB)", "global_step/max_steps", "peak_alloc(GiB)", "peak_reserved(GiB)"}
# name: (model fixture, dataset key, flags, backend of the patched run)
CASES = {
    "dpo_lora": ("llama", "pref", ["--rlhf_type", "dpo", "--tuner_type", "lora", "--save_strategy", "steps",
                                   "--save_steps", str(STEPS), "--save_only_model", "true"], "triton"),
    "dpo_full_ipo": ("qwen3", "pref", ["--rlhf_type", "dpo", "--tuner_type", "full", "--loss_type", "ipo"], "torch"),
    "dpo_lora_mix": ("llama", "pref", ["--rlhf_type", "dpo", "--tuner_type", "lora", "--loss_type", "sigmoid",
                                       "bco_pair", "--loss_weights", "0.7", "0.3", "--rpo_alpha", "0.5"], "torch"),
    "dpo_full_ld": ("llama", "pref", ["--rlhf_type", "dpo", "--tuner_type", "full", "--ld_alpha", "0.5",
                                      "--rpo_alpha", "0.2"], "torch"),
    "orpo_lora": ("llama", "pref", ["--rlhf_type", "orpo", "--tuner_type", "lora"], "torch"),
    "orpo_full": ("qwen3", "pref", ["--rlhf_type", "orpo", "--tuner_type", "full"], "torch"),
    "cpo_full": ("qwen3", "pref", ["--rlhf_type", "cpo", "--tuner_type", "full", "--cpo_alpha", "0.5"], "torch"),
    "simpo_lora": ("llama", "pref", ["--rlhf_type", "simpo", "--tuner_type", "lora"], "torch"),
    "kto_lora": ("llama", "kto", ["--rlhf_type", "kto", "--tuner_type", "lora"], "triton"),
    "kto_full": ("qwen3", "kto", ["--rlhf_type", "kto", "--tuner_type", "full"], "torch"),
}


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf_runs")
    models = {"llama": tiny_llama, "qwen3": tiny_qwen3}
    specs = {}
    for name, (arch, data, flags, backend) in CASES.items():
        tiny = models[arch]
        argv = [*tiny["swift_flags"], "--dataset", tiny[data], *CPU_FLAGS, *SMALL, *flags]
        if "--save_strategy" not in flags:
            argv += ["--save_strategy", "no"]
        specs.update(paired_specs({name: (argv, backend)}, root, model_vocab(tiny["model"])))
    order = sorted(specs, key=lambda n: (CASES[n.rsplit("_", 1)[0]][3] != "triton", n))   # slow ones first
    return run_probed("rlhf", {n: specs[n] for n in order}, root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_every_metric_match_unpatched(runs, case):
    base, liger = runs[f"{case}_base"].check().steps(), runs[f"{case}_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    compared = compare_metrics(base, liger, NOT_COMPARED)
    expected = {"loss", "grad_norm", "rewards/chosen", "logps/chosen", "logits/chosen", "epoch"}
    assert expected <= compared, compared
    assert base[0]["loss"] != base[-1]["loss"]   # it trained


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_logits_materialised_and_the_record_says_so(runs, case):
    base, liger = runs[f"{case}_base"].check(), runs[f"{case}_liger"].check()
    assert base.probe["processes"] >= 1 and base.probe["lm_head_logits"] > 0, base.probe   # the stock path's logits
    assert liger.probe["lm_head_logits"] == 0, liger.probe    # ... and none in the patched run
    record = liger.patch_record()
    runtime = record["runtime"]
    total = runtime["total"]
    passes = total["trainer"]["log_prob_passes"]
    assert passes["fused_linear_logprobs"] > 0 and passes["logits"] == passes["logits_no_grad"] == 0, passes
    assert total["policy"]["lm_head_logits"] == 0 and total["policy"]["fused_linear_logprobs"] > 0, total
    assert runtime["optimizer_steps"] == STEPS
    full_ref = "full" in case and not case.startswith(("orpo", "cpo"))   # dpo/kto full fine-tuning: a ref model
    assert set(record["models"]) == ({"policy", "ref"} if full_ref else {"policy"})
    if full_ref:
        assert total["ref"]["fused_linear_logprobs"] > 0 and total["ref"]["lm_head_logits"] == 0
        assert record["models"]["ref"]["config"]["cross_entropy"] == "fused_linear"
    assert "log-prob passes from hidden states" in liger.log and "and 0 from materialised logits" in liger.log
    if case == "dpo_lora":   # lora_fusion takes the policy's projections; the reference pass runs PEFT's
        assert total["lora_fusion"]["ops.lora_linear"] > 0 and total["lora_fusion"]["peft"] > 0, total


def test_adapter_from_patched_dpo_loads_into_unpatched_model(runs, tiny_llama):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import swift_liger

    (ckpt,) = glob.glob(os.path.join(runs["dpo_lora_liger"].check().run_dir, f"checkpoint-{STEPS}"))
    (base_ckpt,) = glob.glob(os.path.join(runs["dpo_lora_base"].check().run_dir, f"checkpoint-{STEPS}"))
    keys = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    base_keys = load_file(os.path.join(base_ckpt, "adapter_model.safetensors"))
    assert keys.keys() == base_keys.keys() and all("lora_" in k and "liger" not in k for k in keys)
    assert all(keys[k].shape == base_keys[k].shape and keys[k].dtype == base_keys[k].dtype for k in keys)

    ids = torch.tensor([[5, 17, 200, 33, 1024, 7, 99, 400, 12, 3, 800, 61]])
    logits = []
    for patch in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama["model"], dtype=torch.float32)
        if patch:
            swift_liger.apply(model)
        model = PeftModel.from_pretrained(model, ckpt).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids).logits, logits[0])   # the adapter trained
