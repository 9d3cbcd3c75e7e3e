"""`swift-liger ab`: what each run is given (no swift process started): the stock run is stock even when the
config or the flags carry swift_liger settings, presets and other --liger_* flags reach the patched runs, and the help
is the whole help."""
from __future__ import annotations

import json

import pytest
import yaml

from swift_liger import ab


def _runs(each=False, fusions=("swiglu",)):
    return ab.variants(each, list(fusions))


def test_stock_run_gets_a_config_without_our_keys(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: m\nuse_liger: true\nliger_config: minimal\nliger_swiglu: true\nuse_liger_kernel: false\n")
    out = tmp_path / "ab"
    stock, liger = ab.commands("sft", [str(cfg), "--max_steps", "3"], str(out), _runs(), python="py")
    assert stock[4] != str(cfg) and liger[4] == str(cfg)                  # the config file stays first
    data = yaml.safe_load(open(stock[4]))
    assert data == {"model": "m", "use_liger_kernel": False}               # ms-swift's own key stays
    assert "--use_liger" not in stock and liger[-3:] == ["--use_liger", "--output_dir", str(out / "use_liger")]
    js = tmp_path / "cfg.json"
    js.write_text(json.dumps({"model": "m", "use_liger": True}))
    stock, _ = ab.commands("sft", [str(js)], str(out), _runs(), python="py")
    assert json.load(open(stock[4])) == {"model": "m"}


def test_presets_and_other_liger_flags_reach_only_the_patched_runs(tmp_path):
    args = ["--model", "m", "--liger_config", "long_context", "--liger-rope=false", "--use_liger_kernel", "false"]
    ab.check_swift_args(args, ("swiglu",))                                   # not refused
    runs = _runs(each=True)
    stock, liger, no_swiglu = ab.commands("sft", args, str(tmp_path), runs, python="py")
    assert stock[4:] == ["--model", "m", "--use_liger_kernel", "false", "--output_dir", str(tmp_path / "stock")]
    assert liger[4:4 + len(args)] == args and no_swiglu[-5:-2] == ["--use_liger", "--liger_swiglu", "false"]
    with pytest.raises(SystemExit, match="--liger_swiglu is set by ab itself"):
        ab.check_swift_args(["--model", "m", "--liger_swiglu", "true"], ("swiglu",))
    ab.check_swift_args(["--model", "m", "--liger_swiglu", "true"], ())   # without --each it is the user's


def test_help_is_the_whole_help(capsys):
    from swift_liger.cli import main
    with pytest.raises(SystemExit) as info:
        main(["ab", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--each" in text and "--fusions" in text and "stock run" in text
    assert main(["ab", "--out", "x"]) == 2 and "after `--`" in capsys.readouterr().err
