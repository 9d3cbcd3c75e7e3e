"""End-to-end training, stock vs swift_liger, one row per model family (plain PyTorch loop, one process).

    python -m swift_liger.bench.families --out DIR [--families llama,gemma2,...] [--tuners lora,full]
                                         [--steps 8] [--warmup 2] [--seq 1024] [--device cuda] [--dtype bf16]
    SWIFT_LIGER_BACKEND=torch python -m swift_liger.bench.families --tiny --device cpu --dtype fp32 \\
                                         --steps 2 --seq 32 --out /tmp/fam      # pipeline check on CPU

For every family (model_type) and tuner (LoRA r=16 on all linears, or full fine-tuning) a small random-init model
is built from `AutoConfig.for_model(model_type, ...)` (hidden 1024, 4 layers, 8 query / 4 KV heads of 128, vocab
32000; a one-block vision tower for the VL families, trained on text only) twice with the same seed: once left
stock, once `swift_liger.apply`-ed (defaults, before LoRA). Both train warm-up + measured steps on the same batches
(2 x seq random ids, first 16 labels masked) with gradient checkpointing and AdamW. Each model is freed before the
next one is built, so every peak is its own. Attention is SDPA, except gemma2: transformers' SDPA path ignores its
attention-logit softcapping, so it runs eager (`--attn` overrides; the row records what ran).

Measured per variant: tokens/s over the measured steps (CUDA-synchronised wall clock), peak allocated memory over
the whole run (weights, optimizer state, activations), the loss at every step. Per row: both, their ratios, the
largest relative loss difference over all steps, what `apply` patched and the kernels' call counts after the run.

Writes DIR/families_e2e.json and DIR/families_e2e.md after every row, so a timeout keeps the rows done so far.
On CPU the timings mean nothing and memory is null; the run only checks that every family builds and trains.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

import swift_liger

from .harness import DTYPES, GiB, counted, describe, environment, fmt, free, header, sync, write_report
from .shapes import ModelDims, build_model as build, config_kwargs, hf_config, train_ready

FAMILIES = ("llama", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "glm4", "qwen2_5_vl",
            "qwen3_vl")
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
TUNERS = ("lora", "full")
VARIANTS = ("stock", "swift_liger")
LR = {"lora": 1e-4, "full": 1e-5}
BATCH = 2
MASKED_PREFIX = 16   # labels of the first positions are -100, as a prompt would be
SEED = 0

# Every family at these dims (family None: each row's own; rope, eps, tying: the family's defaults). Big enough that
# a step is not launch-bound on a GPU, small enough that 10 families x 2 tuners x 2 variants fit in a few minutes.
DIMS = ModelDims(None, 1024, 2816, 4, 8, 4, 128, 32000, moe_intermediate=704, experts=8, experts_per_tok=2)
TINY = ModelDims(None, 64, 128, 2, 4, 2, 16, 256, moe_intermediate=32, experts=4, experts_per_tok=2)


def _sliding_window(seq: int) -> int:
    # a quarter of the sequence (at most 256), so the sliding layers really mask something
    return max(4, min(256, seq // 4))


def family_config(model_type: str, dims: ModelDims, seq: int):
    """The transformers config of one family at these dims (composite text+vision config for the VL families)."""
    text = dict(config_kwargs(dims, max_positions=max(4096, seq)),
                # family defaults put pad/eos ids past a 32000 vocab (phi3, glm4), which breaks the embedding
                pad_token_id=0, bos_token_id=1, eos_token_id=1, use_cache=False)
    layers = dims.layers
    if model_type in ("gemma2", "gemma3_text"):
        window = _sliding_window(seq)
        text.update(sliding_window=window, query_pre_attn_scalar=dims.head_dim)
        if model_type == "gemma2":   # alternating, as released; keeps both softcappings at their defaults
            text["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:                        # mostly sliding with a full layer last (released: 5 sliding : 1 full)
            text["layer_types"] = ["full_attention" if i == layers - 1 else "sliding_attention"
                                   for i in range(layers)]
    elif model_type == "phi3":
        text.pop("head_dim")          # Phi3 derives it from hidden / heads
        text["original_max_position_embeddings"] = text["max_position_embeddings"]
        text["partial_rotary_factor"] = 0.5
    elif model_type == "glm4":
        text["partial_rotary_factor"] = 0.5    # its default, spelled out
    elif model_type == "qwen3_moe":
        text.update(moe_intermediate_size=dims.moe_intermediate, num_experts=dims.experts,
                    num_experts_per_tok=dims.experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[])
    if model_type not in VL_FAMILIES:
        return hf_config(family=model_type, **text)

    # VL: the language model gets the dims above, the vision tower one small block (it never runs: text-only
    # input). Multimodal RoPE sections must add up to head_dim / 2.
    half = dims.head_dim // 2
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=dims.hidden)
    if model_type == "qwen2_5_vl":
        text.pop("head_dim")          # Qwen2.5-VL's text config derives it from hidden / heads
        section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]   # 16,24,24
        text["rope_parameters"] = dict(rope_type="default", rope_theta=1000000.0, mrope_section=section)
        vision.update(fullatt_block_indexes=[0], window_size=112)
    else:
        section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]                   # 24,20,20
        text["rope_parameters"] = dict(rope_type="default", rope_theta=5000000.0, mrope_section=section,
                                       mrope_interleaved=True)
        vision.update(deepstack_visual_indexes=[0])
    return hf_config(family=model_type, text_config=text, vision_config=vision, tie_word_embeddings=False)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_impl(config, requested: str) -> str:
    """auto: SDPA, except where the family soft-caps attention logits (gemma2): transformers' SDPA path drops
    `softcap` without a word, so that family would silently train another model; it gets eager instead."""
    if requested != "auto":
        return requested
    return "eager" if getattr(_text_config(config), "attn_logit_softcapping", None) else "sdpa"


def build_model(model_type: str, dims: ModelDims, seq: int, device, dtype, attn: str):
    config = family_config(model_type, dims, seq)
    impl = attention_impl(config, attn)
    model = build(config, device=device, dtype=dtype, attn=impl, seed=SEED, image_text=model_type in VL_FAMILIES)
    return model, getattr(model.config, "_attn_implementation", impl)


def make_batches(n: int, seq: int, vocab: int, device) -> List[tuple]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (BATCH, seq), generator=gen)
        labels = ids.clone()
        labels[:, :MASKED_PREFIX] = -100
        out.append((ids.to(device), labels.to(device)))
    return out


def _patch(model) -> Dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swift_liger.apply(model)
    info: Dict[str, Any] = {
        "supported": bool(getattr(report, "supported", True)),
        # an unsupported family (not yet in the patcher) is left stock: record nothing patched and go on
        "patched": {k: v for k, v in report.patched.items() if v} if getattr(report, "supported", True) else {},
        "cross_entropy_mode": getattr(report, "cross_entropy_mode", None),
        "activation": getattr(report, "activation", None),   # the "swiglu" count is geglu for gelu-tanh MLPs
        "skipped": list(getattr(report, "skipped", []) or []),
        "problems": list(getattr(report, "problems", []) or []),
        "summary": str(report),
        "warnings": [str(w.message) for w in caught],
    }
    return json.loads(json.dumps(info, default=str))


def run_variant(model_type: str, tuner: str, variant: str, *, dims: ModelDims, seq: int, steps: int, warmup: int,
                device, dtype, attn: str) -> Dict[str, Any]:
    cuda = torch.device(device).type == "cuda"
    model, impl = build_model(model_type, dims, seq, device, dtype, attn)
    res: Dict[str, Any] = {"variant": variant, "attn_impl": impl}
    if variant == "swift_liger":
        res["report"] = _patch(model)   # before LoRA, as documented: the LoRA layers are picked up afterwards
        print(f"  {res['report']['summary']}", flush=True)
    model = train_ready(model, lora=tuner == "lora", seed=SEED + 1)   # LoRA r=16 on all linears
    params = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=LR[tuner])
    batches = make_batches(warmup + steps, seq, dims.vocab, device)
    losses, times = [], []
    free(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        res["model_gib"] = torch.cuda.memory_allocated() / GiB
    for step, (ids, labels) in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        del loss
        print(f"  {model_type}/{tuner}/{variant} step {step} loss {losses[-1]:.5f} {times[-1] * 1e3:.0f} ms",
              flush=True)
    measured = times[warmup:] or times
    res.update(losses=losses, step_ms=1e3 * sum(measured) / len(measured),
               tokens_per_s=BATCH * seq * len(measured) / sum(measured),
               peak_gib=torch.cuda.max_memory_allocated() / GiB if cuda else None)
    if variant == "swift_liger":
        res["call_counts"] = counted(model)
    del model, opt, params, batches
    return res


def _ratio(a, b):
    return a / b if a is not None and b else None


def run_row(model_type: str, tuner: str, **kw) -> Dict[str, Any]:
    """Both variants of one family and tuner, then the comparison. A variant that raises is recorded in
    `error` (traceback printed), and the other still runs."""
    runs: Dict[str, Dict[str, Any]] = {}
    errors = []
    for variant in VARIANTS:
        try:
            runs[variant] = run_variant(model_type, tuner, variant, **kw)
        except Exception as exc:
            traceback.print_exc()
            errors.append(f"{variant}: {describe(exc, 300)}")
        free(kw["device"])
    stock, ours = runs.get("stock", {}), runs.get("swift_liger", {})
    report = ours.get("report", {})
    row: Dict[str, Any] = {
        "family": model_type, "tuner": tuner,
        "attn_impl": stock.get("attn_impl") or ours.get("attn_impl"),
        "tok_s_stock": stock.get("tokens_per_s"), "tok_s_ours": ours.get("tokens_per_s"),
        "speed_ratio": _ratio(ours.get("tokens_per_s"), stock.get("tokens_per_s")),
        "peak_gib_stock": stock.get("peak_gib"), "peak_gib_ours": ours.get("peak_gib"),
        "memory_ratio": _ratio(ours.get("peak_gib"), stock.get("peak_gib")),
        "max_loss_rel_diff": None,
        "first_loss_stock": (stock.get("losses") or [None])[0],
        "first_loss_ours": (ours.get("losses") or [None])[0],
        "supported": report.get("supported"),
        "patched": report.get("patched"),
        "cross_entropy_mode": report.get("cross_entropy_mode"),
        "activation": report.get("activation"),
        "skipped": report.get("skipped"), "problems": report.get("problems"),
        "call_counts": ours.get("call_counts"),
        "stock": stock, "swift_liger": ours,
    }
    if stock.get("losses") and ours.get("losses"):
        row["max_loss_rel_diff"] = max(abs(o - s) / max(abs(s), 1e-12)
                                       for s, o in zip(stock["losses"], ours["losses"]))
    if errors:
        row["error"] = "; ".join(errors)
    return row


def _fusions(row: Dict[str, Any]) -> str:
    if row.get("supported") is False:
        return "not supported (stock)"
    patched = row.get("patched")
    if not patched:
        return "—"
    parts = []
    for name, count in patched.items():
        if name == "cross_entropy":
            parts.append(f"cross_entropy={row.get('cross_entropy_mode')}")
        else:
            label = row.get("activation") if name == "swiglu" and row.get("activation") else name
            parts.append(f"{label}×{count}")
    if row.get("problems"):
        parts.append(f"problems: {', '.join(p['fusion'] for p in row['problems'])}")
    return ", ".join(parts)


def to_markdown(env: Dict[str, Any], setup: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    d = setup["dims"]
    lines = header("End to end per family: stock vs swift_liger", env, "triton", "transformers", "peft") + [
             f"Random init, {d['layers']} layers, hidden {d['hidden']}, {d['heads']}/{d['kv_heads']} heads of "
             f"{d['head_dim']}, vocab {d['vocab']}; batch {BATCH} × {setup['seq']} tokens, {setup['dtype']} on "
             f"{setup['device']}, gradient checkpointing, AdamW (LoRA r=16 all-linear lr 1e-4; full lr 1e-5); "
             f"{setup['warmup']} warm-up + {setup['steps']} measured steps. Peak = max allocated over the run. "
             f"× columns are ours / stock. Loss diff = max over all steps of |ours − stock| / |stock|.", "",
             "| family | tuner | attn | tok/s stock | tok/s ours | × | peak GiB stock | peak GiB ours | × | "
             "max loss rel diff | fusions |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fusions = _fusions(r) + (f" · **error**: {r['error'][:200]}" if r.get("error") else "")
        lines.append(
            f"| {r['family']} | {r['tuner']} | {r.get('attn_impl') or '—'} | {fmt(r['tok_s_stock'], '.0f')} | "
            f"{fmt(r['tok_s_ours'], '.0f')} | {fmt(r['speed_ratio'], '.2f')} | {fmt(r['peak_gib_stock'], '.2f')} | "
            f"{fmt(r['peak_gib_ours'], '.2f')} | {fmt(r['memory_ratio'], '.2f')} | "
            f"{fmt(r['max_loss_rel_diff'], '.1e')} | {fusions.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write(out_dir: str, env, setup, rows) -> str:
    return write_report(out_dir, "families_e2e", {"environment": env, "setup": setup, "results": rows},
                        to_markdown(env, setup, rows))


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.families", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tuners", default=",".join(TUNERS))
    ap.add_argument("--steps", type=int, default=8, help="measured steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--attn", default="auto", choices=("auto", "sdpa", "eager"),
                    help="auto: sdpa, eager for families that soft-cap attention logits (gemma2)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (hidden 64, vocab 256) for a CPU check")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cpu":
        os.environ.setdefault("SWIFT_LIGER_BACKEND", "torch")   # CPU: the reference ops, no interpreter
    elif torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available (use --tiny --device cpu --dtype fp32 for a CPU check)")
    dtype = DTYPES[args.dtype]
    dims = TINY if args.tiny else DIMS
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    tuners = [t.strip() for t in args.tuners.split(",") if t.strip()]
    if set(tuners) - set(TUNERS):
        ap.error(f"--tuners must be among {', '.join(TUNERS)}")

    env = environment("python -m swift_liger.bench.families", argv)
    setup = {"dims": dims.asdict(), "seq": args.seq, "batch": BATCH, "steps": args.steps,
             "warmup": args.warmup, "device": args.device, "dtype": args.dtype, "attn": args.attn,
             "tiny": args.tiny, "families": families, "tuners": tuners}
    rows: List[Dict[str, Any]] = []
    t_start = time.perf_counter()
    for family in families:
        for tuner in tuners:
            t0 = time.perf_counter()
            print(f"[{family} / {tuner}]", flush=True)
            try:
                row = run_row(family, tuner, dims=dims, seq=args.seq, steps=args.steps, warmup=args.warmup,
                              device=args.device, dtype=dtype, attn=args.attn)
            except Exception as exc:   # anything outside a variant (e.g. the comparison): still one row
                traceback.print_exc()
                row = {"family": family, "tuner": tuner, "tok_s_stock": None, "tok_s_ours": None,
                       "speed_ratio": None, "peak_gib_stock": None, "peak_gib_ours": None, "memory_ratio": None,
                       "max_loss_rel_diff": None, "error": f"{type(exc).__name__}: {exc}"}
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            env["total_seconds"] = time.perf_counter() - t_start
            write(args.out, env, setup, rows)   # after every row: a timeout keeps what is done
            print(f"  -> x{fmt(row.get('speed_ratio'), '.2f')} speed, x{fmt(row.get('memory_ratio'), '.2f')} "
                  f"memory, loss diff {fmt(row.get('max_loss_rel_diff'), '.1e')}, {_fusions(row)}"
                  + (f", ERROR {row['error']}" if row.get("error") else ""), flush=True)
    md = write(args.out, env, setup, rows)
    print(md, flush=True)
    return rows


if __name__ == "__main__":
    main()
