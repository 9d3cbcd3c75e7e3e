"""The CLI benchmark's rlhf tasks (swift_liger.bench.swift_cli, TASKS=grpo / gkd of tools/gpu_swift_cli.sh) on CPU:
`build` writes grpo.jsonl (prompts only), `run --task grpo` trains on completions of exactly --seq tokens from
bench/grpo_plugin.py's instant rollout (no generation), `run --task gkd` distils from a second build, and `report`
describes both. Each run is the real `swift rlhf` CLI with the CPU reference backend; the numbers are not checked.
"""
from __future__ import annotations

import json
import os

import pytest

from swift_liger.bench import swift_cli

pytestmark = pytest.mark.slow

TINY = ["--layers", "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--seq", "256", "--rows", "8",
        "--pref-rows", "8", "--device", "cpu"]
COMPLETION, GENERATIONS = 24, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("bench_cli")
    student, teacher = str(root / "student"), str(root / "teacher")
    assert swift_cli.main(["build", student, "--shape", "qwen2.5-1.5b", "--hidden", "64", "--vocab", "2304",
                           *TINY]) == 0
    assert swift_cli.main(["build", teacher, "--shape", "qwen2.5-7b", "--hidden", "96", "--vocab", "2400",
                           *TINY]) == 0
    monkeypatch_module.setenv("SWIFT_LIGER_BACKEND", "torch")   # the children: PyTorch reference ops
    monkeypatch_module.delenv("TRITON_INTERPRET", raising=False)
    out = str(root / "runs")
    common = ["--variant", "swift_liger", "--out", out, "--steps", "2", "--warmup", "1", "--cpu", "--timeout", "300"]
    rc_grpo = swift_cli.main(["run", f"{student}/model", f"{student}/grpo.jsonl", "--task", "grpo", "--seq",
                              str(COMPLETION), "--generations", str(GENERATIONS), *common])
    rc_gkd = swift_cli.main(["run", f"{student}/model", f"{student}/sft.jsonl", "--task", "gkd", "--teacher",
                             f"{teacher}/model", "--seq", "256", "--cold-triton", *common])
    load = lambda name: json.load(open(os.path.join(out, f"{name}.json")))   # noqa: E731
    return {"root": root, "out": out, "student": student, "rc": (rc_grpo, rc_gkd),
            "grpo": load("grpo_lora_swift_liger"), "gkd": load("gkd_lora_swift_liger")}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_build_writes_prompt_only_grpo_rows(runs):
    rows = [json.loads(ln) for ln in open(os.path.join(runs["student"], "grpo.jsonl"))]
    assert rows and all([m["role"] for m in r["messages"]] == ["user"] for r in rows)


def test_grpo_trains_on_completions_of_exactly_seq_tokens(runs):
    res = runs["grpo"]
    assert runs["rc"][0] == 0 and "error" not in res, res.get("error")
    assert [r["step"] for r in res["rows"]] == [1, 2]
    assert all("rewards/BenchReward/mean" in r for r in res["rows"])   # the plugin was loaded
    for r in res["rows"]:   # every completion is --max_completion_length tokens: no generation stopped early
        assert r["completions/mean_length"] == r["completions/min_length"] == r["completions/max_length"] == COMPLETION
    assert any("GRPOTrainer took" in ln and "0 from materialised logits" in ln for ln in res["first_step"])
    cmd = res["command"].split()
    assert cmd.count("--per_device_train_batch_size") == cmd.count("--max_length") == 1
    assert cmd[cmd.index("--num_generations") + 1] == cmd[cmd.index("--per_device_train_batch_size") + 1] == "4"


def test_gkd_distils_from_the_teacher_build(runs):
    res = runs["gkd"]
    assert runs["rc"][1] == 0 and "error" not in res, res.get("error")
    assert len(res["rows"]) == 2
    assert any("GKDTrainer computed" in ln and "0 from materialised logits" in ln for ln in res["first_step"])
    cmd = res["command"].split()
    assert cmd[cmd.index("--lmbda") + 1] == "0" and cmd[cmd.index("--teacher_model_type") + 1] == "qwen2"


