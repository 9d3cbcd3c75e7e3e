"""The shared benchmark harness (swift_liger.bench.harness, swift_liger.bench.shapes): the shapes registry and its
builders, environment capture, the child-process runner and report writing, on CPU."""
import dataclasses
import json
import sys

import torch

from swift_liger.bench import harness, shapes


def test_shapes_registry_holds_the_released_widths():
    s = shapes.SHAPES
    assert {"llama3-8b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "gemma2-9b", "tiny"} <= set(s)
    l8 = s["llama3-8b"]
    assert (l8.family, l8.hidden, l8.intermediate, l8.layers, l8.heads, l8.kv_heads, l8.head_dim, l8.vocab) == \
        ("llama", 4096, 14336, 32, 32, 8, 128, 128256)
    assert (l8.rope_theta, l8.rms_norm_eps, l8.tied) == (500000.0, 1e-5, False)
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"):
        q = s[name]
        assert q.family == "qwen2" and q.head_dim == q.hidden // q.heads and q.rope_theta == 1e6, name
        assert q.tied is (name != "qwen2.5-7b"), name
    # asdict records the fields that are set: a dense shape has no MoE keys, family defaults are left out
    assert list(l8.asdict()) == ["family", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim",
                                 "vocab", "rope_theta", "rms_norm_eps", "tied"]
    assert "rope_theta" not in s["gemma2-9b"].asdict() and "tied" not in s["gemma2-9b"].asdict()


def test_hf_config_and_build_model_from_a_shape():
    dims = shapes.SHAPES["tiny"]
    cfg = shapes.hf_config(dims, layers=1, max_positions=128, pad_token_id=0)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1 and cfg.max_position_embeddings == 128
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 16, 256)
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings is False and cfg.pad_token_id == 0
    # head_dim None: the family derives it; family= overrides the shape's
    mistral = shapes.hf_config(dataclasses.replace(dims, head_dim=None, hidden=128), family="mistral",
                               sliding_window=32)
    assert mistral.model_type == "mistral" and mistral.head_dim == 32 and mistral.sliding_window == 32

    a = shapes.build_model(cfg, dtype=torch.float32, seed=3)
    b = shapes.build_model(cfg, dtype=torch.float32, seed=3)
    assert a.config._attn_implementation == "sdpa" and next(a.parameters()).dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))   # same seed, same weights

    lora = shapes.train_ready(a)
    assert lora.training and not lora.config.use_cache and a.is_gradient_checkpointing
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    full = shapes.train_ready(b, lora=False)
    assert full is b and all(p.requires_grad for p in full.parameters())


def test_environment_records_gpu_versions_date_and_command(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    env = harness.environment("python -m swift_liger.bench.x", ["--out", "a dir"], device="cpu",
                              packages=("bitsandbytes",))
    for key in ("date", "command", "python", "torch", "cuda", "gpu", "triton", "transformers", "peft", "ms_swift",
                "liger_kernel", "cut_cross_entropy", "bitsandbytes", "swift_liger_backend", "device"):
        assert key in env, key
    assert env["command"] == "python -m swift_liger.bench.x --out 'a dir'"
    assert env["date"].endswith(" UTC") and env["torch"] == torch.__version__ and env["gpu"] is None
    assert env["transformers"] and env["swift_liger_backend"] == "torch" and env["device"] == "cpu"
    assert harness.package_version("no-such-distribution-xyz") is None
    json.dumps(env)   # JSON-safe as it is


def test_versions_line_and_header():
    env = {"gpu": "H200", "torch": "2.9", "cuda": "12.8", "triton": "3.5", "liger_kernel": "0.6", "date": "D",
           "command": "python -m swift_liger.bench kernels"}
    assert harness.versions_line(env, "triton", "liger_kernel") == \
        "GPU: H200 · torch 2.9 (CUDA 12.8) · triton 3.5 · liger-kernel 0.6 · D"
    assert harness.versions_line(env, "triton", cuda=False) == "GPU: H200 · torch 2.9 · triton 3.5 · D"
    assert harness.header("Title", env, "triton") == [
        "# Title", "", "GPU: H200 · torch 2.9 (CUDA 12.8) · triton 3.5 · D", "",
        "Command: `python -m swift_liger.bench kernels`", ""]
    assert harness.header("T", env, command="other")[4] == "Command: `other`"
    assert harness.fmt(None, ".2f") == "—" and harness.fmt(1.234, ".2f") == "1.23"


def test_write_report_writes_json_and_markdown(tmp_path):
    out = tmp_path / "new" / "dir"
    md = harness.write_report(str(out), "r", {"environment": {"gpu": None}, "x": torch.float32}, "# md\n")
    assert md == "# md\n" and (out / "r.md").read_text() == "# md\n"
    assert json.loads((out / "r.json").read_text()) == {"environment": {"gpu": None}, "x": "torch.float32"}
    assert harness.write_report(str(out), "j", [1, 2]) is None and not (out / "j.md").exists()
    assert json.loads((out / "j.json").read_text()) == [1, 2]


def test_run_child_captures_times_out_and_logs(tmp_path):
    code = ("import json, sys; print('noise'); print('RESULT ' + json.dumps({'a': 1})); "
            "print('PROGRESS {\"phase\": \"x\"}', file=sys.stderr); print('Error: boom', file=sys.stderr)")
    child = harness.run_child([sys.executable, "-c", code])
    assert child.returncode == 0 and not child.timed_out and child.seconds > 0
    assert harness.last_json(child.stdout, "RESULT ") == {"a": 1} and harness.last_json(child.stdout) is None
    assert harness.last_json(child.stderr, "PROGRESS ") == {"phase": "x"}
    assert harness.tail(child.stderr, skip="PROGRESS ") == "Error: boom"
    assert harness.tail("a\n\nError b\nc\n", 2, prefer=lambda ln: "Error" in ln) == "Error b"
    assert harness.tail("a\nb\nc", 2) == "b | c"

    slow = harness.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert slow.timed_out and slow.returncode is not None and slow.returncode < 0 and slow.seconds < 20

    log = tmp_path / "child.log"
    logged = harness.run_child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                               log_path=str(log))
    assert logged.returncode == 0 and logged.stdout == "" and set(log.read_text().split()) == {"out", "err"}


def test_describe_and_dtypes():
    assert harness.describe(ValueError("first\nsecond")) == "ValueError: first"
    assert harness.describe(RuntimeError("")) == "RuntimeError"
    assert harness.describe(ValueError("x" * 500), 10) == "ValueError: " + "x" * 10
    assert harness.DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert harness.GiB == 1024 ** 3


def test_counted_is_a_diagnostic(monkeypatch):
    import swift_liger.patcher

    assert harness.counted(torch.nn.Linear(2, 2)) is None   # an unpatched model: nothing counted

    def broken(model):
        raise RuntimeError("counters gone")
    monkeypatch.setattr(swift_liger.patcher, "call_counts", broken)
    assert harness.counted(torch.nn.Linear(2, 2)) == {"error": "RuntimeError: counters gone"}
