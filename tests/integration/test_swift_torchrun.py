"""End-to-end under torchrun: `swift sft --use_liger` with NPROC_PER_NODE=2 on CPU (gloo) patches the model on every
rank, before LoRA wraps it, and trains with the same per-step losses as the same 2-rank run without --use_liger; and
against one process with gradient accumulation 2 (the same global batch), patched and stock.

ms-swift's own launcher does the torchrun part: with NPROC_PER_NODE (and MASTER_PORT) set, `swift sft` re-runs
swift/cli/sft.py through `python -m torch.distributed.run`. Two CPU gotchas, both handled by TORCHRUN_CPU below:

* `--use_cpu true` is required. Without it transformers builds accelerate's PartialState with cpu=False, which on a
  machine without CUDA yields DistributedType.NO: the process group still comes up (gloo, torch's CPU default) but
  the Trainer neither wraps the model in DDP nor shards the data. Each rank then trains its own model on its own
  batches, and both write the same logging.jsonl (transformers only warns "torch.distributed process group is
  initialized, but parallel_mode != ParallelMode.DISTRIBUTED").
* `--ddp_backend gloo` pins the backend: with use_cpu and no backend, accelerate picks MPI when torch has it.
"""
from __future__ import annotations

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_runner import CPU_FLAGS, run_swift, swift_env

pytestmark = pytest.mark.slow

FUSIONS = ("rms_norm", "rope", "qk_norm_rope", "swiglu", "cross_entropy")
NPROC = 2
STEPS = 4
SMALL = ["--per_device_train_batch_size", "1", "--max_length", "64"]  # the interpreter runs every Triton program
TORCHRUN_CPU = ["--use_cpu", "true", "--ddp_backend", "gloo"]
NOT_DDP = "parallel_mode != ParallelMode.DISTRIBUTED"  # transformers' warning when the ranks train independently


