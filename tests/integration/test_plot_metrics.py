"""Step metrics and the plot, without ms-swift (fast)."""
from __future__ import annotations

import json
import os
import time
import types

import pytest
import torch

from swift_liger import plot
from swift_liger.integration import metrics


class FakeTrainer:
    """The slice of transformers.Trainer that metrics.attach touches."""

    def __init__(self):
        self.args = types.SimpleNamespace(device=torch.device("cpu"))
        self.state = types.SimpleNamespace()
        self.model = torch.nn.Linear(4, 4)
        self.callbacks, self.logged, self.seen = [], [], []

    def add_callback(self, cb):
        self.callbacks.append(cb)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(inputs)
        return torch.tensor(1.0)

    def log(self, logs, start_time=None):
        self.logged.append(dict(logs))


def test_attach_counts_non_padding_tokens_and_logs_once_per_interval():
    trainer = FakeTrainer()
    m = metrics.attach(trainer)
    assert metrics.attach(trainer) is m and len(trainer.callbacks) == 1  # idempotent
    (cb,) = trainer.callbacks
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for _ in range(2):  # two optimizer steps, two micro-batches each
        cb.on_step_begin(None, None, None)
        trainer.training_step(trainer.model, {"input_ids": torch.zeros(2, 4), "attention_mask": mask})
        trainer.training_step(trainer.model, {"input_ids": torch.zeros(1, 7)})  # padding-free: all tokens
        time.sleep(0.01)  # step_time is rounded to microseconds
        cb.on_step_end(None, None, None)
    assert len(trainer.seen) == 4  # the wrapped training_step still calls the real one
    trainer.log({"eval_loss": 1.0})
    trainer.log({"loss": 2.0})
    trainer.log({"loss": 2.0})  # nothing new since the last log: no metrics
    eval_logs, logs, empty = trainer.logged
    assert "tokens/s" not in eval_logs and "tokens/s" not in empty
    tokens = 2 * (5 + 7)
    assert logs["tokens/s"] == pytest.approx(tokens / (2 * logs["step_time(s)"]), rel=1e-3)
    assert logs["rss(GiB)"] > 0 and "peak_alloc(GiB)" not in logs and "MFU" not in logs


