"""GRPO rollouts without vLLM: tokens/s of ms-swift's pt engine (TransformersEngine, what `swift rlhf --rlhf_type grpo
--use_vllm false` generates with) on the stock model vs the `--use_liger` model, in one process, interleaved rounds.

    python -m swift_liger.bench.swift_cli build OUTDIR --shape qwen2.5-1.5b --seq 2048
    python -m swift_liger.bench.rollout OUTDIR/model OUTDIR/grpo.jsonl --new-tokens 2048 --out DIR/NAME.json

Each round, every variant generates one GRPO group: --generations completions of up to --new-tokens tokens for one
prompt of grpo.jsonl, sampled at temperature 1 (GRPO's default), through ``engine.infer`` with the request
config GRPO builds (``RolloutTrainerMixin``) on a LoRA-wrapped policy in eval mode, as GRPO's rollout runs it. Variants:

* ``plain``: the stock model (PEFT LoRA, transformers' DynamicCache, SDPA);
* ``swift_liger``: the model patched as `--use_liger` patches the policy (LigerConfig(); LoRA after the patch);
* ``swift_liger_ring``: the same model with ``--liger_rolling_cache W,0``, W = prompt + --new-tokens (a ring that
  never evicts: exact attention), eager decode steps with the split-KV decode kernel;
* ``swift_liger_graph``: ``--liger_rolling_cache W,0,graph``: every decode step a CUDA-graph replay.

A random-init model rarely samples its end-of-sequence id, so completions run to --new-tokens; tokens/s counts
the completion tokens the engine returned; each call's time includes its prefill and, for the graph variant, its
capture (a fresh cache per generate call, as GRPO makes one per rollout). Rounds interleave the variants (the lent
host's speed drifts); the report has each variant's median and spread. Memory: max_memory_allocated during its
generate calls, with every variant's model resident.

    python -m swift_liger.bench.rollout report A.json B.json --out docs/benchmarks/rollout_h200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from .harness import command, gpu_name, sync, utc_now, versions, write_json

VERSIONS = ("torch", "triton", "transformers", "ms-swift", "peft", "swift-liger")
VARIANTS = ("plain", "swift_liger", "swift_liger_ring", "swift_liger_graph")


def _engine(model_dir, model_type, template_type, device):
    import torch
    from swift.infer_engine import TransformersEngine
    return TransformersEngine(model_dir, torch_dtype=torch.bfloat16, attn_impl="sdpa", model_type=model_type,
                              template_type=template_type, max_batch_size=0, device_map=device)


def _lora(model, r):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def run(args) -> dict:
    import torch
    from swift.infer_engine import InferRequest, RequestConfig

    from ..cache.install import (  # lazy: transformers and the kernels load when a run starts, not for report
        generate_counts, install_rolling_cache, uninstall_rolling_cache)
    from ..config import LigerConfig  # lazy: as above
    from ..patcher import apply  # lazy: as above

    with open(os.path.join(args.model, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    template_type = {"qwen2": "qwen", "llama": "chatml"}.get(model_type)
    with open(args.prompts) as f:
        prompt = json.loads(f.readline())["messages"]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")

    engines = {}
    if "plain" in variants:
        engine = _engine(args.model, model_type, template_type, args.device)
        engine.model = _lora(engine.model, args.lora_r)
        engines["plain"] = engine
    patched = None
    if any(v.startswith("swift_liger") for v in variants):
        engine = _engine(args.model, model_type, template_type, args.device)
        root = engine.model
        patched = apply(root, LigerConfig())
        engine.model = _lora(root, args.lora_r)
        engines["swift_liger"] = engine
    request = InferRequest(messages=prompt)
    prompt_tokens = len(engines[next(iter(engines))].template.encode(request)["input_ids"])
    window = prompt_tokens + args.new_tokens
    config = RequestConfig(n=1, max_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=None,
                           repetition_penalty=1.0, return_details=True)

    warm_config = RequestConfig(n=1, max_tokens=min(32, args.new_tokens), temperature=1.0, top_p=1.0, top_k=None,
                                repetition_penalty=1.0, return_details=True)

    def one(variant, config=config):
        engine = engines["plain" if variant == "plain" else "swift_liger"]
        root = engine.model.get_base_model()
        ring = variant in ("swift_liger_ring", "swift_liger_graph")
        if ring:
            install_rolling_cache(root, window=window, sinks=0,
                                  cuda_graph=variant == "swift_liger_graph" and args.device.startswith("cuda"))
        try:
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(args.device)
            t0 = time.perf_counter()
            out = engine.infer([request] * args.generations, config, use_tqdm=False)
            sync(args.device)
            seconds = time.perf_counter() - t0
            counts = generate_counts(root)
        finally:
            if ring:
                uninstall_rolling_cache(root)
        tokens = sum(len(r.choices[0].token_ids or []) for r in out)
        row = {"variant": variant, "seconds": round(seconds, 4), "completion_tokens": tokens,
               "tokens_per_s": round(tokens / seconds, 1)}
        if args.device.startswith("cuda"):
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        if counts is not None:
            row["rolling_cache"] = counts
        return row

    rows = []
    for v in variants:   # warm-up (32 new tokens): Triton compiles, cuBLAS plans, a first graph capture
        row = one(v, warm_config)
        print(json.dumps({"warmup": True, **row}), flush=True)
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            row = one(v)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = _result(args, variants, rows, model_type, prompt_tokens, window, patched)
        if args.out:   # after every round: a call cut short keeps the rounds it finished
            write_json(args.out, result, indent=2)
    return result


def _result(args, variants, rows, model_type, prompt_tokens, window, patched) -> dict:
    summary = {}
    for v in variants:
        tps = [x["tokens_per_s"] for x in rows if x["variant"] == v]
        if not tps:
            continue
        summary[v] = {"tokens_per_s_median": round(statistics.median(tps), 1), "tokens_per_s_min": min(tps),
                      "tokens_per_s_max": max(tps),
                      "peak_gib": max((x["peak_gib"] for x in rows if x["variant"] == v and "peak_gib" in x),
                                      default=None)}
    base = summary.get("plain", {}).get("tokens_per_s_median")
    for v in summary:
        if base:
            summary[v]["vs_plain"] = round(summary[v]["tokens_per_s_median"] / base, 2)
    result = {"bench": "rollout", "model": args.model, "model_type": model_type, "prompt_tokens": prompt_tokens,
              "new_tokens": args.new_tokens, "generations": args.generations, "lora_r": args.lora_r,
              "rounds": args.rounds, "window": window, "device": args.device,
              "gpu": gpu_name(args.device), "versions": versions(VERSIONS), "date": utc_now(),
              "command": command("python -m swift_liger.bench.rollout", getattr(args, "argv", None)),
              "patched": sorted(k for k, on in (patched.patched if patched is not None else {}).items() if on),
              "rows": rows, "summary": summary}
    return result


LABELS = {"plain": "stock pt engine (PEFT LoRA, DynamicCache)", "swift_liger": "`--use_liger`, transformers' cache",
          "swift_liger_ring": "`--use_liger --liger_rolling_cache exact` (eager)",
          "swift_liger_graph": "`--use_liger` (rollouts: `exact,graph`, the default on CUDA)"}


def report(paths, out, note=None) -> str:
    """Merge rollout JSONs into OUT.json / OUT.md (+ OUT.png: tokens/s per variant and point, spread as bars)."""
    results = [json.load(open(p)) for p in paths]
    def shape(r):   # /tmp/model_<shape>_<seq>/model -> <shape>
        return os.path.basename(os.path.dirname(r["model"])).replace("model_", "").rsplit("_", 1)[0]
    lines = ["# GRPO rollouts without vLLM: ms-swift's pt engine, stock vs `--use_liger`", "",
             f"{results[0]['gpu']}, " + ", ".join(f"{k} {v}" for k, v in results[0]["versions"].items())
             + f", {results[0]['date']}. `python -m swift_liger.bench.rollout` (one process, variants interleaved, "
             "rounds alternate their order): one GRPO group per call, completions sampled at temperature 1 through "
             "`TransformersEngine.infer` (what `swift rlhf --rlhf_type grpo --use_vllm false` calls) on a PEFT LoRA "
             "r16 all-linear policy of random-init weights; tokens/s = completion tokens returned / wall time of the "
             "call (prefill, every decode step, sampling, ms-swift's stop-word checks and, for graphs, the capture "
             "of that call's fresh cache). Median over rounds, [min, max]: the host's eager speed drifts up to 2x "
             "between rounds, graph replays do not.", ""]
    lines += ["| model shape | completions | " + " | ".join(LABELS[v] for v in LABELS) + " |",
              "|---|---|" + "---:|" * len(LABELS)]
    merged = []
    for r in results:
        cells = []
        for v in LABELS:
            sm = r["summary"].get(v)
            if sm is None:
                cells.append("—")
                continue
            ratio = f", {sm['vs_plain']:.2f}x" if "vs_plain" in sm and v != "plain" else ""
            cells.append(f"{sm['tokens_per_s_median']:.0f} [{sm['tokens_per_s_min']:.0f}, "
                         f"{sm['tokens_per_s_max']:.0f}]{ratio}")
        lines.append(f"| {shape(r)} | {r['generations']} x {r['new_tokens']} (prompt {r['prompt_tokens']}), "
                     f"{r['rounds']} round(s) | " + " | ".join(cells) + " |")
        merged.append({"shape": shape(r), **{k: r[k] for k in ("new_tokens", "generations", "prompt_tokens",
                                                               "rounds", "window", "command", "summary", "rows")}})
    lines += ["", "Peak memory during the calls (max_memory_allocated, the models of every variant resident): "
              + "; ".join(f"{shape(r)} x {r['new_tokens']}: " + ", ".join(
                  f"{v} {sm['peak_gib']} GiB" for v, sm in r["summary"].items()) for r in results) + ".", ""]
    if note:
        lines += [note, ""]
    lines += ["Commands:", ""] + [f"    {r['command']}" for r in results] + [""]
    text = "\n".join(lines)
    with open(out + ".md", "w") as f:
        f.write(text)
    write_json(out + ".json", {"gpu": results[0]["gpu"], "versions": results[0]["versions"],
                               "date": results[0]["date"], "note": note, "points": merged}, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return text
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(LABELS)
    for i, v in enumerate(LABELS):
        xs, ys, lo, hi = [], [], [], []
        for j, r in enumerate(results):
            sm = r["summary"].get(v)
            if sm:
                xs.append(j + i * width)
                ys.append(sm["tokens_per_s_median"])
                lo.append(sm["tokens_per_s_median"] - sm["tokens_per_s_min"])
                hi.append(sm["tokens_per_s_max"] - sm["tokens_per_s_median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], label=LABELS[v].replace("`", ""), capsize=3)
    ax.set_xticks([j + width * (len(LABELS) - 1) / 2 for j in range(len(results))])
    ax.set_xticklabels([f"{shape(r)}\n{r['generations']} x {r['new_tokens']}" for r in results])
    ax.set_ylabel("completion tokens/s")
    ax.set_title(f"GRPO rollouts through ms-swift's pt engine ({results[0]['gpu']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "report":
        r = argparse.ArgumentParser(prog="python -m swift_liger.bench.rollout report")
        r.add_argument("results", nargs="+", help="JSON files written by --out")
        r.add_argument("--out", required=True, help="path prefix: OUT.md, OUT.json, OUT.png")
        r.add_argument("--note", default=None)
        a = r.parse_args(argv[1:])
        print(report(a.results, a.out, a.note))
        return 0
    p = argparse.ArgumentParser(prog="python -m swift_liger.bench.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model dir (swift_liger.bench.swift_cli build OUTDIR -> OUTDIR/model)")
    p.add_argument("prompts", help="a jsonl of {'messages': [...]} rows (build's grpo.jsonl); the first is used")
    p.add_argument("--new-tokens", type=int, default=2048, help="GRPO's --max_completion_length")
    p.add_argument("--generations", type=int, default=8, help="GRPO's --num_generations (one group per call)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    args.argv = argv   # the command the result records
    for name in ("new_tokens", "generations", "rounds", "lora_r"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    res = run(args)
    print(json.dumps(res["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