def _free_ports(n):
    """n distinct free TCP ports (held open together, so two parallel runs cannot get the same one)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("swift_torchrun")
    sft = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--tuner_type", "lora", *CPU_FLAGS, *SMALL,
           *TORCHRUN_CPU, "--learning_rate", "2e-3", "--max_steps", str(STEPS), "--report_to", "none",
           "--save_strategy", "no"]
    specs = {"liger": sft + ["--use_liger"], "base": sft}
    ports = dict(zip(specs, _free_ports(len(specs))))
    # one process, gradient accumulation 2: the same global batch of 2 rows per step
    # (without the torchrun-only flags: --ddp_backend in one process asks for a process group that does not exist)
    i = sft.index(TORCHRUN_CPU[0])
    assert sft[i:i + len(TORCHRUN_CPU)] == TORCHRUN_CPU
    one = sft[:i] + sft[i + len(TORCHRUN_CPU):] + ["--gradient_accumulation_steps", str(NPROC)]
    single = {"liger_ga2": one + ["--use_liger"], "base_ga2": one}
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = {name: pool.submit(run_swift, "sft", argv, str(root / name),
                                     swift_env(NPROC_PER_NODE=NPROC, MASTER_PORT=ports[name]))
                   for name, argv in specs.items()}
        futures.update({name: pool.submit(run_swift, "sft", argv, str(root / name))
                        for name, argv in single.items()})
        return {name: f.result() for name, f in futures.items()}


def _train_summary(run):
    with open(os.path.join(run.run_dir, "logging.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    (summary,) = [r for r in rows if "train_runtime" in r]
    return summary


def test_both_runs_are_real_ddp(runs):
    for name, run in runs.items():
        if name.endswith("_ga2"):
            continue
        run.check(teardown_abort_ok=True)
        assert "-m torch.distributed.run --nproc_per_node 2" in run.log, name  # ms-swift's launcher used torchrun
        assert f"world_size: {NPROC}" in run.log and NOT_DDP not in run.log, name
        assert [r["step"] for r in run.steps()] == list(range(1, STEPS + 1)), name  # rank 0 alone logs each step
        summary = _train_summary(run)  # global batch = 2 ranks x 1 sample
        assert summary["train_samples_per_second"] == pytest.approx(NPROC * summary["train_steps_per_second"],
                                                                    rel=0.05), (name, summary)


def test_torchrun_losses_match_unpatched(runs):
    base = runs["base"].check(teardown_abort_ok=True).steps()
    liger = runs["liger"].check(teardown_abort_ok=True).steps()
    assert [r["step"] for r in base] == [r["step"] for r in liger] == list(range(1, STEPS + 1))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base, liger)]
    assert max(diffs) <= 1e-5, diffs
    assert len({r["loss"] for r in base}) > 1  # it trained


def test_two_ranks_against_one_process_with_accumulation(runs):
    """2 ranks x 1 row against 1 process x 2 accumulated rows, patched and stock. Step 1 sees the same two rows: equal
    losses. After it the trainers differ by themselves (DDP averages the ranks' mean losses, accumulation weights the
    rows by their token counts): the patched runs reproduce stock's per-step losses in both set-ups, so the gap
    between the set-ups is the same with and without --use_liger."""
    names = ("liger", "base", "liger_ga2", "base_ga2")
    steps = {name: [r["loss"] for r in runs[name].check(teardown_abort_ok=not name.endswith("_ga2")).steps()]
             for name in names}
    assert all(len(v) == STEPS for v in steps.values()), steps
    assert abs(steps["liger"][0] - steps["liger_ga2"][0]) <= 1e-5, steps
    assert max(abs(a - b) for a, b in zip(steps["liger_ga2"], steps["base_ga2"])) <= 1e-5, steps
    for i in range(STEPS):
        gap_ours = steps["liger"][i] - steps["liger_ga2"][i]
        gap_stock = steps["base"][i] - steps["base_ga2"][i]
        assert abs(gap_ours - gap_stock) <= 2e-5, (i, steps)


def test_every_rank_patched_before_lora(runs):
    liger = runs["liger"].check(teardown_abort_ok=True)   # the run the tests above accept (pytorch#179291)
    record = liger.patch_record()
    assert record["world_size"] == NPROC and set(record["models"]) == {"policy"}
    policy = record["models"]["policy"]
    report = policy["report"]
    assert all(report["patched"][f] > 0 for f in FUSIONS), report
    # one entry per rank, gathered by rank 0: every rank patched the same modules of the bare model (not yet a
    # PeftModel: the seam runs before LoRA wraps it)
    assert [r["rank"] for r in policy["ranks"]] == list(range(NPROC)), policy["ranks"]
    for rank in policy["ranks"]:
        assert rank["model_class"] == report["model_class"] == "Qwen3ForCausalLM", rank
        assert rank["patched"] == report["patched"], rank
    # one log line per run (rank 0), saying it holds for every rank; it comes before LoRA's config and the wrapped model
    log = liger.log
    line = f"swift_liger: patched the policy model (the same on all {NPROC} ranks):"
    assert log.count("swift_liger: patched the policy model") == 1 and line in log, log[-4000:]
    assert log.index(line) < log.index("lora_config: LoraConfig") < log.index("model_parameter_info: PeftModel")
    assert "the ranks patched the policy model differently" not in log
    assert not os.path.exists(os.path.join(runs["base"].run_dir, "liger_patch.json"))


RLHF_STEPS = 3
RLHF_SKIP = {"step_time(s)", "tokens/s", "rss(GiB)", "elapsed_time", "remaining_time", "train_speed(s/it)",
             "global_step/max_steps", "memory(GiB)", "epoch"}


@pytest.fixture(scope="module")
def rlhf_runs(tiny_llama, tmp_path_factory):
    """`swift rlhf --rlhf_type dpo` (LoRA) on 2 ranks (DDP, and FSDP2) and in 1 process with gradient accumulation 2,
    each with and without --use_liger. The reference/policy log-prob passes are ours on every rank in the patched
    runs."""
    root = tmp_path_factory.mktemp("rlhf_torchrun")
    common = [*tiny_llama["swift_flags"], "--dataset", tiny_llama["pref"], "--rlhf_type", "dpo", "--tuner_type", "lora",
              *CPU_FLAGS, "--per_device_train_batch_size", "1", "--max_length", "128", "--learning_rate", "2e-3",
              "--max_steps", str(RLHF_STEPS), "--report_to", "none", "--save_strategy", "no"]
    ddp = common + TORCHRUN_CPU
    one = common + ["--gradient_accumulation_steps", str(NPROC)]
    fsdp = ddp + ["--fsdp", "fsdp2"]
    specs = {"ddp_liger": (ddp + ["--use_liger"], True), "ddp_base": (ddp, True),
             "fsdp_liger": (fsdp + ["--use_liger"], True), "fsdp_base": (fsdp, True),
             "ga2_liger": (one + ["--use_liger"], False), "ga2_base": (one, False)}
    ports = dict(zip(specs, _free_ports(len(specs))))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, "rlhf", argv, str(root / name),
                                     swift_env(NPROC_PER_NODE=NPROC, MASTER_PORT=ports[name]) if dist else None)
                   for name, (argv, dist) in specs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("setup", ["ddp", "fsdp", "ga2"])
def test_rlhf_dpo_patched_equals_stock_on_two_ranks_and_with_accumulation(rlhf_runs, setup):
    ranks = setup != "ga2"   # torchrun set-ups; ga2 is one process
    liger = rlhf_runs[f"{setup}_liger"].check(teardown_abort_ok=ranks)
    base = rlhf_runs[f"{setup}_base"].check(teardown_abort_ok=ranks)
    a, b = base.steps(), liger.steps()
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, RLHF_STEPS + 1))
    compared = 0
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key in RLHF_SKIP or not isinstance(value, (int, float)) or not isinstance(rb.get(key), (int, float)):
                continue
            assert abs(value - rb[key]) <= 1e-4 * max(1.0, abs(value)), (setup, ra["step"], key, value, rb[key])
            compared += 1
    assert compared >= 5 * RLHF_STEPS
    record = liger.patch_record()
    total = record["runtime"]["total"]["policy"]
    assert total["fused_linear_logprobs"] > 0 and total["lm_head_logits"] == 0, total
    if setup != "ga2":
        assert record["world_size"] == NPROC
        assert [r["rank"] for r in record["models"]["policy"]["ranks"]] == list(range(NPROC))
        assert "-m torch.distributed.run --nproc_per_node 2" in liger.log
        assert ("Using FSDP2" in liger.log) == (setup == "fsdp")


@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
def test_rlhf_two_ranks_equal_one_process_with_accumulation(rlhf_runs, setup):
    """DPO with one pair per micro-batch: 2 ranks x 1 pair average the same per-pair losses as 1 process x 2
    accumulated pairs, so every step's loss and grad norm agree across the set-ups, patched and stock."""
    for kind in ("liger", "base"):
        ranks = rlhf_runs[f"{setup}_{kind}"].check(teardown_abort_ok=True).steps()
        one = rlhf_runs[f"ga2_{kind}"].check().steps()
        assert len(ranks) == len(one) == RLHF_STEPS, (ranks, one)
        for ra, rb in zip(ranks, one):
            assert abs(ra["loss"] - rb["loss"]) <= 1e-5, (setup, kind, ra, rb)
            assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-4 * max(1.0, rb["grad_norm"]), (setup, kind, ra, rb)


