"""The real `swift sft` / `swift rlhf` CLI on a random-init model: plain vs --use_liger vs --use_liger_kernel.

    python -m swift_liger.bench.swift_cli build OUTDIR [--shape llama3-8b|qwen2.5-7b|qwen2.5-1.5b --seq 8192]
    python -m swift_liger.bench.swift_cli run OUTDIR/model OUTDIR/sft.jsonl --variant swift_liger --out DIR
    python -m swift_liger.bench.swift_cli run OUTDIR/model OUTDIR/pref.jsonl --task dpo --variant plain --out DIR
    python -m swift_liger.bench.swift_cli run OUTDIR/model OUTDIR/grpo.jsonl --task grpo --seq 2048 --variant plain ...
    python -m swift_liger.bench.swift_cli run OUTDIR/model OUTDIR/sft.jsonl --task gkd --teacher OTHER/model ...
    python -m swift_liger.bench.swift_cli report DIR --out docs/benchmarks --name swift_cli_llama3_8b_lora

`build` writes OUTDIR/model (the shape's config, random init in bf16 on the device, safetensors, plus an offline
ChatML BPE tokenizer from swift_liger.testing.tiny), OUTDIR/sft.jsonl, whose rows encode to just under --seq tokens
with ms-swift's chat template (ms-swift's default truncation_strategy 'delete' drops longer rows), and
OUTDIR/pref.jsonl: a prompt of --prompt-frac of --seq and a chosen and a rejected response that each fill the rest,
so chosen and rejected sequences are each just under --seq tokens (a pair is 2 x --seq), and OUTDIR/grpo.jsonl:
short prompts for GRPO, whose completions (exactly --seq tokens, 8 per prompt) come from grpo_plugin.py's instant
rollout (see task_flags).

`run` launches `python -m swift.cli.main sft` (or `rlhf --rlhf_type TASK`; LoRA r=16 on all linears or --tuner
full, bf16, SDPA, gradient checkpointing, batch 1, one row = one micro-batch) and reads the run's logging.jsonl.
The per-step step_time(s) / tokens/s / peak_alloc(GiB) / peak_reserved(GiB) columns come from swift_liger's metrics
callback, which the import hook attaches to every `swift sft` run (--liger_metrics, default true, no --use_liger
needed), so all variants log the same fields.
tokens/s of a run = median over the measured steps (after --warmup); peak memory = max over all steps.

`report` merges DIR/<variant>.json into <name>.json and <name>.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import torch

from swift_liger.plot import read_steps as read_rows
from swift_liger.testing import tiny

from . import shapes
from .harness import fmt, gpu_name, run_child, tail, utc_now, versions, versions_line, write_json, write_report

VARIANTS = ("plain", "swift_liger", "swift_liger_eager", "swift_liger_graphs_always", "swift_liger_no_lora_fusion",
            "swift_liger_ce_off", "swift_liger_ce_fused",
            "swift_liger_compiled", "swift_liger_long_context",
            "swift_liger_save_attention", "swift_liger_packing", "packing_attention_only", "liger_kernel",
            "swift_liger_rollout_eager", "swift_liger_fp8", "swift_liger_cudnn", "swift_liger_compile_ahead",
            "swift_liger_no_compile_ahead", "swift_liger_no_grad_eager", "swift_liger_pad_masks",
            "swift_liger_profiled", "swift_liger_no_base_epilogue", "swift_liger_fp8_no_hw_cvt")
VARIANT_FLAGS = {"plain": [], "swift_liger": ["--use_liger"],
                 "swift_liger_eager": ["--use_liger", "--liger_graph_layers", "false"],
                 "swift_liger_graphs_always": ["--use_liger"],
                 "swift_liger_no_lora_fusion": ["--use_liger", "--liger_lora_fusion", "false"],
                 "swift_liger_ce_off": ["--use_liger", "--liger_cross_entropy", "off"],
                 "swift_liger_ce_fused": ["--use_liger", "--liger_cross_entropy", "fused"],
                 "swift_liger_compiled": ["--use_liger", "--liger_compile_layers", "true"],
                 "swift_liger_long_context": ["--use_liger", "--liger_config", "long_context"],
                 "swift_liger_save_attention": ["--use_liger", "--liger_save_attention", "true"],
                 "swift_liger_packing": ["--use_liger", "--packing", "true", "--attn_impl", "swift_liger"],
                 "packing_attention_only": ["--packing", "true", "--attn_impl", "swift_liger"],
                 "liger_kernel": ["--use_liger_kernel", "true"],
                 "swift_liger_rollout_eager": ["--use_liger", "--liger_rolling_cache", "none"],
                 "swift_liger_fp8": ["--use_liger", "--liger_fp8_base", "true"],
                 "swift_liger_cudnn": ["--use_liger", "--liger_cudnn_attention", "true"],
                 "swift_liger_compile_ahead": ["--use_liger"],
                 "swift_liger_no_compile_ahead": ["--use_liger"],
                 "swift_liger_no_grad_eager": ["--use_liger"],
                 "swift_liger_pad_masks": ["--use_liger", "--liger_drop_pad_mask", "false"],
                 "swift_liger_profiled": ["--use_liger"],
                 "swift_liger_no_base_epilogue": ["--use_liger"],
                 "swift_liger_fp8_no_hw_cvt": ["--use_liger", "--liger_fp8_base", "true"]}
VARIANT_LABELS = {"plain": "plain (no kernels)", "swift_liger": "`--use_liger` (swift_liger)",
                  "swift_liger_eager": "`--use_liger --liger_graph_layers false`",
                  "swift_liger_graphs_always": "`--use_liger`, graphs at every shape (SWIFT_LIGER_GRAPH_LAYERS=always)",
                  "swift_liger_no_lora_fusion": "`--use_liger --liger_lora_fusion false`",
                  "swift_liger_ce_off": "`--use_liger --liger_cross_entropy off`",
                  "swift_liger_ce_fused": "`--use_liger --liger_cross_entropy fused`",
                  "swift_liger_compiled": "`--use_liger --liger_compile_layers true`",
                  "swift_liger_long_context": "`--use_liger --liger_config long_context`",
                  "swift_liger_save_attention": "`--use_liger --liger_save_attention true`",
                  "swift_liger_packing": "`--use_liger --packing true --attn_impl swift_liger`",
                  "packing_attention_only": "`--packing true --attn_impl swift_liger` (no other fusion)",
                  "liger_kernel": "`--use_liger_kernel true` (liger-kernel)",
                  "swift_liger_rollout_eager": "`--use_liger --liger_rolling_cache none` (rollouts on transformers' "
                                               "cache)",
                  "swift_liger_fp8": "`--use_liger --liger_fp8_base true` (FP8 frozen LoRA bases)",
                  "swift_liger_cudnn": "`--use_liger --liger_cudnn_attention true` (SDPA cuDNN-first where it times "
                                       "faster)",
                  "swift_liger_compile_ahead": "`--use_liger`, SWIFT_LIGER_COMPILE_AHEAD=1",
                  "swift_liger_no_compile_ahead": "`--use_liger`, SWIFT_LIGER_COMPILE_AHEAD=0 (kernels compile at "
                                                  "their first launch)",
                  "swift_liger_no_grad_eager": "`--use_liger`, SWIFT_LIGER_GRAPH_NO_GRAD=0 (autograd-off passes eager)",
                  "swift_liger_pad_masks": "`--use_liger --liger_drop_pad_mask false` (right-padding masks kept)",
                  "swift_liger_profiled": "`--use_liger`, SWIFT_LIGER_PROFILE_FIRST_STEP=40 (first step under "
                                          "cProfile: its time is not comparable)",
                  "swift_liger_no_base_epilogue": "`--use_liger`, SWIFT_LIGER_LORA_BASE_EPILOGUE=0 (the LoRA "
                                                  "output added after the base GEMM)",
                  "swift_liger_fp8_no_hw_cvt": "`--use_liger --liger_fp8_base true`, SWIFT_LIGER_FP8_HW_CVT=0 (an "
                                               "IEEE division per element instead of the GPU's e4m3 conversion)"}
VARIANT_ENV = {"swift_liger_graphs_always": {"SWIFT_LIGER_GRAPH_LAYERS": "always"},
               "swift_liger_compile_ahead": {"SWIFT_LIGER_COMPILE_AHEAD": "1"},
               "swift_liger_no_compile_ahead": {"SWIFT_LIGER_COMPILE_AHEAD": "0"},
               "swift_liger_no_grad_eager": {"SWIFT_LIGER_GRAPH_NO_GRAD": "0"},
               "swift_liger_profiled": {"SWIFT_LIGER_PROFILE_FIRST_STEP": "40"},
               "swift_liger_no_base_epilogue": {"SWIFT_LIGER_LORA_BASE_EPILOGUE": "0"},
               "swift_liger_fp8_no_hw_cvt": {"SWIFT_LIGER_FP8_HW_CVT": "0"}}
SWIFT_MODEL_FLAGS = {"llama": ["--model_type", "llama", "--template", "chatml"],
                     "qwen2": ["--model_type", "qwen2", "--template", "qwen"]}
SHAPES = {name: dims for name, dims in shapes.SHAPES.items() if dims.family in SWIFT_MODEL_FLAGS and name != "tiny"}
TASKS = ("sft", "dpo", "orpo", "cpo", "simpo", "kto", "grpo", "gkd")
GRPO_PROMPT_TOKENS = 96   # grpo.jsonl: one short user turn; the completions (tokens of --seq) are the rows' bulk
GRPO_PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_plugin.py")
CPU_FLAGS = ["--torch_dtype", "float32", "--bf16", "false", "--fp16", "false"]
# Room left under --seq for the chat template's tokens and BPE boundary effects; rows stay under max_length.
SEQ_MARGIN = 64
MODEL_MAX_LENGTH = 32768   # max positions and tokenizer length of every build up to this --seq (one model per shape)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
VERSIONS = ("torch", "triton", "transformers", "ms-swift", "peft", "liger-kernel", "swift-liger")


# ---------------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------------

def _fill(text, tok, target):
    """Sentences, topped up with single words, whose encoding is at most `target` tokens and close to it (the
    byte-level pre-tokenizer splits at spaces, so counts add up over ' '-joined pieces; the final encode checks it)."""
    parts, n = [], 0
    for make in (lambda: text.sentence(6, 24), lambda: text.rng.choice(text.words)):  # sentences, then words
        misses = 0
        while misses < 8:
            s = (" " if parts else "") + make()
            k = len(tok.encode(s, add_special_tokens=False))
            if n + k > target:
                misses += 1
                continue
            parts.append(s)
            n += k
    out = "".join(parts)
    while parts and len(tok.encode(out, add_special_tokens=False)) > target:
        parts.pop()
        out = "".join(parts)
    return out


def _row_lengths(tokenizer, rows):
    """Token count of each row as ms-swift's chatml template encodes it (content encoded per segment)."""
    lengths = []
    for row in rows:
        n = 0
        for m in row["messages"]:
            n += len(tokenizer.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False))
            n += len(tokenizer.encode(m["content"], add_special_tokens=False))
            n += len(tokenizer.encode("<|im_end|>\n", add_special_tokens=False))
        lengths.append(n)
    return lengths


