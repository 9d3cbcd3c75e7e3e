"""`--attn_impl swift_liger`: packing / padding-free training in ms-swift without flash-attn.

In-process (real ms-swift arguments, no training): ms-swift's flash-only check takes swift_liger; --use_liger picks
it for packed rows when attn_impl is unset, sdpa or eager (an explicit flash choice is kept); without --use_liger
sdpa still gets ms-swift's error (plus our hint); the rlhf types ms-swift allows; refusals before the run directory
exists; ms-swift's AttnImpl.update_attn_impl registers the implementation before a model is built.

The real `swift sft` CLI (slow): padding-free runs (one packed row per step, position ids restarting, no mask) log
the same per-step losses and token counts as the stock padded run over the same rows, with and without --use_liger;
a --packing run trains over exactly the dataset's tokens; `swift rlhf --rlhf_type dpo|kto|gkd
--padding_free true --use_liger` logs the stock padded run's metrics, every attention call through the packed-row
kernel. The run without --use_liger executes the varlen kernel in Triton's interpreter; the --use_liger runs use the
PyTorch references (SWIFT_LIGER_BACKEND=torch) to stay fast on CPU (every fusion's kernels through the interpreter
cost ~30 s a step at these lengths).
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_liger.integration import attention, swift_patches

from swift_runner import CPU_FLAGS, run_swift, swift_env

FLASH_ERROR = 'feature requires a flash attention implementation'


@pytest.fixture(scope="module")
def swift_mod():
    from swift.arguments import RLHFArguments, SftArguments
    from swift.utils import parse_args
    return dict(sft=SftArguments, rlhf=RLHFArguments, parse=parse_args)


@pytest.fixture
def base_argv(tiny_qwen3, tmp_path):
    return [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--check_model", "false",
            "--tuner_type", "lora", "--output_dir", str(tmp_path / "out")]


@pytest.fixture
def logged(monkeypatch):
    lines = []
    monkeypatch.setattr(swift_patches, "_log_info_on_master", lines.append)
    return lines


def parse(swift_mod, argv, kind="sft"):
    args, remaining = swift_mod["parse"](swift_mod[kind], argv)
    assert remaining == []
    return args


def test_padding_free_with_sdpa_and_no_use_liger_keeps_ms_swifts_error(swift_mod, base_argv):
    for flag in ("--padding_free", "--packing"):
        with pytest.raises(ValueError, match=FLASH_ERROR) as exc:
            parse(swift_mod, base_argv + [flag, "true", "--attn_impl", "sdpa"])
        assert "--attn_impl swift_liger" in str(exc.value)   # our hint after ms-swift's message


@pytest.mark.parametrize("given", [None, "sdpa", "eager"])
@pytest.mark.parametrize("flag", ["--padding_free", "--packing"])
def test_use_liger_switches_packed_runs_to_swift_liger(swift_mod, base_argv, logged, flag, given):
    extra = [] if given is None else ["--attn_impl", given]
    args = parse(swift_mod, base_argv + [flag, "true", "--use_liger", *extra])
    assert args.attn_impl == "swift_liger" and args.padding_free is True
    assert args.packing is (flag == "--packing")
    assert len(logged) == 1 and f"{flag} with --use_liger" in logged[0] and "swift_liger" in logged[0], logged


def test_explicit_choices_are_kept(swift_mod, base_argv, logged):
    args = parse(swift_mod, base_argv + ["--packing", "true", "--use_liger", "--attn_impl", "flash_attn"])
    assert args.attn_impl == "flash_attn" and args.padding_free is True
    args = parse(swift_mod, base_argv + ["--use_liger"])                   # not packed: attention untouched
    assert args.attn_impl is None
    args = parse(swift_mod, base_argv + ["--packing", "true", "--attn_impl", "swift_liger"])   # no --use_liger
    assert args.attn_impl == "swift_liger" and args.padding_free is True and args.use_liger is False
    assert logged == []


def test_rlhf_types(swift_mod, base_argv):
    argv = base_argv + ["--padding_free", "true", "--attn_impl", "swift_liger"]
    for rlhf_type in ("dpo", "kto"):
        args = parse(swift_mod, argv + ["--rlhf_type", rlhf_type], kind="rlhf")
        assert args.attn_impl == "swift_liger" and args.padding_free is True
    with pytest.raises(NotImplementedError, match="does not support padding_free/packing"):   # ms-swift's own
        parse(swift_mod, argv + ["--rlhf_type", "orpo"], kind="rlhf")


def test_refusals_come_before_the_run_directory(swift_mod, base_argv, tiny_qwen3, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="sequence_parallel_size 2"):
        parse(swift_mod, base_argv + ["--attn_impl", "swift_liger", "--sequence_parallel_size", "2"])
    model = tmp_path / "dropout_model"
    shutil.copytree(tiny_qwen3["model"], model)
    with open(model / "config.json") as f:
        config = json.load(f)
    config["attention_dropout"] = 0.1
    with open(model / "config.json", "w") as f:
        json.dump(config, f)
    argv = ["--model", str(model), *base_argv[2:]]
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        parse(swift_mod, argv + ["--padding_free", "true", "--attn_impl", "swift_liger"])
    assert not glob.glob(str(out / "v*-*"))
    parse(swift_mod, argv + ["--padding_free", "true", "--attn_impl", "flash_attn"])   # not ours to refuse


def _fake_args(model_dir, **flags):
    from types import SimpleNamespace
    values = dict(attn_impl=attention.ATTN_IMPL, padding_free=False, packing=False,
                  model_info=SimpleNamespace(model_dir=str(model_dir)))
    return SimpleNamespace(**{**values, **flags})


@pytest.mark.parametrize("model_type", ["falcon", "bloom", "gptj"])
def test_models_whose_attention_skips_transformers_interface_are_refused_for_packed_rows(tmp_path, model_type):
    """transformers' own modelling code of these types computes attention itself (transformers 5.17): with packed
    rows and swift_liger named, documents would attend to each other, so the arguments are refused."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    for flag in ("padding_free", "packing"):
        with pytest.raises(ValueError, match=f"--{flag} with --attn_impl swift_liger: transformers' {model_type} "
                                             "modelling code computes attention without"):
            attention.check_arguments(_fake_args(tmp_path, **{flag: True}))
    attention.check_arguments(_fake_args(tmp_path))   # padded batches: the model's own attention, masks and all
    for ok in ("qwen3", "llama", "gemma2", "qwen2"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": ok}))
        attention.check_arguments(_fake_args(tmp_path, padding_free=True))


REMOTE_CODE = """
from torch import nn
{import_line}


class CustomAttention(nn.Module):
    def forward(self, x):
        return {call}
"""


def test_remote_code_attention_is_read_before_the_run_directory(swift_mod, base_argv, tiny_qwen3, tmp_path):
    """A checkpoint whose config.json maps AutoModelForCausalLM to its own file: that file decides."""
    model = tmp_path / "remote_model"
    shutil.copytree(tiny_qwen3["model"], model)
    with open(model / "config.json") as f:
        config = json.load(f)
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    with open(model / "config.json", "w") as f:
        json.dump(config, f)
    argv = ["--model", str(model), *base_argv[2:], "--padding_free", "true", "--attn_impl", "swift_liger"]
    (model / "modeling_custom.py").write_text(REMOTE_CODE.format(import_line="", call="x @ x.T"))
    for given in (argv, argv[:-2] + ["--use_liger"]):   # named, or picked by --use_liger
        with pytest.raises(ValueError, match=r"the checkpoint's own modelling code \(modeling_custom.py\) computes"):
            parse(swift_mod, given)
    assert not glob.glob(str(tmp_path / "out" / "v*-*"))
    (model / "modeling_custom.py").write_text(REMOTE_CODE.format(
        import_line="from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS",
        call="ALL_ATTENTION_FUNCTIONS.get_interface('sdpa', None)"))
    assert parse(swift_mod, argv).attn_impl == "swift_liger"


def test_update_attn_impl_registers_before_the_model_is_built(monkeypatch, tiny_qwen3):
    from swift.model.utils import AttnImpl
    from transformers import AttentionInterface, AutoConfig
    from transformers.masking_utils import AttentionMaskInterface

    from swift_liger.fusions import varlen_attention as va
    monkeypatch.delitem(AttentionInterface._global_mapping, va.NAME, raising=False)
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, va.NAME, raising=False)
    assert not va.registered()
    config = AutoConfig.from_pretrained(tiny_qwen3["model"])
    AttnImpl.update_attn_impl(config, "sdpa")
    assert not va.registered()
    AttnImpl.update_attn_impl(config, attention.ATTN_IMPL)
    assert va.registered() and config._attn_implementation == "swift_liger"