@pytest.fixture(scope="module")
def fsdp_runs(tiny_qwen3, tmp_path_factory):
    """`swift sft --fsdp fsdp2` on 2 gloo ranks (FSDP2 runs on CPU; ms-swift wraps each decoder layer): every
    parameter is a DTensor shard between forwards, gathered by FSDP2 around each wrapped module."""
    root = tmp_path_factory.mktemp("fsdp_torchrun")
    argv = [*tiny_qwen3["swift_flags"], "--dataset", tiny_qwen3["sft"], "--tuner_type", "lora", *CPU_FLAGS, *SMALL,
            *TORCHRUN_CPU, "--fsdp", "fsdp2", "--learning_rate", "2e-3", "--max_steps", "3", "--report_to", "none",
            "--save_strategy", "no"]
    specs = {"liger": argv + ["--use_liger"], "base": argv}
    ports = dict(zip(specs, _free_ports(len(specs))))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_swift, "sft", a, str(root / name),
                                     swift_env(NPROC_PER_NODE=NPROC, MASTER_PORT=ports[name]))
                   for name, a in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_fsdp2_losses_match_unpatched_with_the_fused_head(fsdp_runs):
    liger, base = fsdp_runs["liger"].check(teardown_abort_ok=True), fsdp_runs["base"].check(teardown_abort_ok=True)
    for run in (liger, base):
        assert "Using FSDP2" in run.log and "-m torch.distributed.run --nproc_per_node 2" in run.log
    a, b = base.steps(), liger.steps()
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) <= 1e-5, (a, b)
    assert max(abs(x["grad_norm"] - y["grad_norm"]) for x, y in zip(a, b)) <= 1e-4 * max(r["grad_norm"] for r in a)
    record = liger.patch_record()
    total = record["runtime"]["total"]["policy"]
    assert total["fused_linear_cross_entropy"] > 0 and total["lm_head_logits"] == 0, total
    assert total["lora_fused"] > 0 and total["lora_peft"] == 0, total
    assert record["world_size"] == NPROC


def test_fsdp2_first_step_equals_ddp_and_one_process_with_accumulation(fsdp_runs, runs):
    """FSDP2 on 2 ranks against the `runs` fixture's DDP (2 ranks) and one-process accumulation (2 rows) runs: same
    model, data, seed and flags but for the launch. Step 1, before any update: FSDP2's loss and grad norm equal
    DDP's, and its loss equals accumulation's (whose grad norm differs by itself: it weights rows by their token
    counts, DDP averages the ranks' means), patched and stock."""
    for kind in ("liger", "base"):
        fsdp = fsdp_runs[kind].check(teardown_abort_ok=True).steps()[0]
        ddp = runs[kind].check(teardown_abort_ok=True).steps()[0]
        one = runs[f"{kind}_ga2"].check().steps()[0]
        assert fsdp["step"] == ddp["step"] == one["step"] == 1
        assert abs(fsdp["loss"] - ddp["loss"]) <= 1e-5 and abs(fsdp["loss"] - one["loss"]) <= 1e-5, (kind, fsdp,
                                                                                                      ddp, one)
        assert abs(fsdp["grad_norm"] - ddp["grad_norm"]) <= 1e-4 * max(1.0, ddp["grad_norm"]), (kind, fsdp, ddp)