def build(args) -> dict:
    from transformers import GenerationConfig  # lazy: seconds to import; run and report never need it

    dims = SHAPES[args.shape]
    arch, tied = dims.family, dims.tied
    flags = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")   # each overrides the shape's
    for key in flags:
        if getattr(args, key) is None:
            setattr(args, key, getattr(dims, key))
    dims = dataclasses.replace(dims, head_dim=None, **{k: getattr(args, k) for k in flags})   # hidden / heads

    model_keys = ("shape", "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seed", "tok_vocab")
    reuse = None
    if args.model_from:   # another build's weights and tokenizer: they depend on the model keys only, not on --seq
        with open(os.path.join(args.model_from, "build.json")) as f:
            other = json.load(f)
        theirs = {k: other["config"].get(k) for k in model_keys}
        ours = {k: getattr(args, k) for k in model_keys}
        if theirs != ours or args.seq > MODEL_MAX_LENGTH:
            raise SystemExit(f"--model-from {args.model_from}: its model was built with {theirs}, this build asks "
                             f"for {ours} (and --seq <= {MODEL_MAX_LENGTH})")
        reuse = os.path.realpath(other["model"])
        if os.path.lexists(os.path.join(args.outdir, "model")):
            raise SystemExit(f"{args.outdir}/model exists: --model-from would link it to {reuse}")

    t0 = time.time()
    os.makedirs(args.outdir, exist_ok=True)
    model_dir = os.path.join(args.outdir, "model")
    tok_vocab = min(args.tok_vocab, args.vocab)
    tokenizer = tiny.build_tokenizer(tiny.TinySpec(arch="llama", vocab_size=tok_vocab, seed=args.seed))
    if len(tokenizer) > args.vocab:
        raise SystemExit(f"tokenizer has {len(tokenizer)} ids, more than --vocab {args.vocab}")
    tokenizer.model_max_length = max(args.seq, MODEL_MAX_LENGTH)   # one value for every --seq: the model is reusable
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    t_tok = time.time() - t0

    # dataset: one user turn (~1/4) + one assistant turn (~3/4), total just under --seq
    text = tiny._Text(args.seed + 2)
    overhead = _row_lengths(tokenizer, [{"messages": tiny._chat("", "")}])[0]
    budget = args.seq - SEQ_MARGIN - overhead
    rows = []
    rng = random.Random(args.seed + 3)
    for _ in range(args.rows):
        target = budget
        if args.lengths == "longtail":   # log-uniform between 64 tokens and the full budget (mean ~budget / ln)
            target = int(math.exp(rng.uniform(math.log(64), math.log(budget))))
        q = _fill(text, tokenizer, target // 4)
        a = _fill(text, tokenizer, target - len(tokenizer.encode(q, add_special_tokens=False)))
        rows.append({"messages": tiny._chat(q, a)})
    lengths = _row_lengths(tokenizer, rows)
    if max(lengths) > args.seq - 8:
        raise SystemExit(f"rows too long for --seq {args.seq}: max {max(lengths)} tokens")
    if arch != "llama":   # the qwen template adds a default system turn
        overhead += len(tokenizer.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
                                         add_special_tokens=False))
        budget = args.seq - SEQ_MARGIN - overhead
    sft = os.path.join(args.outdir, "sft.jsonl")
    tiny.write_jsonl(sft, rows)
    # preference pairs: one prompt, a chosen and a rejected answer, each sequence just under --seq tokens
    prompt_budget = int(budget * args.prompt_frac)
    pairs = []
    for _ in range(args.pref_rows):
        q = _fill(text, tokenizer, prompt_budget)
        rest = budget - len(tokenizer.encode(q, add_special_tokens=False))
        pairs.append({"messages": tiny._chat(q, _fill(text, tokenizer, rest)),
                      "rejected_response": _fill(text, tokenizer, rest)})
    pref = os.path.join(args.outdir, "pref.jsonl")
    tiny.write_jsonl(pref, pairs)
    grpo = os.path.join(args.outdir, "grpo.jsonl")   # prompts only: GRPO generates the completions
    tiny.write_jsonl(grpo, [{"messages": [{"role": "user", "content": _fill(text, tokenizer, GRPO_PROMPT_TOKENS)}]}
                            for _ in range(args.pref_rows)])
    pref_lengths = _row_lengths(tokenizer, [{"messages": r["messages"]} for r in pairs]) + _row_lengths(
        tokenizer, [{"messages": tiny._chat(r["messages"][0]["content"], r["rejected_response"])} for r in pairs])
    t_data = time.time() - t0 - t_tok

    if reuse:
        os.symlink(reuse, model_dir)
        params, t_init, t_save = other["params"], 0.0, 0.0
    else:
        cfg = shapes.hf_config(dims, max_positions=max(args.seq, MODEL_MAX_LENGTH), hidden_act="silu",
                               bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
        # every parameter born on the device in bf16: init is a few kernels each
        model = shapes.build_model(cfg, device=args.device, dtype=torch.bfloat16, attn=None, seed=args.seed)
        model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None,
                                                   do_sample=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        params = sum(p.numel() for p in model.parameters())
        t_init = time.time() - t0 - t_tok - t_data
        model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="5GB")
        tokenizer.save_pretrained(model_dir)
        del model
        t_save = time.time() - t0 - t_tok - t_data - t_init
    info = {"model": model_dir, "model_from": reuse, "sft": sft, "pref": pref, "grpo": grpo,
            "swift_flags": ["--model", model_dir, *SWIFT_MODEL_FLAGS[arch], "--dataset", sft],
            "params": params, "config": {"shape": args.shape, "model_type": arch, "tied": tied,
                                         **{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                                          "kv_heads", "vocab", "seq", "rows",
                                                                          "pref_rows", "prompt_frac", "seed",
                                                                          "tok_vocab", "lengths")}},
            "tokenizer_vocab": len(tokenizer), "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None,
            "row_tokens": {"min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / len(lengths), 1)},
            "pref_sequence_tokens": {"min": min(pref_lengths), "max": max(pref_lengths),
                                     "mean": round(sum(pref_lengths) / len(pref_lengths), 1)},
            "seconds": {"tokenizer": round(t_tok, 1), "dataset": round(t_data, 1), "init": round(t_init, 1),
                        "save": round(t_save, 1), "total": round(time.time() - t0, 1)}}
    write_json(os.path.join(args.outdir, "build.json"), info, indent=2)
    return info


