"""The flags inside real ms-swift (in-process, no training): field injection, names, presets vs flags, toggles, errors.

Importing ms-swift costs ~10 s once; everything else here is milliseconds per case.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

import pytest
import yaml

from swift_liger.config import LigerConfig
from swift_liger.integration import arguments as liger_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUSIONS = ("rms_norm", "rope", "qk_norm_rope", "swiglu", "cross_entropy")


@pytest.fixture(scope="module")
def swift_mod():
    from swift.arguments import PretrainArguments, RLHFArguments, SftArguments
    from swift.cli.main import parse_yaml_args
    from swift.pipelines.train.tuner import TunerMixin
    from swift.utils import parse_args
    return dict(sft=SftArguments, pt=PretrainArguments, rlhf=RLHFArguments, parse=parse_args,
                yaml_argv=parse_yaml_args, tuner=TunerMixin)


@pytest.fixture
def base_argv(tiny_qwen3, tmp_path):
    return [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--check_model", "false",
            "--tuner_type", "lora", "--output_dir", str(tmp_path / "out")]


def parse(swift_mod, argv, kind="sft"):
    args, remaining = swift_mod["parse"](swift_mod[kind], argv)
    assert remaining == []
    return args


def test_fields_exist_and_collide_with_nothing(swift_mod):
    for kind in ("sft", "pt", "rlhf"):
        names = [f.name for f in dataclasses.fields(swift_mod[kind])]
        for ours in liger_args.FIELD_NAMES:
            assert names.count(ours) == 1, (kind, ours)
        theirs = [n for n in names if n not in liger_args.FIELD_NAMES]
        for ours in liger_args.FIELD_NAMES:
            prefixed = [n for n in theirs if n.startswith(ours)]
            # use_liger is a prefix of ms-swift's use_liger_kernel on purpose: argparse takes the exact match
            assert prefixed == (["use_liger_kernel"] if ours == "use_liger" else []), (kind, ours, prefixed)
            assert not any(ours.startswith(n) and n != ours for n in theirs), (kind, ours)


def test_use_liger_is_ours_not_a_prefix_of_use_liger_kernel(swift_mod, base_argv):
    args = parse(swift_mod, base_argv + ["--use_liger"])
    assert args.use_liger is True and args.use_liger_kernel is False
    cfg, notes = liger_args.resolved(args)
    assert cfg == LigerConfig(drop_pad_mask=True) and notes == []   # on under ms-swift only (its losses drop pads)
    assert cfg.to_dict() == liger_args.swift_defaults()
    preset = liger_args.resolved(parse(swift_mod, base_argv + ["--use_liger", "--liger_config", "default"]))[0]
    assert preset == cfg   # the default preset is what --use_liger takes
    assert args.liger_metrics is True
    plain = parse(swift_mod, base_argv)
    assert plain.use_liger is False and liger_args.resolved(plain) is None
    assert parse(swift_mod, base_argv + ["--no_liger_metrics"]).liger_metrics is False


def test_bad_flags_fail_while_parsing(swift_mod, base_argv, tmp_path):
    with pytest.raises(ValueError, match="pass only one"):
        parse(swift_mod, base_argv + ["--use_liger", "--use_liger_kernel", "true"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rms_norm: true\nfused_everything: true\n")
    with pytest.raises(ValueError, match="unknown swift_liger config key.*fused_everything"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_config", str(bad)])
    with pytest.raises(ValueError, match="neither a file nor a known preset"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_config", "no_such_preset"])
    with pytest.raises(ValueError, match="swift_liger flags: --liger_cross_entropy must be one of"):   # the flag
        parse(swift_mod, base_argv + ["--use_liger", "--liger_cross_entropy", "fast"])
    with pytest.raises(ValueError, match="without --use_liger"):
        parse(swift_mod, base_argv + ["--liger_config", "minimal"])
    with pytest.raises(ValueError, match=r"--liger_tiled_mlp must be tokens per tile \(an integer >= 0"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_tiled_mlp", "-5"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("rms_norm: [true\n")
    with pytest.raises(ValueError, match="liger_config .*broken.yaml.* is not valid YAML"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_config", str(broken)])
    with pytest.raises(ValueError, match="unknown swift_liger config key"):   # a preset value keeps the key's name
        parse(swift_mod, base_argv + ["--use_liger", "--liger_config", str(bad)])


def test_yaml_preset_and_cli_flags_agree(swift_mod, base_argv, tmp_path):
    cfg_file = tmp_path / "run.yaml"
    # unquoted `off` is YAML false: ms-swift turns it into the string "False", which must still mean "off"
    cfg_file.write_text("use_liger: true\nliger_config: minimal\nliger_swiglu: true\nliger_cross_entropy: off\n"
                        "liger_rolling_cache: {window: 64, sinks: 4}\n")
    argv = [str(cfg_file)]
    swift_mod["yaml_argv"](argv)  # exactly what `swift sft run.yaml ...` does
    from_yaml = liger_args.resolved(parse(swift_mod, argv + base_argv))[0]
    from_cli = liger_args.resolved(parse(swift_mod, base_argv + [
        "--use_liger", "--liger_config", os.path.join(REPO, "configs", "liger", "minimal.yaml"),
        "--liger_swiglu", "--liger_cross_entropy", "off", "--liger_rolling_cache", "64,4"]))[0]
    from_flags = liger_args.resolved(parse(swift_mod, base_argv + [
        "--use_liger", "--liger_swiglu", "true", "--liger_qk_norm_rope", "false", "--liger_cross_entropy", "off",
        "--liger_lora_fusion", "false", "--liger_graph_layers", "false", "--liger_drop_pad_mask", "false",
        "--liger_rolling_cache", '{"window": 64, "sinks": 4}']))[0]
    expected = LigerConfig(rms_norm=True, rope=True, swiglu=True, cross_entropy="off", qk_norm_rope=False,
                           lora_fusion=False, graph_layers=False, rolling_cache={"window": 64, "sinks": 4})
    assert from_yaml == from_cli == from_flags == expected


@pytest.mark.parametrize("name", ["default", "minimal", "off", "keep_logits", "compiled", "fp8"])
def test_presets_load(name):
    path = liger_args.find_preset(name)
    assert path == os.path.join(REPO, "configs", "liger", f"{name}.yaml")
    LigerConfig.from_yaml(path)
    # wheels ship the presets as shared data (<prefix>/share/swift-liger/configs/liger), found without the repo
    installed = os.path.join(sys.prefix, "share", "swift-liger", "configs", "liger")
    assert installed in liger_args.preset_dirs()
    assert os.path.isfile(os.path.join(installed, f"{name}.yaml")), "reinstall: pip install -e ."


def test_shipped_run_configs_only_use_known_keys(swift_mod):
    known = {f.name for f in dataclasses.fields(swift_mod["rlhf"])}
    files = sorted(glob.glob(os.path.join(REPO, "configs", "sft", "*.yaml")) +
                   glob.glob(os.path.join(REPO, "configs", "rlhf", "*.yaml")))
    assert len(files) >= 6
    for path in files:
        with open(path) as f:
            data = yaml.safe_load(f)
        unknown = set(data) - known - {"ENV"}
        assert not unknown, (path, unknown)
        assert data["use_liger"] is True, path
        ns = argparse_namespace(data)
        liger_args.validate(ns)  # presets and per-fusion keys resolve
        assert liger_args.resolved(ns) is not None


def argparse_namespace(data):
    import types
    values = {name: default for name, _, default, _ in liger_args.FIELDS}
    values.update({k: v for k, v in data.items() if k in values})
    values["use_liger_kernel"] = False
    return types.SimpleNamespace(**values)


@pytest.fixture(scope="module")
def prepared(swift_mod, tiny_qwen3, tmp_path_factory):
    """Run ms-swift's real TunerMixin.prepare_model (our seam + LoRA) per flag set; returns liger_patch.json."""
    root = tmp_path_factory.mktemp("prepare")

    def run(*flags):
        out = root / f"run{len(list(root.iterdir()))}"
        argv = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--check_model", "false",
                "--tuner_type", "lora", "--output_dir", str(out), "--use_liger", *flags]
        args = parse(swift_mod, argv)
        model, _ = args.get_model_processor()  # ms-swift's loader (sets model_meta etc.), as in `swift sft`
        wrapped = swift_mod["tuner"].prepare_model(args, model)
        assert type(wrapped).__name__.startswith("PeftModel"), "LoRA must wrap the patched model"
        with open(os.path.join(args.output_dir, "liger_patch.json")) as f:
            return json.load(f)
    return run