# ---------------------------------------------------------------------------------------------------------------
# The real CLI
# ---------------------------------------------------------------------------------------------------------------

ROWS = 24   # of the tiny SFT set; ms-swift keeps those within max_length 64 (14 of them): 4 steps of 4 rows
DPO_STEPS = 3


@pytest.fixture(scope="module")
def cli_runs(tiny_qwen3, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("packing_runs")
    data = root / "sft.jsonl"
    with open(tiny_qwen3["sft"]) as f:
        data.write_text("".join(f.readlines()[:ROWS]))
    # --lora_dropout 0: dropout draws depend on the batch's shape, which padding-free changes
    common = [*tiny_qwen3["swift_flags"], "--dataset", str(data), "--tuner_type", "lora", *CPU_FLAGS,
              "--max_length", "64", "--per_device_train_batch_size", "4", "--learning_rate", "2e-3",
              "--lora_dropout", "0", "--num_train_epochs", "1", "--save_strategy", "no", "--report_to", "none"]
    torch_env = swift_env(SWIFT_LIGER_BACKEND="torch")
    specs = {  # name: (argv, env)
        "padding_free": (common + ["--padding_free", "true", "--attn_impl", "swift_liger"], None),
        "base": (common, None),
        "padding_free_liger": (common + ["--padding_free", "true", "--attn_impl", "sdpa", "--use_liger"], torch_env),
        "packing": (common + ["--packing", "true", "--packing_length", "128", "--use_liger",
                              "--per_device_train_batch_size", "1"], torch_env),
        # tiles of 32 tokens cut across the packed documents; checkpoints offloaded to (pinned) host memory
        "padding_free_long": (common + ["--padding_free", "true", "--use_liger", "--liger_tiled_mlp", "32",
                                        "--liger_offload_checkpoints", "true"], torch_env),
    }
    dpo = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["pref"], "--rlhf_type", "dpo", "--tuner_type", "lora",
           *CPU_FLAGS, "--max_length", "64", "--per_device_train_batch_size", "2", "--learning_rate", "2e-3",
           "--lora_dropout", "0", "--max_steps", str(DPO_STEPS), "--save_strategy", "no", "--report_to", "none"]
    kto = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["kto"], "--rlhf_type", "kto", "--tuner_type", "lora",
           *CPU_FLAGS, "--max_length", "64", "--per_device_train_batch_size", "4", "--learning_rate", "2e-3",
           "--lora_dropout", "0", "--max_steps", str(DPO_STEPS), "--save_strategy", "no", "--report_to", "none"]
    rlhf = {"dpo_base": (dpo, None), "dpo_padding_free_liger": (dpo + ["--padding_free", "true", "--use_liger"],
                                                                  torch_env),
            "kto_base": (kto, None), "kto_padding_free_liger": (kto + ["--padding_free", "true", "--use_liger"],
                                                                  torch_env)}
    # GKD: the llama-shaped teacher (same tokenizer) packed the same way as the student
    gkd = [*tiny_qwen3["swift_flags"], "--dataset", str(data), "--rlhf_type", "gkd", "--tuner_type", "lora",
           "--teacher_model", tiny_llama["model"], "--teacher_model_type", "llama", "--beta", "0.5", "--lmbda", "0",
           "--use_vllm", "false", *CPU_FLAGS, "--max_length", "64", "--per_device_train_batch_size", "4",
           "--learning_rate", "2e-3", "--lora_dropout", "0", "--max_steps", str(DPO_STEPS), "--save_strategy", "no",
           "--report_to", "none"]
    rlhf.update({"gkd_base": (gkd, None),
                 "gkd_padding_free_liger": (gkd + ["--padding_free", "true", "--use_liger"], torch_env)})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, "sft", argv, str(root / name), env)
                   for name, (argv, env) in specs.items()}
        futures.update({name: pool.submit(run_swift, "rlhf", argv, str(root / name), env)
                        for name, (argv, env) in rlhf.items()})
        return {name: f.result() for name, f in futures.items()}