# ---------------------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------------------

def _model_flags(model) -> list:
    with open(os.path.join(model, "config.json")) as f:
        return SWIFT_MODEL_FLAGS[json.load(f)["model_type"]]


def task_flags(task: str, seq: int, teacher=None, generations: int = 8) -> list:
    """`swift rlhf` flags of the on-policy tasks. grpo: --num_generations completions of exactly --seq tokens per
    prompt, one prompt's group per micro-batch, from grpo_plugin's instant rollout (the training phase at full
    length, generation skipped); gkd: off-policy distillation (--lmbda 0: the dataset's responses, no generation)
    from the --teacher model, ms-swift's default beta 0.5 and temperature 0.9."""
    if task == "grpo":
        return ["--use_vllm", "false", "--external_plugins", GRPO_PLUGIN, "--reward_funcs", "swift_liger_bench_reward",
                "--num_generations", str(generations), "--max_completion_length", str(seq)]
    if task == "gkd":
        if not teacher:
            raise SystemExit("--task gkd needs --teacher MODEL_DIR")
        with open(os.path.join(teacher, "config.json")) as f:
            teacher_type = json.load(f)["model_type"]
        return ["--teacher_model", teacher, "--teacher_model_type", teacher_type, "--lmbda", "0", "--seq_kd", "false"]
    return []