class FakeGRPOTrainer(FakeTrainer):
    """training_step gets raw rows; the batch the loss sees is generated inside it, as in ms-swift's GRPO."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert isinstance(inputs, list) and "messages" in inputs[0]
        completion = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
        attention = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])   # left-padded prompt, padded completion
        prepared = {"model_inputs": {"input_ids": torch.zeros(2, 6), "attention_mask": attention},
                    "grpo_batch": types.SimpleNamespace(completion_mask=completion)}
        self.compute_loss(model, [prepared])
        self.compute_loss(model, [prepared])   # a second call in the same micro-batch is not counted again
        return torch.tensor(1.0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append(inputs)
        return torch.tensor(1.0)


def test_grpo_counts_the_generated_batch_and_its_completion_tokens():
    trainer = FakeGRPOTrainer()
    metrics.attach(trainer)
    (cb,) = trainer.callbacks
    cb.on_step_begin(None, None, None)
    for _ in range(2):
        trainer.training_step(trainer.model, [{"messages": [{"role": "user", "content": "hi"}]}])
    time.sleep(0.01)
    cb.on_step_end(None, None, None)
    trainer.log({"loss": 1.0})
    (logs,) = trainer.logged
    assert len(trainer.seen) == 4
    assert logs["tokens/s"] == pytest.approx(2 * 10 / logs["step_time(s)"], rel=1e-3)
    assert logs["completion_tokens/s"] == pytest.approx(2 * 6 / logs["step_time(s)"], rel=1e-3)


def test_metrics_never_break_training():
    trainer = FakeTrainer()
    m = metrics.attach(trainer)
    (cb,) = trainer.callbacks
    cb.on_step_begin(None, None, None)
    class Broken:
        def dim(self):
            return 2

        def sum(self):
            raise RuntimeError("boom")

    trainer.training_step(trainer.model, {"attention_mask": Broken()})  # counting fails
    cb.on_step_end(None, None, None)
    trainer.log({"loss": 1.0})
    assert m.enabled is False and trainer.logged == [{"loss": 1.0}]


def test_peak_flops_table(monkeypatch):
    monkeypatch.delenv("SWIFT_LIGER_PEAK_TFLOPS", raising=False)
    assert metrics.peak_flops("NVIDIA H200") == 989e12
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert metrics.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.peak_flops("Some Future GPU") is None
    monkeypatch.setenv("SWIFT_LIGER_PEAK_TFLOPS", "100")
    assert metrics.peak_flops("Some Future GPU") == 100e12


def test_flops_per_token_counts_frozen_and_trainable_linears():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Embedding(10, 8), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    n0, n2 = 8 * 16, 16 * 4  # weights only; biases and embeddings are not matmul FLOPs
    assert metrics.linear_flops_per_token(model) == 4 * (n0 + n2) + 2 * n2


def write_log(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "logging.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_read_steps_and_plot(tmp_path):
    out = tmp_path / "out"
    write_log(out / "v0-old", [{"loss": 9.0, "global_step/max_steps": "1/1"}])
    rows = [{"loss": 2.0 - i / 10, "global_step/max_steps": f"{i}/3", "tokens/s": 100.0 + i, "rss(GiB)": 0.5}
            for i in (2, 1, 3)]
    write_log(out / "v1-new", rows + [{"train_runtime": 1.0}, {"model_parameter_info": "x"}])
    os.utime(out / "v0-old" / "logging.jsonl", (1, 1))  # older
    steps = plot.read_steps(str(out))
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[0]["loss"] == pytest.approx(1.9)
    assert plot.memory_key(steps) == "rss(GiB)"
    assert plot.memory_key([{"rss(GiB)": 1, "peak_alloc(GiB)": 2}]) == "peak_alloc(GiB)"
    png = plot.plot_runs([str(out), str(out / "v1-new" / "logging.jsonl")], str(tmp_path / "p.png"))
    assert os.path.getsize(png) > 10_000
    with pytest.raises(FileNotFoundError, match="no such run"):
        plot.find_log(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no logging.jsonl"):
        plot.find_log(str(tmp_path / "empty"))


def test_plot_labels_output_name_and_summary(tmp_path, capsys):
    from swift_liger.cli import main
    rows = [{"loss": 2.0 - i / 10, "global_step/max_steps": f"{i}/4", "tokens/s": 100.0 * i,
             "peak_alloc(GiB)": 10.0 + 0.001 * i} for i in (1, 2, 3, 4)]
    for parent in ("a", "b"):   # two runs whose output dirs have the same name
        write_log(tmp_path / parent / "liger" / "v0-20260101-000000", rows)
    (tmp_path / "b" / "liger" / "v0-20260101-000000" / "liger_patch.json").write_text("{}")
    runs = [str(tmp_path / "a" / "liger"), str(tmp_path / "b" / "liger")]
    assert plot.run_labels(runs) == ["a/liger (stock)", "b/liger"]   # told apart; only a true name drops the tag
    assert plot.run_labels([runs[1], runs[1]]) == ["liger #1", "liger #2"]
    s0 = plot.summary("x", plot.read_steps(runs[0]))
    s1 = plot.summary("y", plot.read_steps(runs[1]), s0)
    assert s0["tokens_per_s"] == 300.0 and s0["peak_memory_gib"] == pytest.approx(10.004)   # median after step 1
    assert s1["tokens_per_s_ratio"] == 1.0 and s1["peak_memory_gib_ratio"] == 1.0

    out = tmp_path / "cmp_no_extension"
    assert main(["plot", *runs, "-o", str(out), "--labels", "stock", "ours"]) == 0
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "cmp_no_extension.png").exists()
    assert "stock: 4 logged steps" in capsys.readouterr().out
    assert main(["plot", *runs, "-o", str(out), "--labels", "one"]) == 2
    assert "--labels got 1 names for 2 runs" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing"), "-o", str(out)]) == 2   # a message, no traceback
    assert "no such run" in capsys.readouterr().err

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    captured = {}
    original = plt.Figure.savefig

    def keep(fig, *a, **k):
        captured["axes"] = fig.axes
        return original(fig, *a, **k)
    plt.Figure.savefig = keep
    try:
        plot.plot_runs(runs, str(tmp_path / "p.png"))
    finally:
        plt.Figure.savefig = original
    loss_ax, _, mem_ax = captured["axes"]
    assert all(float(t).is_integer() for t in loss_ax.get_xticks())   # integer steps
    assert mem_ax.get_ylim()[0] == 0.0                                 # memory from 0 GiB
    assert len({line.get_marker() for line in loss_ax.lines}) == 2     # equal curves, distinct markers


def test_plot_format_follows_the_extension_and_empty_logs_are_refused(tmp_path, capsys):
    """`-o x.pdf` writes a PDF (`-o x.svg` SVG; no extension PNG); an extension matplotlib cannot write and a
    logging.jsonl without a single training step are errors (exit 2, a message naming them), not silent output."""
    from swift_liger.cli import main
    rows = [{"loss": 1.0, "global_step/max_steps": f"{i}/2", "tokens/s": 10.0} for i in (1, 2)]
    write_log(tmp_path / "run" / "v0-1", rows)
    run = str(tmp_path / "run")
    assert main(["plot", run, "-o", str(tmp_path / "x.pdf")]) == 0
    assert (tmp_path / "x.pdf").read_bytes()[:5] == b"%PDF-"
    assert main(["plot", run, "-o", str(tmp_path / "x.svg")]) == 0
    assert b"<svg" in (tmp_path / "x.svg").read_bytes()[:500]
    capsys.readouterr()
    assert main(["plot", run, "-o", str(tmp_path / "x.docx")]) == 2
    err = capsys.readouterr().err
    assert "docx" in err and "pdf" in err and not (tmp_path / "x.docx").exists()
    write_log(tmp_path / "notalog" / "v0-1", [{"model_parameter_info": "x"}, {"train_runtime": 1.0}])
    assert main(["plot", str(tmp_path / "notalog"), "-o", str(tmp_path / "e.png")]) == 2
    assert "no training steps" in capsys.readouterr().err and not (tmp_path / "e.png").exists()


def test_tiny_cli_offers_every_arch_reports_params_on_rerun_and_names_a_bad_outdir(tmp_path, capsys):
    """`swift-liger tiny`: --arch takes every arch the builder has; a rerun (the model already there) prints the
    parameter count, not '?'; an OUTDIR that is a file is an error naming it (exit 2), not a traceback."""
    from swift_liger.cli import main
    from swift_liger.testing import tiny
    with pytest.raises(SystemExit):
        main(["tiny", "--help"])
    help_text = capsys.readouterr().out
    assert all(arch in help_text for arch in tiny.SWIFT_FLAGS), help_text
    out = tmp_path / "t"
    assert main(["tiny", str(out), "--arch", "llama"]) == 0
    first = capsys.readouterr().out
    assert main(["tiny", str(out), "--arch", "llama"]) == 0
    again = capsys.readouterr().out
    assert "?" not in again and first.split(" params")[0] == again.split(" params")[0], (first, again)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["tiny", str(blocker)]) == 2
    assert str(blocker) in capsys.readouterr().err


def test_summary_without_speed_ratio():
    """The demo on CPU: tokens/s are shown, their ratio (reference code against stock, not a speed-up) is not."""
    s0 = {"label": "stock", "tokens_per_s": 100.0, "peak_memory_gib": None, "final_loss": 1.0}
    s1 = {"label": "liger", "tokens_per_s": 601.0, "tokens_per_s_ratio": 6.01, "peak_memory_gib": None,
          "final_loss": 1.0}
    assert "6.01x" in plot._summary_text(s1, False) and "601 tok/s" in plot._summary_text(s1, False)
    text = plot._summary_text(s1, False, speed_ratio=False)
    assert "601 tok/s" in text and "x)" not in text


def test_demo_lists_only_fusions_that_patched_something():
    from swift_liger import demo
    record = {"models": {"policy": {"report": {"patched": {"rms_norm": 5, "rope": 2, "swiglu": 0,
                                                           "compile_layers": 0, "cross_entropy": 1}}}}}
    assert demo.patched_fusions(record) == {"rms_norm": 5, "rope": 2, "cross_entropy": 1}
    record["models"]["policy"]["report"]["patched"] = None
    assert demo.patched_fusions(record) == {}