def _tokens(row) -> int:
    return round(row["tokens/s"] * row["step_time(s)"])


def _close(a, b, atol=1e-5, rtol=1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["padding_free", "padding_free_liger", "padding_free_long"])
def test_padding_free_logs_the_padded_runs_losses(cli_runs, name):
    base, run = cli_runs["base"].check().steps(), cli_runs[name].check().steps()
    assert len(base) == len(run) >= 3, (base, run)
    for a, b in zip(base, run):   # the same rows per step, one packed row instead of a padded batch
        assert a["step"] == b["step"] and _tokens(a) == _tokens(b), (a, b)
        assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"], rtol=1e-4), (a, b)
    assert base[0]["loss"] != base[-1]["loss"]
    with open(os.path.join(cli_runs[name].run_dir, "args.json")) as f:
        args = json.load(f)
    assert args["attn_impl"] == "swift_liger" and args["padding_free"] is True


@pytest.mark.slow
def test_use_liger_says_it_switched_the_attention(cli_runs):
    log = cli_runs["padding_free_liger"].check().log
    assert log.count("--padding_free with --use_liger and --attn_impl sdpa: using --attn_impl swift_liger") == 1
    assert "swift_liger: patched the policy model" in log
    assert "using --attn_impl swift_liger" not in cli_runs["padding_free"].log
    # what ran, counted: every layer's attention of every forward and recompute through the packed-row kernel
    runtime = cli_runs["padding_free_liger"].patch_record()["runtime"]
    steps = len(cli_runs["padding_free_liger"].steps())
    first, total = runtime["first_step"]["attention"], runtime["total"]["attention"]
    assert first["impl"] == total["impl"] == "swift_liger", runtime
    assert first["sdpa"] == first["eager"] == total["sdpa"] == total["eager"] == 0, runtime
    assert first["varlen"] > 0 and total["varlen"] == steps * first["varlen"], runtime
    assert first["bounds"] > 0 and total["bounds"] == steps * first["bounds"], runtime
    assert (f"swift_liger: attention in the first step: {first['varlen']} calls through swift_liger's packed-row "
            "kernel, 0 handed to SDPA") in log