def swift_command(model, dataset, variant, output_dir, seq, steps, extra=(), python=None, task="sft",
                  tuner="lora", grad_accum=1, teacher=None, generations=8) -> list:
    sub = ["sft"] if task == "sft" else ["rlhf", "--rlhf_type", task]
    tuner_flags = ["--tuner_type", "full"] if tuner == "full" else [
        "--tuner_type", "lora", "--target_modules", "all-linear", "--lora_rank", "16", "--lora_alpha", "32"]
    return [python or sys.executable, "-m", "swift.cli.main", *sub,
            "--model", model, *_model_flags(model), "--dataset", dataset, *tuner_flags,
            "--torch_dtype", "bfloat16", "--attn_impl", "sdpa", "--gradient_checkpointing", "true",
            "--per_device_train_batch_size", str(generations if task == "grpo" else 1),
            "--gradient_accumulation_steps", str(grad_accum),
            "--max_length", str(seq + 2 * GRPO_PROMPT_TOKENS if task == "grpo" else seq),   # grpo: prompt + seq
            "--max_steps", str(steps), "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0",
            "--dataset_num_proc", "1", "--check_model", "false", "--learning_rate", "1e-5", "--seed", "42",
            "--liger_metrics", "true", "--output_dir", output_dir,
            *task_flags(task, seq, teacher, generations), *VARIANT_FLAGS[variant], *extra]