def test_reports_describe_the_rlhf_tasks(runs, tmp_path):
    grpo = swift_cli.main(["report", runs["out"], "--out", str(tmp_path), "--name", "g", "--task", "grpo",
                           "--build", runs["student"]])
    gkd = swift_cli.main(["report", runs["out"], "--out", str(tmp_path), "--name", "k", "--task", "gkd",
                          "--build", runs["student"]])
    assert grpo == gkd == 0
    assert f"{GENERATIONS} completions of exactly {COMPLETION} tokens" in (tmp_path / "g.md").read_text()
    assert "a random-init teacher (qwen2.5-7b-shaped" in (tmp_path / "k.md").read_text()


def test_cold_triton_cache_is_the_runs_own_and_removed(runs):
    """--cold-triton (the gkd run): the child got an empty TRITON_CACHE_DIR under --out, gone after the run."""
    log = open(os.path.join(runs["out"], "gkd_lora_swift_liger.log")).read()
    assert runs["rc"][1] == 0 and log
    assert not [d for d in os.listdir(runs["out"]) if d.startswith("triton_cache_")]


def test_gkd_without_a_teacher_is_refused():
    with pytest.raises(SystemExit, match="--teacher"):
        swift_cli.task_flags("gkd", 256)


def test_the_plugin_returns_max_tokens_ordinary_tokens_per_request(runs):
    """grpo_plugin's rollout itself (imported here and undone: it patches ms-swift's class on import)."""
    import importlib

    from swift.rewards import orms
    from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin
    from transformers import AutoTokenizer

    original = RolloutTrainerMixin._engine_infer
    try:
        plugin = importlib.import_module("swift_liger.bench.grpo_plugin")
        assert RolloutTrainerMixin._engine_infer is plugin._synthetic_infer
    finally:
        RolloutTrainerMixin._engine_infer = original
        orms.pop("swift_liger_bench_reward", None)
    tok = AutoTokenizer.from_pretrained(os.path.join(runs["student"], "model"))
    fake = type("Trainer", (), {"template": type("T", (), {"tokenizer": tok})()})()
    outs = plugin._synthetic_infer(fake, [object()] * 3, type("RC", (), {"max_tokens": 17})())
    assert len(outs) == 3
    special = set(tok.all_special_ids)
    for o in outs:
        choice = o.response.choices[0]
        assert len(choice.token_ids) == 17 and not special & set(choice.token_ids)
        assert choice.finish_reason == "length" and choice.message.content == tok.decode(choice.token_ids)
    assert len({tuple(o.response.choices[0].token_ids) for o in outs}) == 3   # each request its own draw
    rewards = plugin.BenchReward()(["a", "b", "a"])
    assert rewards[0] == rewards[2] != rewards[1] and all(0 <= r < 1 for r in rewards)


def test_build_reuses_another_builds_model(tmp_path):
    """--model-from links an earlier build's weights (same shape and seed, another --seq) and writes only the datasets
    of this --seq; a build of another shape is refused, naming both."""
    first, second, other = str(tmp_path / "s256"), str(tmp_path / "s512"), str(tmp_path / "wider")
    small = ["--shape", "qwen2.5-1.5b", "--hidden", "64", "--vocab", "2304", *TINY]
    assert swift_cli.main(["build", first, *small]) == 0
    seq512 = [a if a != "256" else "512" for a in small]
    assert swift_cli.main(["build", second, *seq512, "--model-from", first]) == 0
    info = json.load(open(os.path.join(second, "build.json")))
    assert os.path.islink(os.path.join(second, "model")) and info["model_from"] == os.path.realpath(f"{first}/model")
    assert info["config"]["seq"] == 512 and info["row_tokens"]["max"] > 256 and info["seconds"]["init"] == 0
    assert info["params"] == json.load(open(os.path.join(first, "build.json")))["params"]
    with pytest.raises(SystemExit, match="model exists"):   # refused before anything is written
        swift_cli.main(["build", second, *seq512, "--model-from", first])
    wider = [a if a != "64" else "96" for a in seq512]
    with pytest.raises(SystemExit, match="its model was built with"):
        swift_cli.main(["build", other, *wider, "--model-from", first])