def test_each_toggle_switches_exactly_its_fusion(prepared):
    base = prepared()["models"]["policy"]["report"]["patched"]
    assert all(base[f] > 0 for f in FUSIONS), base
    # rope off takes qk_norm_rope with it (the fused q/k norm is part of the rotation)
    cases = {"rms_norm": {"rms_norm"}, "rope": {"rope", "qk_norm_rope"}, "swiglu": {"swiglu"},
             "qk_norm_rope": {"qk_norm_rope"}, "cross_entropy": {"cross_entropy"}}
    for fusion, off in cases.items():
        value = "off" if fusion == "cross_entropy" else "false"
        record = prepared(f"--liger_{fusion}", value)
        patched = record["models"]["policy"]["report"]["patched"]
        assert record["config"][fusion] in (False, "off")
        assert {f for f in FUSIONS if patched[f] == 0} == off, (fusion, patched)
        expected = dict(base)
        if "qk_norm_rope" in off:  # q_norm/k_norm then run as plain RMSNorm kernels (one each per attention)
            expected["rms_norm"] += 2 * base["qk_norm_rope"]
        assert all(patched[f] == expected[f] for f in FUSIONS if f not in off), (fusion, patched)
    fused = prepared("--liger_cross_entropy", "fused")["models"]["policy"]["report"]
    assert fused["cross_entropy_mode"] == "fused" and fused["patched"]["cross_entropy"] == 1