def summarize(rows, warmup) -> dict:
    measured = [r for r in rows if r["step"] > warmup and "tokens/s" in r]
    out = {"steps_logged": len(rows), "steps_measured": len(measured), "warmup": warmup,
           "final_loss": rows[-1]["loss"] if rows else None,
           "first_loss": rows[0]["loss"] if rows else None}
    if measured:
        tps = [r["tokens/s"] for r in measured]
        st = [r["step_time(s)"] for r in measured]
        tokens = [t * s for t, s in zip(tps, st)]
        out.update({"tokens_per_s": statistics.median(tps), "tokens_per_s_mean": statistics.fmean(tps),
                    "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                    "step_time_s": statistics.median(st),
                    # rows of varying length: every measured token over every measured second (first calls of a
                    # new batch shape included), where the median step says little
                    "tokens_per_s_total": sum(tokens) / sum(st),
                    "tokens_per_step": round(statistics.median(tokens))})
    for key, name in (("peak_alloc(GiB)", "peak_allocated_gib"), ("peak_reserved(GiB)", "peak_reserved_gib"),
                      ("memory(GiB)", "swift_memory_gib"), ("rss(GiB)", "rss_gib")):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[name] = max(vals)
    mfu = [r["MFU"] for r in measured if isinstance(r.get("MFU"), (int, float))]
    if mfu:
        out["mfu"] = statistics.median(mfu)
    return out


def _versions() -> dict:
    return {"python": platform.python_version(), **versions(VERSIONS)}   # swift-liger from a checkout: "(source tree)"


def _last_flag(cmd, flag):
    vals = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
    return vals[-1] if vals else None


def stem(task: str, tuner: str, variant: str) -> str:
    """File name of one run's results in the run directory (the 8B sft LoRA runs keep their plain names)."""
    return variant if (task, tuner) == ("sft", "lora") else f"{task}_{tuner}_{variant}"