@pytest.mark.slow
def test_packing_trains_over_the_datasets_tokens(cli_runs):
    base, packed = cli_runs["base"].check().steps(), cli_runs["packing"].check().steps()
    assert packed and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in packed), packed
    assert len(packed) < 14   # 14 rows of <= 64 tokens in bins of 128: several rows per step
    assert sum(_tokens(r) for r in packed) == sum(_tokens(r) for r in base), (packed, base)
    log = cli_runs["packing"].log
    assert "--packing with --use_liger and no --attn_impl: using --attn_impl swift_liger" in log


@pytest.mark.slow
def test_dpo_padding_free_logs_the_padded_runs_metrics(cli_runs):
    """swift rlhf --rlhf_type dpo --padding_free true --use_liger (swift_liger attention chosen by itself; the
    trainer's log-probs from hidden states over the packed chosen + rejected rows) against stock padded DPO."""
    base, run = cli_runs["dpo_base"].check().steps(), cli_runs["dpo_padding_free_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in run] == list(range(1, DPO_STEPS + 1))
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    for a, b in zip(base, run):
        bad = {k: (a[k], b[k]) for k in keys if not _close(a[k], b[k], atol=1e-5, rtol=1e-4)}
        assert not bad, (a["step"], bad)
    assert "--padding_free with --use_liger and no --attn_impl: using --attn_impl swift_liger" in \
        cli_runs["dpo_padding_free_liger"].log


@pytest.mark.slow
def test_kto_padding_free_logs_the_padded_runs_metrics(cli_runs):
    """swift rlhf --rlhf_type kto --padding_free true --use_liger (the completions and their mismatched KL rows
    packed; log-probs from hidden states) against stock padded KTO over the same rows."""
    base, run = cli_runs["kto_base"].check().steps(), cli_runs["kto_padding_free_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in run] == list(range(1, DPO_STEPS + 1))
    keys = sorted(k for k in base[0] if k.startswith(("loss", "grad_norm", "rewards/", "logps/", "kl")))
    assert {"loss", "grad_norm", "kl"} <= set(keys), keys
    for a, b in zip(base, run):
        bad = {k: (a[k], b[k]) for k in keys if not _close(a[k], b[k], atol=1e-5, rtol=1e-4)}
        assert not bad, (a["step"], bad)
    assert "--padding_free with --use_liger and no --attn_impl: using --attn_impl swift_liger" in \
        cli_runs["kto_padding_free_liger"].log
    _assert_packed_attention(cli_runs["kto_padding_free_liger"])


def _assert_packed_attention(run):
    """Every attention call of the run went through the packed-row kernel (none to SDPA with a mask)."""
    att = run.patch_record()["runtime"]["total"]["attention"]
    assert att["impl"] == "swift_liger" and att["varlen"] > 0 and att["sdpa"] == att["eager"] == 0, att


@pytest.mark.slow
def test_gkd_padding_free_logs_the_padded_runs_metrics(cli_runs):
    """swift rlhf --rlhf_type gkd --padding_free true --use_liger: student and teacher on one packed row per step
    (swift_liger attention for both), the divergence from both models' hidden states, against stock padded GKD."""
    base, run = cli_runs["gkd_base"].check().steps(), cli_runs["gkd_padding_free_liger"].check().steps()
    assert [r["step"] for r in base] == [r["step"] for r in run] == list(range(1, DPO_STEPS + 1))
    for a, b in zip(base, run):
        bad = {k: (a[k], b[k]) for k in ("loss", "grad_norm") if not _close(a[k], b[k], atol=1e-5, rtol=1e-4)}
        assert not bad, (a["step"], bad)
    log = cli_runs["gkd_padding_free_liger"].log
    assert "--padding_free with --use_liger and no --attn_impl: using --attn_impl swift_liger" in log
    assert "distillation losses (generalized JSD) from hidden states" in log
    _assert_packed_attention(cli_runs["gkd_padding_free_liger"])


@pytest.mark.slow
def test_tiled_mlp_and_offloaded_checkpoints_on_packed_rows(cli_runs):
    """The padding_free_long run (its losses checked above against the padded run): tiles of 32 tokens cut across
    the packed documents, and every decoder layer's checkpoint went to the host and came back."""
    run = cli_runs["padding_free_long"].check()
    record = run.patch_record()
    report = record["models"]["policy"]["report"]
    assert report["patched"]["tiled_mlp"] > 0 and report["patched"]["offload_checkpoints"] > 0, report
    first = record["runtime"]["first_step"]["policy"]["offloaded_checkpoints"]
    assert first["offloaded"] == report["patched"]["offload_checkpoints"] > 0, first
    assert first["prefetched"] + first["fetched_late"] == first["offloaded"], first
    _assert_packed_attention(run)
