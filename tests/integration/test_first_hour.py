"""A new user's mistakes through the real `swift sft` CLI: each is refused while the arguments are parsed, with the
flag, the value and what is allowed, before the model loads and before a run directory exists; `swift sft --help`
shows our flags."""
from __future__ import annotations

import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_liger.patching.families import FAMILIES

from swift_runner import CPU_FLAGS, run_swift, swift_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    base = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--tuner_type", "lora", *CPU_FLAGS,
            "--max_steps", "1", "--max_length", "64", "--report_to", "none", "--save_strategy", "no"]
    typo_yaml = root / "typo.yaml"
    typo_yaml.write_text("use_liger: true\nliger_swigul: false\n")
    # a checkpoint with a config and no weights (Phi-2: a family swift_liger does not patch): refusing it must not
    # need the weights
    phi = root / "phi2_config_only"
    phi.mkdir()
    (phi / "config.json").write_text(json.dumps({
        "model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 2048, "torch_dtype": "float32"}))
    phi_argv = ["--model", str(phi), "--model_type", "phi2", "--template", "default",
                *base[len(tiny_qwen3["swift_flags"]):]]
    specs = {
        "misspelt": (base + ["--use_liger", "--liger_rms_nrom", "true"], {}),
        "abbreviated": (base + ["--use_liger", "--liger_rms", "true"], {}),
        "yaml_typo": ([str(typo_yaml), *base], {}),
        "window_zero": (base + ["--use_liger", "--liger_rolling_cache", "0,4"], {}),
        "bad_mode": (base + ["--use_liger", "--liger_rolling_cache", '{"window": 64, "sinks": 2, "mode": "ring"}'],
                     {}),
        "bad_backend": (base + ["--use_liger"], {"SWIFT_LIGER_BACKEND": "bogus"}),
        "bad_fast_launch": (base + ["--use_liger"], {"SWIFT_LIGER_FAST_LAUNCH": "yes"}),
        "bad_graph_layers": (base + ["--use_liger"], {"SWIFT_LIGER_GRAPH_LAYERS": "on"}),
        "bad_compile_ahead": (base + ["--use_liger"], {"SWIFT_LIGER_COMPILE_AHEAD": "yes"}),
        "bad_graph_no_grad": (base + ["--use_liger"], {"SWIFT_LIGER_GRAPH_NO_GRAD": "yes"}),
        "bad_base_epilogue": (base + ["--use_liger"], {"SWIFT_LIGER_LORA_BASE_EPILOGUE": "yes"}),
        "bad_fp8_hw_cvt": (base + ["--use_liger"], {"SWIFT_LIGER_FP8_HW_CVT": "2"}),
        "strict_unsupported": (phi_argv + ["--use_liger", "--liger_strict", "true"], {}),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, "sft", argv, str(root / name), swift_env(**env))
                   for name, (argv, env) in specs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name, message", [
    ("misspelt", "unknown flag --liger_rms_nrom (did you mean --liger_rms_norm?)"),
    ("abbreviated", "unknown flag --liger_rms (did you mean --liger_rms_norm?)"),
    ("yaml_typo", "unknown flag --liger_swigul (did you mean --liger_swiglu?)"),
    ("window_zero", "window must be an int >= 1, got 0"),
    ("bad_mode", "mode must be one of absolute, streaming, got 'ring'"),
    ("bad_backend", "SWIFT_LIGER_BACKEND must be one of auto, triton, torch; got 'bogus'"),
    ("bad_fast_launch", "SWIFT_LIGER_FAST_LAUNCH must be 0 or 1, got 'yes'"),
    ("bad_graph_layers", "SWIFT_LIGER_GRAPH_LAYERS must be measure or always, got 'on'"),
    ("bad_compile_ahead", "SWIFT_LIGER_COMPILE_AHEAD must be 0 or 1, got 'yes'"),
    ("bad_graph_no_grad", "SWIFT_LIGER_GRAPH_NO_GRAD must be 0 or 1, got 'yes'"),
    ("bad_base_epilogue", "SWIFT_LIGER_LORA_BASE_EPILOGUE must be 0 or 1, got 'yes'"),
    ("bad_fp8_hw_cvt", "SWIFT_LIGER_FP8_HW_CVT must be 0 or 1, got '2'"),
    ("strict_unsupported", f"model type 'phi' is not supported (swift_liger patches {', '.join(sorted(FAMILIES))})"),
])
def test_refused_before_the_model_loads_and_no_run_directory(runs, name, message):
    run = runs[name]
    assert run.returncode != 0, run.log[-2000:]
    assert message in run.log, run.log[-3000:]
    assert "Loading weights" not in run.log
    assert not glob.glob(os.path.join(run.output_dir, "v*-*")), os.listdir(run.output_dir)


@pytest.mark.parametrize("command", ["sft", "rlhf"])
def test_help_shows_our_flags_with_defaults(tmp_path, command):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "swift.cli.main", command, "--help"], capture_output=True,
                          text=True, env=swift_env(), timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for flag in ("--use_liger", "--liger_config", "--liger_rope", "--liger_lora_fusion", "--liger_cross_entropy",
                 "--model", "--tuner_type"):
        assert flag in out, flag
    flat = " ".join(out.split())
    assert "Default: true (from the preset)" in flat
    assert "presets: compiled, default, fp8, keep_logits, long_context, minimal, off" in flat
    assert "experimental" not in flat
    ours = flat.split("--use_liger [USE_LIGER]", 2)[-1].split("--liger_metrics")[0]
    assert "(default: None)" not in ours   # "None" would be wrong: it means "the preset's value", which is stated