def run(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    name = stem(args.task, args.tuner, args.variant)
    extra = [a for chunk in (args.extra or []) for a in shlex.split(chunk)]
    if args.cpu:
        extra = CPU_FLAGS + extra
    output_dir = os.path.abspath(os.path.join(args.out, name))
    shutil.rmtree(output_dir, ignore_errors=True)
    cmd = swift_command(args.model, args.dataset, args.variant, output_dir, args.seq, args.steps, extra,
                        task=args.task, tuner=args.tuner, grad_accum=args.grad_accum, teacher=args.teacher,
                        generations=args.generations)
    log_path = os.path.join(args.out, f"{name}.log")
    env = dict(os.environ, **OFFLINE_ENV, **VARIANT_ENV.get(args.variant, {}))
    env["SWIFT_LIGER_BENCH_ROLLOUT"] = args.rollout   # read by grpo_plugin.py
    env.pop("SWIFT_LIGER_DISABLE_HOOK", None)
    cold = None
    if args.cold_triton:   # a first step as on a fresh machine: nothing of Triton's on-disk cache to load
        cold = env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton_cache_{name}_", dir=args.out)
    print(f"[{args.variant}] {shlex.join(cmd[1:])}", flush=True)
    try:
        child = run_child(cmd, timeout=args.timeout, env=env, log_path=log_path, grace=15)
    finally:
        if cold:
            shutil.rmtree(cold, ignore_errors=True)
    rc, timed_out, wall = child.returncode, child.timed_out, child.seconds
    with open(log_path, errors="replace") as log:
        log_text = log.read()

    logs = sorted(glob.glob(os.path.join(output_dir, "v*-*", "logging.jsonl")))
    rows = read_rows(logs[-1]) if logs else []
    if logs:
        shutil.copy(logs[-1], os.path.join(args.out, f"{name}.logging.jsonl"))
        patch = os.path.join(os.path.dirname(logs[-1]), "liger_patch.json")
        if os.path.exists(patch):
            shutil.copy(patch, os.path.join(args.out, f"{name}.liger_patch.json"))
    result = {"variant": args.variant, "task": args.task, "tuner": args.tuner, "grad_accum": args.grad_accum,
              **({"rollout": args.rollout} if args.task == "grpo" else {}),
              "returncode": rc, "timed_out": timed_out, "wall_s": round(wall, 1),
              "command": "python -m swift.cli.main " + shlex.join(cmd[3:]),
              "steps": args.steps, "seq": args.seq, "dtype": _last_flag(cmd, "--torch_dtype"),
              "summary": summarize(rows, args.warmup),
              "rows": rows, "versions": _versions(), "gpu": gpu_name(), "date": utc_now()}
    counted = [ln.split("swift_liger: ", 1)[1].strip() for ln in log_text.splitlines()   # what ran, counted
               if "swift_liger: " in ln and "in the first step" in ln]                 # (integration/runtime.py)
    fusion = [ln for ln in counted if ln.startswith("lora_fusion in the first step")]
    if fusion:
        result["lora_fusion"] = fusion[0]
    if counted:
        result["first_step"] = counted
    if rc != 0 or not rows:
        if timed_out:   # killed: the log has no error of its own (backend import notices are not one)
            result["error"] = f"timed out after {args.timeout}s, {len(rows)} of {args.steps} steps logged"
        else:   # the raised exception's own line ("torch.OutOfMemoryError: ..."), else any line naming an error
            raised = re.compile(r"^[\w.]*(Error|Exception)\b")
            errors = tail(log_text, 2, 800, prefer=raised.match)
            if not raised.match(errors):
                errors = tail(log_text, 6, 800, prefer=lambda ln: "Error" in ln or "error:" in ln or "Exception" in ln)
            result["error"] = f"exit code {rc}: {errors}"
    write_json(os.path.join(args.out, f"{name}.json"), result)
    s = result["summary"]
    for r in rows:
        print(f"[{args.variant}] step {r['step']:3d} loss {r['loss']:.4f} "
              f"tok/s {r.get('tokens/s', '—')} step {r.get('step_time(s)', '—')} s "
              f"peak_alloc {r.get('peak_alloc(GiB)', '—')} GiB", flush=True)
    if "error" in result:
        print(f"[{args.variant}] FAILED ({result['wall_s']} s): {result['error']}", flush=True)
    else:
        print(f"[{args.variant}] done in {result['wall_s']} s: {s.get('tokens_per_s', 0):.0f} tok/s (median of "
              f"{s['steps_measured']} steps), peak alloc {s.get('peak_allocated_gib', '—')} GiB, "
              f"final loss {s['final_loss']:.4f}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------

def report(args) -> str:
    results = []
    for v in VARIANTS:
        path = os.path.join(args.dir, f"{stem(args.task, args.tuner, v)}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    if not results:
        raise SystemExit(f"no variant JSON in {args.dir}")
    build_info = None
    if args.build and os.path.exists(os.path.join(args.build, "build.json")):
        with open(os.path.join(args.build, "build.json")) as f:
            build_info = json.load(f)
    first = results[0]
    env = {"gpu": next((r["gpu"] for r in results if r.get("gpu")), None), **first["versions"],
           "date": max(r["date"] for r in results)}
    env["cuda"] = torch.version.cuda
    env["gpu"] = env["gpu"] or gpu_name()
    steps, seq = first["steps"], first["seq"]
    warmup = first["summary"]["warmup"]
    build_cmd = build_info and ("python -m swift_liger.bench.swift_cli build " +
                                os.path.dirname(build_info["model"]) + " " +
                                " ".join(f"--{k.replace('_', '-')} {v}" for k, v in build_info["config"].items()
                                         if k not in ("seed", "model_type", "tied")))
    # rows of varying length: steps differ by shape and a new shape's first calls count, so the median step says
    # little; the rate is every measured token over every measured second
    varying = (build_info or {}).get("config", {}).get("lengths") == "longtail"
    stat = "tokens_per_s_total" if varying else "tokens_per_s"
    base = next((r for r in results if r["variant"] == "plain" and r["summary"].get(stat)), None)
    rlhf = args.task != "sft"
    cli = f"swift rlhf --rlhf_type {args.task}" if rlhf else "swift sft"
    shape_name = (build_info or {}).get("config", {}).get("shape", "llama3-8b")
    tuning = "LoRA r=16 on all linears" if args.tuner == "lora" else "full fine-tuning"
    lines = [f"# End to end: `{cli}` CLI, {shape_name}-shaped, "
             f"{'LoRA' if args.tuner == 'lora' else 'full fine-tuning'}", "",
             versions_line(env, *VERSIONS[1:], cuda=False), ""]
    shape = "model from the build step"
    if build_info:
        c, n = build_info["config"], build_info["params"]
        size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"
        shape = f"{c['layers']} layers, hidden {c['hidden']}, vocab {c['vocab']}, {size} params"
    rows_tok = (f"each row {build_info['row_tokens']['min']}–{build_info['row_tokens']['max']} tokens"
                if build_info else f"rows just under {seq} tokens")
    micro = f"batch 1 × one row ({rows_tok}, `--max_length {seq}`)"
    if rlhf:
        pt = (build_info or {}).get("pref_sequence_tokens")
        seqs = f"{pt['min']}–{pt['max']} tokens each" if pt else f"just under {seq} tokens each"
        micro = (f"batch 1 × one preference pair per micro-batch (chosen and rejected sequences {seqs}, "
                 f"`--max_length {seq}`), `--gradient_accumulation_steps {first.get('grad_accum', 1)}`")
    if args.task == "grpo":
        cmd = first["command"].split()
        g = _last_flag(cmd, "--num_generations")
        micro = (f"one prompt of ~{GRPO_PROMPT_TOKENS} tokens × {g} completions of exactly {seq} tokens per "
                 f"micro-batch (`swift_liger/bench/grpo_plugin.py`: an instant rollout of random tokens, so the "
                 f"step is the training phase: reference log-probs, the policy's forward and backward, the "
                 f"optimizer), ms-swift's GRPO defaults (beta 0.04, loss_type grpo)")
    elif args.task == "gkd":
        teacher = _last_flag(first["command"].split(), "--teacher_model")
        tb = os.path.join(os.path.dirname(teacher), "build.json")
        if os.path.exists(tb):   # a build of this tool: name its shape
            with open(tb) as f:
                t = json.load(f)
            teacher = (f"{t['config']['shape']}-shaped, {t['config']['layers']} layers, vocab {t['config']['vocab']}, "
                       f"{t['params'] / 1e9:.2f} B params")
        micro = (f"batch 1 × one row ({rows_tok}), off-policy distillation (`--lmbda 0 --seq_kd false`) from "
                 f"a random-init teacher ({teacher}), ms-swift's defaults beta 0.5, temperature 0.9")
    dtype = first.get("dtype") or "bfloat16"
    lines += [f"The real `{cli}` CLI (one process per variant) on a random-init {shape_name}-shaped model "
              f"({shape}); {micro}, {dtype}, SDPA, gradient "
              f"checkpointing, {tuning}, AdamW, {steps} steps. Throughput and memory are "
              f"swift_liger's per-step metrics (`--liger_metrics`, on in every variant, no patching): tokens/s = "
              + ("all tokens / all seconds of" if varying else "median over") +
              f" steps {warmup + 1}–{steps} (steps 1–{warmup} are warm-up); peak allocated / reserved = "
              f"`torch.cuda.max_memory_*` reset each step, max over all steps. Loss after step {steps} "
              f"(random init and random text: only a sanity check that the variants agree).", "",
              "| variant | tokens/s | vs plain | step s | peak allocated GiB | peak reserved GiB | final loss |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r["summary"]
        label = VARIANT_LABELS.get(r["variant"], r["variant"])
        if "error" in r and not s.get(stat):
            lines.append(f"| {label} | failed: {r['error'][:160].replace('|', '/')} | | | | | |")
            continue
        rel = f"{s[stat] / base['summary'][stat]:.2f}×" if base else "—"
        lines.append(f"| {label} | {s[stat]:.0f} | {rel} | {fmt(s.get('step_time_s'), '.3f')} | "
                     f"{fmt(s.get('peak_allocated_gib'), '.2f')} | {fmt(s.get('peak_reserved_gib'), '.2f')} | "
                     f"{fmt(s.get('final_loss'), '.4f')} |")
    lines += [""]
    notes = [f"- {r['variant']}: {r['summary'].get('tokens_per_step', '?')} tokens/step, "
             f"{r['summary']['steps_measured']} measured steps, tokens/s min–max "
             f"{fmt(r['summary'].get('tokens_per_s_min'), '.0f')}–"
             f"{fmt(r['summary'].get('tokens_per_s_max'), '.0f')} (all measured tokens / all measured seconds "
             f"{fmt(r['summary'].get('tokens_per_s_total'), '.0f')}), "
             f"MFU {fmt(r['summary'].get('mfu'), '.3f')}, ms-swift memory(GiB) "
             f"{fmt(r['summary'].get('swift_memory_gib'), '.2f')}, whole CLI run {r['wall_s']} s"
             + ("; counted in the first step: " + " / ".join(r["first_step"]) if r.get("first_step") else "")
             + (f", error: {r['error'][:300]}" if r.get("error") else "")
             for r in results]
    lines += notes + [""] + ([args.note, ""] if args.note else [])
    lines += ["Commands (env HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1; "
              "`tools/gpu_swift_cli.sh` runs them all):", "", "```"]
    if build_cmd:
        lines.append(build_cmd)
    for r in results:
        lines.append(r["command"])
    lines += ["```", ""]
    statistic = "all measured tokens / all measured seconds" if varying else "median over measured steps"
    return write_report(args.out, args.name, {"environment": env, "build": build_info, "warmup": warmup, "steps": steps,
                                              "seq": seq, "tokens_per_s_statistic": statistic,
                                              "results": results}, "\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.swift_cli", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="random-init Llama-3-8B-shaped model + tokenizer + long-row SFT jsonl")
    b.add_argument("outdir")
    b.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="config preset; flags override")
    b.add_argument("--layers", type=int, default=None)
    b.add_argument("--hidden", type=int, default=None)
    b.add_argument("--intermediate", type=int, default=None)
    b.add_argument("--heads", type=int, default=None)
    b.add_argument("--kv-heads", type=int, default=None)
    b.add_argument("--vocab", type=int, default=None)
    b.add_argument("--pref-rows", type=int, default=32, help="preference pairs in pref.jsonl")
    b.add_argument("--prompt-frac", type=float, default=0.25, help="share of a preference sequence in the prompt")
    b.add_argument("--tok-vocab", type=int, default=2048, help="BPE vocab of the tokenizer (ids < --vocab)")
    b.add_argument("--seq", type=int, default=8192)
    b.add_argument("--rows", type=int, default=64)
    b.add_argument("--lengths", default="full", choices=("full", "longtail"),
                   help="full: every sft row just under --seq tokens; longtail: log-uniform 64..--seq (packing)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cuda")
    b.add_argument("--model-from", default=None, metavar="BUILD",
                   help="link BUILD/model (an earlier build of the same shape and seed, any --seq) instead of "
                        "building and saving the weights again; the datasets are still written for this --seq")
    r = sub.add_parser("run", help="one `swift sft` run; writes OUT/<variant>.json")
    r.add_argument("model")
    r.add_argument("dataset")
    r.add_argument("--variant", required=True, choices=VARIANTS)
    r.add_argument("--task", default="sft", choices=TASKS, help="sft, or the --rlhf_type of `swift rlhf`")
    r.add_argument("--tuner", default="lora", choices=("lora", "full"))
    r.add_argument("--grad-accum", type=int, default=1, help="--gradient_accumulation_steps")
    r.add_argument("--teacher", default=None, help="gkd: the teacher's model directory (another build's model)")
    r.add_argument("--generations", type=int, default=8, help="grpo: completions per prompt (one group per batch)")
    r.add_argument("--rollout", default="instant", choices=("instant", "real"),
                   help="grpo: instant random completions (grpo_plugin.py), or ms-swift's pt engine generating them")
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=12, help="--max_steps of the run (warm-up included)")
    r.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    r.add_argument("--seq", type=int, default=8192, help="--max_length")
    r.add_argument("--timeout", type=float, default=None, help="kill the run after this many seconds")
    r.add_argument("--cpu", action="store_true", help="add " + " ".join(CPU_FLAGS))
    r.add_argument("--cold-triton", action="store_true", help="run with an empty TRITON_CACHE_DIR of its own (a "
                   "fresh machine's first step: every kernel compiles)")
    r.add_argument("--extra", action="append", help="more swift flags, one shell-quoted string (repeatable)")
    p = sub.add_parser("report", help="merge DIR/<variant>.json into OUT/<name>.json and .md")
    p.add_argument("dir")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--name", default="swift_cli_llama3_8b_lora")
    p.add_argument("--build", default=None, help="build OUTDIR (for build.json: shape, row lengths, command)")
    p.add_argument("--task", default="sft", choices=TASKS)
    p.add_argument("--note", default=None, help="a paragraph added under the table (e.g. how calls were merged)")
    p.add_argument("--tuner", default="lora", choices=("lora", "full"))
    args = ap.parse_args(argv)
    if args.cmd == "build":
        info = build(args)
        print(f"{info['params'] / 1e9:.3f} B params, tokenizer {info['tokenizer_vocab']} ids, rows "
              f"{info['row_tokens']} tokens, {info['seconds']} s -> {args.outdir}")
        print("swift sft " + " ".join(info["swift_flags"]) + f" --max_length {args.seq}")
        return 0
    if args.cmd == "run":
        res = run(args)
        return 0 if "error" not in res else 1
    print(report(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