def test_labels_popped_falls_back_to_fused(prepared):
    # a custom loss function reads outputs.logits itself (Seq2SeqTrainer.compute_loss): fused, on logits
    record = prepared("--loss_type", "cross_entropy")
    assert record["config"]["cross_entropy"] == "fused"
    assert record["models"]["policy"]["report"]["cross_entropy_mode"] == "fused"
    (note,) = record["notes"]
    assert note.startswith("cross_entropy fused_linear -> fused") and "loss_type=cross_entropy" in note
    assert prepared("--loss_scale", "ignore_empty_think")["config"]["cross_entropy"] == "fused_linear"


def test_per_token_weights_keep_fused_linear(prepared):
    # a non-binary loss_scale, DFT, channel loss and label smoothing: losses from hidden states (preference.SFTSeam)
    record = prepared("--loss_scale", "react", "--enable_dft_loss", "true", "--label_smoothing_factor", "0.1")
    assert record["config"]["cross_entropy"] == "fused_linear"
    (note,) = record["notes"]
    assert ("per-token losses for enable_dft_loss, label_smoothing_factor=0.1, loss_scale=react" in note
            and "come from hidden states" in note), note


def test_info_lists_the_presets(monkeypatch, capsys):
    from swift_liger import cli
    monkeypatch.delenv(liger_args.PRESET_DIR_ENV, raising=False)
    assert cli.main(["info"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "presets (--liger_config NAME): " + ", ".join(liger_args.preset_names()), line
    assert {"default", "off", "long_context", "fp8"} <= set(liger_args.preset_names())


def test_readme_flags_table_is_the_generated_one(monkeypatch):
    monkeypatch.delenv(liger_args.PRESET_DIR_ENV, raising=False)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    begin = readme.index("-->", readme.index("<!-- flags:begin")) + 3
    table = readme[begin:readme.index("<!-- flags:end -->")].strip()
    assert table == liger_args.flags_markdown(), "README flags table is stale: paste `swift-liger flags` into it"
    for name in liger_args.FIELD_NAMES:
        assert f"`--{name}`" in table
    for name in liger_args.ENV_VARS:
        assert f"`{name}`" in table


@pytest.mark.parametrize("token, hint", [
    ("--liger_rms_nrom", "--liger_rms_norm"), ("--liger_rms", "--liger_rms_norm"),
    ("--liger-rms=true", "--liger_rms_norm"),
    ("--use_ligr", "--use_liger"), ("--liger_crossentropy", "--liger_cross_entropy"), ("--liger_xyz", None),
])
def test_argv_check_refuses_unknown_and_abbreviated_flags(swift_mod, token, hint):
    with pytest.raises(ValueError, match="unknown flag") as err:
        liger_args.check_argv(swift_mod["sft"], ["--model", "m", token, "true"])
    if hint:
        assert f"(did you mean {hint}?)" in str(err.value)


def test_argv_check_passes_exact_names_and_other_flags(swift_mod):
    argv = ["--use_liger", "--liger_rope", "false", "--liger-swiglu=true", "--use_liger_kernel", "false", "--lr", "1"]
    liger_args.check_argv(swift_mod["rlhf"], argv)   # ms-swift's own flags (and its use_liger_kernel) are not ours
    liger_args.check_argv(dict, ["--liger_anything"])   # not an arguments class with our fields: nothing to check


@pytest.mark.parametrize("env, match", [
    ({"SWIFT_LIGER_BACKEND": "cuda"}, "SWIFT_LIGER_BACKEND must be one of auto, triton, torch; got 'cuda'"),
    ({"SWIFT_LIGER_PEAK_TFLOPS": "fast"}, "SWIFT_LIGER_PEAK_TFLOPS must be a number > 0"),
    ({"SWIFT_LIGER_PEAK_TFLOPS": "-3"}, "SWIFT_LIGER_PEAK_TFLOPS must be a number > 0"),
    ({"SWIFT_LIGER_PRESET_DIR": "/no/such/dir"}, "is not a directory"),
    ({"SWIFT_LIGER_FAST_LAUNCH": "yes"}, "SWIFT_LIGER_FAST_LAUNCH must be 0 or 1, got 'yes'"),
    ({"SWIFT_LIGER_GRAPH_LAYERS": "on"}, "SWIFT_LIGER_GRAPH_LAYERS must be measure or always, got 'on'"),
    ({"SWIFT_LIGER_COMPILE_AHEAD": "true"}, "SWIFT_LIGER_COMPILE_AHEAD must be 0 or 1, got 'true'"),
    ({"SWIFT_LIGER_GRAPH_NO_GRAD": "on"}, "SWIFT_LIGER_GRAPH_NO_GRAD must be 0 or 1, got 'on'"),
    ({"SWIFT_LIGER_LORA_BASE_EPILOGUE": "yes"}, "SWIFT_LIGER_LORA_BASE_EPILOGUE must be 0 or 1, got 'yes'"),
    ({"SWIFT_LIGER_FP8_HW_CVT": "on"}, "SWIFT_LIGER_FP8_HW_CVT must be 0 or 1, got 'on'"),
    ({"SWIFT_LIGER_PROFILE_FIRST_STEP": "yes"}, "SWIFT_LIGER_PROFILE_FIRST_STEP must be a number of rows"),
    ({"SWIFT_LIGER_BACKEND": "triton", "TRITON_INTERPRET": "0"}, "needs TRITON_INTERPRET=1"),
])
def test_environment_is_checked(monkeypatch, env, match):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        liger_args.check_environment()


@pytest.mark.parametrize("argv,requested", [
    (["--model", "m", "--use_liger"], True), (["--use_liger", "true"], True), (["--use_liger=1"], True),
    (["--use_liger", "false"], False), (["--use_liger", "--model", "m"], True), (["--liger_swiglu", "false"], True),
    (["--model", "m", "--use_liger_kernel", "true"], False), (["--model", "m"], False)])
def test_megatron_liger_request_detection(argv, requested):
    from swift_liger.integration.swift_patches import _liger_requested
    assert _liger_requested(argv) is requested


def test_megatron_with_use_liger_is_refused_before_anything_starts(tmp_path):
    """`megatron sft --use_liger` (and a YAML config with use_liger) exits at once naming what is supported; without
    our flags the megatron CLI is untouched."""
    import subprocess
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model: /nonexistent\nuse_liger: true\n")
    for args in (["sft", "--model", "/nonexistent", "--use_liger"], ["rlhf", str(cfg)]):
        proc = subprocess.run([sys.executable, "-c", "import sys; from swift.cli._megatron.main import cli_main; "
                               "sys.argv = ['megatron', *sys.argv[1:]]; cli_main()", *args],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode != 0 and f"do not apply to `megatron {args[0]}`" in proc.stderr, proc.stderr[-2000:]
        assert "swift sft|pt|rlhf --use_liger" in proc.stderr
        assert "zero2" not in proc.stderr and "DeepSpeed has not been run" in proc.stderr   # claims what was run


@pytest.mark.parametrize("flag,value,name", [("--liger_tiled_mlp", "\u00b2", "liger_tiled_mlp"),
                                             ("--liger_offload_checkpoints", "\u00b3", "liger_offload_checkpoints"),
                                             ("--liger_rolling_cache", "\u00b2,4", "liger_rolling_cache"),
                                             ("--liger_rolling_cache", "64,\u00b9", "liger_rolling_cache")])
def test_integer_flags_refuse_non_ascii_digits_naming_the_flag(swift_mod, base_argv, flag, value, name):
    """'²'.isdigit() is True but int('²') fails: such a value is refused with the flag's name, not int()'s message."""
    with pytest.raises(ValueError, match=name) as info:
        parse(swift_mod, base_argv + ["--use_liger", flag, value])
    assert "invalid literal" not in str(info.value)


def test_peak_tflops_checked_without_use_liger(swift_mod, base_argv, monkeypatch):
    """The per-step metrics (MFU) run without --use_liger too, so their environment variable is checked there,
    while the arguments are parsed; with --liger_metrics false nothing reads it."""
    monkeypatch.setenv("SWIFT_LIGER_PEAK_TFLOPS", "-1")
    with pytest.raises(ValueError, match="SWIFT_LIGER_PEAK_TFLOPS must be a number > 0"):
        parse(swift_mod, base_argv)
    assert parse(swift_mod, base_argv + ["--liger_metrics", "false"]).use_liger is False


def test_commands_we_do_not_patch_refuse_our_flags_by_name(tmp_path):
    """`swift export --use_liger` (any ms-swift command whose arguments have no liger fields): our flags are named
    and refused while parsing, instead of ms-swift's bare 'remaining_argv: [...]'; its own flags pass."""
    import subprocess
    from swift.arguments import ExportArguments
    with pytest.raises(ValueError, match=r"--use_liger does not apply to this command \(ExportArguments\)"):
        liger_args.check_argv(ExportArguments, ["--model", "m", "--use_liger"])
    with pytest.raises(ValueError, match="--liger_rope does not apply"):
        liger_args.check_argv(ExportArguments, ["--liger-rope=false"])
    liger_args.check_argv(ExportArguments, ["--model", "m", "--use_liger_kernel", "false"])   # ms-swift's own
    proc = subprocess.run([sys.executable, "-m", "swift.cli.main", "export", "--model", "/nonexistent", "--use_liger"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert proc.returncode != 0
    assert "--use_liger does not apply to this command" in proc.stderr, proc.stderr[-2000:]
    assert "ValueError: remaining_argv" not in proc.stderr, proc.stderr[-2000:]


def test_command_line_refusals_are_one_line_errors(tmp_path):
    """A refused flag on the command line ends the run with exit status 2 and the message alone on stderr, as
    argparse reports a bad flag (no traceback through ms-swift's parser); nothing is written to the output dir."""
    import subprocess
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for flags, message in ((["--liger_tiled_mlp", "3x"], "error: swift_liger flags: --liger_tiled_mlp must be"),
                           (["--liger_tiled_mpl", "3"], "did you mean --liger_tiled_mlp?")):
        proc = subprocess.run([sys.executable, "-m", "swift.cli.main", "sft", "--model", "/nonexistent", "--dataset",
                               "x.jsonl", "--output_dir", str(tmp_path / "out"), "--use_liger", *flags],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_yaml_list_for_a_liger_key_is_refused_naming_it(swift_mod, tmp_path):
    """ms-swift turns a YAML list into several values after the flag; ours take one, so the key is named while the
    arguments are checked (before any run directory), not left to ms-swift's remaining-arguments error."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nuse_liger: true\nliger_tiled_mlp: [64, 32]\n")
    argv = [str(cfg)]
    swift_mod["yaml_argv"](argv)
    assert argv[-3:] == ["--liger_tiled_mlp", "64", "32"]
    with pytest.raises(ValueError, match=r"--liger_tiled_mlp takes one value, got 2 \(64 32\)"):
        liger_args.check_argv(swift_mod["sft"], argv)
    liger_args.check_argv(swift_mod["sft"], ["--use_liger", "--liger_tiled_mlp", "64", "--model", "m"])
    liger_args.check_argv(swift_mod["sft"], ["--use_liger", "true", "--liger_rope=false", "--lora_target", "a", "b"])


@pytest.mark.parametrize("extra, match", [
    (["--liger_offload_checkpoints", "true", "--gradient_checkpointing", "false"], "needs --gradient_checkpointing"),
    (["--liger_save_attention", "true", "--gradient_checkpointing", "false"], "needs --gradient_checkpointing"),
    (["--liger_rope", "false", "--liger_qk_norm_rope", "true"], "needs liger_rope true"),
    (["--liger_offload_checkpoints", "999"], "but the model has 2"),
])
def test_settings_that_cannot_take_effect_are_refused(swift_mod, base_argv, extra, match):
    """Accepted before and then doing nothing (or told only after step 1): refused while the arguments are parsed,
    before any run directory exists."""
    with pytest.raises(ValueError, match=match):
        parse(swift_mod, base_argv + ["--use_liger", *extra])
    assert not os.path.exists(base_argv[base_argv.index("--output_dir") + 1])
    parse(swift_mod, base_argv + ["--use_liger", "--liger_rope", "false"])   # qk_norm_rope from the preset: fine
    parse(swift_mod, base_argv + ["--use_liger", "--liger_offload_checkpoints", "2"])


def test_rolling_cache_graph_needs_cuda(swift_mod, base_argv):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present: ',graph' is valid")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_rolling_cache", "64,4,graph"])


def test_rolling_cache_with_vllm_rollouts_is_refused_before_a_run_directory_exists(swift_mod, base_argv):
    argv = base_argv + [
        "--rlhf_type", "grpo", "--use_vllm", "true", "--vllm_mode", "colocate", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--reward_funcs", "accuracy"]
    env = dict(os.environ)   # ms-swift's vLLM colocate setup exports RANK / WORLD_SIZE / ... before our check runs
    try:
        with pytest.raises(ValueError, match="with --use_vllm true the grpo rollouts run in vLLM instead"):
            parse(swift_mod, argv + ["--use_liger", "--liger_rolling_cache", "exact"], kind="rlhf")
    finally:   # later tests in this process must not look distributed
        os.environ.clear()
        os.environ.update(env)
    assert not os.path.exists(base_argv[base_argv.index("--output_dir") + 1])


def test_model_window_on_a_model_without_sliding_layers_is_refused_while_parsing(swift_mod, base_argv):
    """`--liger_rolling_cache model` on qwen3 without sliding layers: an error before the model loads (it was a
    warning after loading, an error only under --liger_strict)."""
    with pytest.raises(ValueError, match="liger_rolling_cache model: .*needs sliding-window layers"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_rolling_cache", "model"])
    assert not os.path.exists(base_argv[base_argv.index("--output_dir") + 1])


def test_training_only_fusions_are_not_patched_into_inference(tiny_qwen3, tmp_path):
    """swift infer / deploy do not train: an explicit --liger_offload_checkpoints / --liger_save_attention is refused;
    from a preset (long_context) they are switched off, and the notes say so."""
    from swift.arguments import InferArguments
    from swift.utils import parse_args
    argv = [*tiny_qwen3["swift_flags"], "--use_liger", "--infer_backend", "transformers"]
    for flag in ("--liger_offload_checkpoints", "--liger_save_attention"):
        with pytest.raises(ValueError, match="does not train"):
            parse_args(InferArguments, argv + [flag, "true"])
    args, _ = parse_args(InferArguments, argv + ["--liger_config", "long_context"])
    cfg, notes = liger_args.resolved(args)
    assert cfg.offload_checkpoints is False and cfg.tiled_mlp == 8192
    assert any("offload_checkpoints off: training only" in n for n in notes), notes
    args, _ = parse_args(InferArguments, argv)   # the default preset's graph_layers: off, and said
    cfg, notes = liger_args.resolved(args)
    assert cfg.graph_layers is False and "graph_layers off: it replays training's gradient checkpoints " \
        "(InferArguments does not train)" in notes, notes
    assert cfg.drop_pad_mask is False and "drop_pad_mask off: InferArguments does not train" in notes, notes
    with pytest.raises(ValueError, match="liger_graph_layers replays training's reentrant gradient checkpoints"):
        parse_args(InferArguments, argv + ["--liger_graph_layers", "true"])


def test_graph_layers_off_without_gradient_checkpointing(swift_mod, base_argv):
    """graph_layers replays reentrant checkpoints: with --gradient_checkpointing false the preset's setting is
    switched off (and said); an explicit flag is refused before the run directory exists."""
    with pytest.raises(ValueError, match="liger_graph_layers replays .* --gradient_checkpointing false here"):
        parse(swift_mod, base_argv + ["--use_liger", "--gradient_checkpointing", "false", "--liger_graph_layers",
                                      "true"])
    assert not os.path.exists(base_argv[base_argv.index("--output_dir") + 1])
    args = parse(swift_mod, base_argv + ["--use_liger", "--gradient_checkpointing", "false"])
    cfg, notes = liger_args.resolved(args)
    assert cfg.graph_layers is False and cfg.rms_norm is True
    assert "graph_layers off: it replays training's gradient checkpoints (--gradient_checkpointing false)" in notes
    assert liger_args.resolved(parse(swift_mod, base_argv + ["--use_liger"]))[0].graph_layers is True


def test_tiny_mlp_tiles_are_warned(swift_mod, base_argv):
    """--liger_tiled_mlp 3 is valid but runs the MLP 3 tokens at a time: said while parsing, and in the notes."""
    with pytest.warns(UserWarning, match="liger_tiled_mlp=3: the MLP runs 3 tokens at a time"):
        args = parse(swift_mod, base_argv + ["--use_liger", "--liger_tiled_mlp", "3"])
    assert any("liger_tiled_mlp=3" in n for n in liger_args.resolved(args)[1])


def test_rolling_cache_with_rollouts_is_refused_under_vllm_and_judged_against_max_length():
    """GRPO / GKD rollouts: with --use_vllm true the pt engine (the only one we patch) does not generate, so
    liger_rolling_cache is refused naming the fix; a ring of at least --max_length slots is exact (said), a shorter
    one is warned (the policy would sample from a shortened context), "exact" is said to be exact."""
    import types
    cfg = LigerConfig(rolling_cache={"window": 100, "sinks": 4})
    args = types.SimpleNamespace(rlhf_type="grpo", use_vllm=True, max_length=50, max_completion_length=54,
                                 liger_rolling_cache="100,4")
    with pytest.raises(ValueError, match="--use_vllm false"):
        liger_args.check_takes_effect(args, cfg)
    assert liger_args.rollout_cache(args, cfg) == (cfg, [])
    args.use_vllm = False
    assert ("104 slots >= --max_length 50 + --max_completion_length 54: exact attention"
            in liger_args.rollout_cache(args, cfg)[1][0])
    args.max_completion_length = 55   # one token past the ring: warned
    with pytest.warns(UserWarning, match="shortened context"):
        liger_args.rollout_cache(args, cfg)
    args.max_length, args.rlhf_type = 4096, "gkd"
    with pytest.warns(UserWarning, match="shortened context"):
        assert "exact,graph is exact" in liger_args.rollout_cache(args, cfg)[1][0]
    exact = LigerConfig(rolling_cache={"window": "exact", "sinks": 0, "cuda_graph": True})
    assert "new tokens: exact attention, CUDA-graph decode steps" in liger_args.rollout_cache(args, exact)[1][0]
    assert liger_args.rollout_cache(types.SimpleNamespace(rlhf_type="dpo"), cfg) == (cfg, [])
    args.liger_rolling_cache = "none"   # said explicitly: no default
    assert liger_args.rollout_cache(args, LigerConfig()) == (LigerConfig(), [])


@pytest.mark.parametrize("cuda,extra,expect", [
    (True, {}, "exact,graph (the default for grpo"),
    (False, {}, "keep transformers' cache (no CUDA GPU)"),
    (True, {"deepspeed": "zero3"}, "keep transformers' cache (--deepspeed zero3"),
    (True, {"quant_bits": 4}, "keep transformers' cache (--quant_bits 4"),
    (True, {"model_type": "phi3"}, "keep transformers' cache (model_type phi3"),
    (True, {"use_vllm": True}, None),
])
def test_grpo_rollouts_default_to_exact_graph_decode_where_measured(monkeypatch, cuda, extra, expect):
    """Unset liger_rolling_cache in GRPO with the pt engine: "exact,graph" on a CUDA GPU (every decode step a graph
    replay on a ring that never evicts), transformers' cache (said why) for sharded, quantized or uncovered models and
    without CUDA; nothing with vLLM."""
    import types

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = types.SimpleNamespace(rlhf_type="grpo", use_vllm=False, max_length=None, liger_rolling_cache=None,
                                 model_type="qwen2", deepspeed=None, fsdp="", quant_bits=None, quant_method=None)
    for k, v in extra.items():
        setattr(args, k, v)
    cfg, notes = liger_args.rollout_cache(args, LigerConfig())
    if expect is None:
        assert notes == [] and cfg.rolling_cache is None
        return
    assert len(notes) == 1 and expect in notes[0], notes
    on = expect.startswith("exact")
    assert cfg.rolling_cache == ({"window": "exact", "sinks": 0, "mode": "absolute", "cuda_graph": True} if on
                                 else None)


def test_fp8_base_is_refused_where_it_cannot_apply(swift_mod, base_argv, monkeypatch, tiny_qwen3):
    """--liger_fp8_base: on a machine without an FP8 GPU it names the GPUs that have one; with train types, DoRA,
    quantized bases and swift infer it names the conflict; all before a run directory exists. With the test
    emulation on CPU the flag parses."""
    import torch

    from swift_liger.patching.fp8 import EMULATE_ENV
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"FP8 tensor cores \(sm_89\+: L4, L40S, RTX 4090, H100"):
            parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "true"])
    monkeypatch.setenv(EMULATE_ENV, "1")
    args = parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "true"])
    assert liger_args.resolved(args)[0].fp8_base is True
    args = parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "all"])
    assert liger_args.resolved(args)[0].fp8_base == "all"
    from swift_liger.integration.swift_patches import _config_for
    assert _config_for(args, "teacher")[0].fp8_base == "all" and _config_for(args, "policy")[0].fp8_base == "all"
    args = parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "lora"])
    assert _config_for(args, "ref")[0].fp8_base is False     # no LoRA trains on a side model
    with pytest.raises(ValueError, match="--liger_fp8_base must be true .* false, or all"):
        parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "maybe"])
    out = base_argv.index("--output_dir") + 1
    refused_dir = base_argv[out] + "_refused"
    lora = base_argv.index("--tuner_type") + 1
    bad = {("--tuner_type", "full"): "needs --tuner_type lora .* the base weights train",
           ("--use_dora", "true"): "--use_dora true reads the base weight",
           ("--quant_bits", "4"): "--quant_bits 4 already loads the base quantized",
           ("--liger_compile_layers", "true"): "does not run with liger_compile_layers"}
    for extra, match in bad.items():
        argv = list(base_argv)
        argv[out] = refused_dir
        if extra[0] == "--tuner_type":
            argv[lora] = extra[1]
        else:
            argv += list(extra)
        with pytest.raises(ValueError, match=match):
            parse(swift_mod, argv + ["--use_liger", "--liger_fp8_base", "true"])
    assert not os.path.exists(refused_dir)
    from swift.arguments import InferArguments
    from swift.utils import parse_args
    with pytest.raises(ValueError, match="liger_fp8_base .* is a training setting"):
        parse_args(InferArguments, [*tiny_qwen3["swift_flags"], "--use_liger", "--infer_backend", "transformers",
                                    "--liger_fp8_base", "true"])


def test_fp8_bases_on_an_unpatched_model_warn_and_do_nothing(swift_mod, base_argv, monkeypatch, caplog):
    """An unsupported model type trains unpatched (warned): fp8_bases after the tuner says nothing is stored in FP8
    instead of failing the run."""
    import logging

    import torch

    from swift_liger.integration.swift_patches import fp8_bases
    from swift_liger.patching.fp8 import EMULATE_ENV
    monkeypatch.setenv(EMULATE_ENV, "1")
    args = parse(swift_mod, base_argv + ["--use_liger", "--liger_fp8_base", "true"])
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with caplog.at_level(logging.WARNING):
        fp8_bases(args, plain)
    assert "the policy model is not patched, so nothing is stored in FP8" in caplog.text
    assert type(plain[0].weight) is torch.nn.Parameter


@pytest.mark.parametrize("rlhf_type", ["cpo", "orpo", "simpo", "dpo"])
def test_drop_pad_mask_is_off_where_trl_averages_logits_over_pads(swift_mod, base_argv, rlhf_type):
    """trl's CPO/ORPO trainers log logits/chosen and logits/rejected as means over every position, pads included: the
    default turns drop_pad_mask off there (said in the notes); an explicit flag is kept; DPO's means are masked."""
    args = parse(swift_mod, base_argv + ["--rlhf_type", rlhf_type, "--use_liger"], kind="rlhf")
    cfg, notes = liger_args.resolved(args)
    assert cfg.drop_pad_mask is (rlhf_type == "dpo")
    assert any(n.startswith("drop_pad_mask off") for n in notes) is (rlhf_type != "dpo"), notes
    flag = parse(swift_mod, base_argv + ["--rlhf_type", rlhf_type, "--use_liger", "--liger_drop_pad_mask", "true"],
                 kind="rlhf")
    assert liger_args.resolved(flag)[0].drop_pad_mask is True
