"""Eager decode, caches side by side: what `swift infer --use_liger` runs against what `swift infer` runs.

    python -m swift_liger.bench.eager_decode [--layers 32] [--batches 1,4,8,32] [--contexts 3840,4352,8192,32768]
        [--kinds stock:hf_dynamic_sliding,stock:hf_static_sliding,ours:rolling_absolute,ours:rolling_streaming,
         ours:hf_dynamic_sliding] [--turn-steps 8] [--rounds 8] [--out docs/benchmarks] [--tiny]

Eager decode is host-bound on the lent H200 and its host runs up to 1.9x slower for seconds at a time
(rolling_cache.md), which is larger than any difference between caches when each cache is timed in its own stretch.
Here every kind holds its own cache at once and the kinds take turns of --turn-steps greedy steps (synchronised
before and after), the order rotating every round, so a slow stretch hits all of them; each kind's ms/token is the
median of its turns. Kinds are ``model:cache``: ``stock`` is the transformers model as loaded, ``ours`` the same
weights after ``swift_liger.apply`` (our RMSNorm / RoPE / SwiGLU kernels and fused q/k/v and gate/up projections,
i.e. ``--use_liger --liger_fused_projections true``; the loss head is off at inference); caches are those of
swift_liger.bench.rolling_cache (window 4096 + 4 sinks for the rings, the same window for transformers' sliding
layers). Contexts are reached by chunked prefill; each kind advances through them in step. Writes
eager_decode.json and eager_decode.md.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time

import torch

import swift_liger
from swift_liger.ops import _launch

from .harness import GiB, describe, environment, free, sync, write_report
from .rolling_cache import (KINDS, LIGER, ROLLING, build_model, cache_bytes, decode, known_kind, make_cache,
                            model_config, prefill)

DEFAULT_KINDS = ("stock:hf_dynamic_sliding", "stock:hf_static_sliding", "ours:rolling_absolute",
                 "ours:rolling_streaming", "ours:hf_dynamic_sliding")


def _ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x]


def parse_kind(kind: str) -> tuple:
    model, sep, cache = kind.partition(":")
    if not sep or model not in ("stock", "ours") or not known_kind(cache) or cache.endswith(LIGER):
        raise SystemExit(f"--kinds: expected model:cache with model 'stock' or 'ours' and a cache of "
                         f"{', '.join(dict.fromkeys(KINDS + ROLLING))}, got {kind!r}")
    return model, cache


def _direct_launches() -> int:
    return sum(fl.hits for fl in list(_launch._INSTANCES))


def _turn(model, cache, tok, steps, device) -> tuple:
    """(next token, ms per step, launches that took the direct path) over `steps` greedy steps."""
    hits = _direct_launches()
    sync(device)
    t0 = time.perf_counter()
    tok = decode(model, cache, tok, steps)
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    return tok, ms, _direct_launches() - hits


def run(args, log=print) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    kinds = [parse_kind(k) for k in args.kinds]
    stock = build_model(model_config(args), device, dtype)
    models, patched = {"stock": stock}, {}
    if any(m == "ours" for m, _ in kinds):
        ours = copy.deepcopy(stock)
        report = swift_liger.apply(ours, cross_entropy="off", fused_projections=True, graph_layers=False)
        patched = {k: v for k, v in report.patched.items() if isinstance(v, int) and v}
        models["ours"] = ours
    vocab = stock.config.vocab_size
    rows = []
    for batch in args.batches:
        live = {}
        for m, c in kinds:
            live[(m, c)] = dict(cache=make_cache(c, models[m], args), tok=None, ctx=0,
                                gen=torch.Generator(device=device).manual_seed(1))
        try:
            for L in args.contexts:
                for (m, c), st in live.items():
                    need = L - args.warmup - st["ctx"]
                    if need > 0:
                        st["tok"] = prefill(models[m], st["cache"], batch, need, args.prefill_chunk, vocab, device,
                                            st["gen"])
                        st["ctx"] += need
                    st["tok"] = decode(models[m], st["cache"], st["tok"], args.warmup)
                    st["ctx"] += args.warmup
                    st["turns"], st["direct"] = [], 0
                order = list(live)
                gc.collect()
                gc.disable()   # a collection inside a turn would be charged to whichever kind runs
                try:
                    for r in range(args.rounds):
                        k = r % len(order)
                        for key in order[k:] + order[:k]:
                            st = live[key]
                            st["tok"], ms, direct = _turn(models[key[0]], st["cache"], st["tok"], args.turn_steps,
                                                          device)
                            st["turns"].append(ms)
                            st["direct"] += direct
                            st["ctx"] += args.turn_steps
                finally:
                    gc.enable()
                for (m, c), st in live.items():
                    ms = statistics.median(st["turns"])
                    row = dict(batch=batch, kind=f"{m}:{c}", model=m, cache=c, context=L, ms_per_token=round(ms, 3),
                               best_turn=round(min(st["turns"]), 3), turns=[round(t, 3) for t in st["turns"]],
                               tokens_per_s=round(batch * 1e3 / ms, 1), kv_gib=round(cache_bytes(st["cache"]) / GiB, 3),
                               # counted, not configured: launches per step through ops._launch's direct path
                               direct_launches_per_step=round(st["direct"] / (args.rounds * args.turn_steps), 1))
                    rows.append(row)
                    log(f"b={batch:3d} ctx={L:6d} {row['kind']:28s} {row['ms_per_token']:8.3f} ms/tok "
                        f"(best turn {row['best_turn']:.3f})")
                if args.on_row:
                    args.on_row(_report(args, rows, patched))
        except Exception as exc:   # e.g. out of memory at a large batch: reported, the other batches still run
            rows.append(dict(batch=batch, error=describe(exc)))
            log(f"b={batch}: {describe(exc)}")
        del live
        free(device)
    return _report(args, rows, patched)


def _report(args, rows, patched) -> dict:
    return dict(environment=_environment(args), settings=_settings(args), ours_patched=patched, rows=rows,
                ratios=ratios(rows))


def _environment(args) -> dict:
    return environment("python -m swift_liger.bench.eager_decode", args.argv)


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("on_row", "argv")}


def ratios(rows) -> list:
    """Per batch and context: the best transformers sliding cache (lowest ms/token) on the stock model and on our
    model, and each of our rings' speed-up over them (> 1: the ring is faster)."""
    out = []
    cells = {}
    for r in rows:
        if "error" not in r:
            cells.setdefault((r["batch"], r["context"]), []).append(r)
    for (b, L), rs in sorted(cells.items()):
        hf = {m: min((r for r in rs if r["model"] == m and r["cache"].startswith("hf_")),
                     key=lambda r: r["ms_per_token"], default=None) for m in ("stock", "ours")}
        for r in rs:
            if not r["cache"].startswith("rolling"):
                continue
            item = dict(batch=b, context=L, ring=r["kind"], ring_ms=r["ms_per_token"])
            for m, best in hf.items():
                if best is not None:
                    item[f"best_hf_{m}"] = best["kind"]
                    item[f"vs_{m}"] = round(best["ms_per_token"] / r["ms_per_token"], 3)
            out.append(item)
    return out


def markdown(report: dict) -> str:
    env, s = report["environment"], report["settings"]
    lines = ["# Eager decode, caches side by side (interleaved turns)", "",
             f"- date: {env.get('date')}", f"- command: `{env.get('command')}`",
             f"- device: {env.get('gpu')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}",
             f"- {s['layers']} layers of Llama-3-8B shapes{' (tiny)' if s['tiny'] else ''}, window {s['window']} "
             f"+ {s['sinks']} sinks; {s['rounds']} rounds of {s['turn_steps']}-step turns per kind and context "
             f"(median turn), after {s['warmup']} warm-up steps"]
    ours = [r for r in report["rows"] if r.get("model") == "ours" and "direct_launches_per_step" in r]
    if ours:
        direct = [r["direct_launches_per_step"] for r in ours]
        lines.append(f"- ours: modules patched {report.get('ours_patched', {})}; Triton launches per step through "
                     f"the direct path (counted) {min(direct)}-{max(direct)}")
    lines.append("")
    kinds = list(dict.fromkeys(r["kind"] for r in report["rows"] if "kind" in r))
    lines.append("| batch | context | " + " | ".join(kinds) + " |")
    lines.append("|---:|---:|" + "---:|" * len(kinds))
    cells = {}
    for r in report["rows"]:
        if "kind" in r:
            cells[(r["batch"], r["context"], r["kind"])] = r["ms_per_token"]
    for b, L in sorted({(r["batch"], r["context"]) for r in report["rows"] if "kind" in r}):
        vals = [cells.get((b, L, k)) for k in kinds]
        lines.append(f"| {b} | {L} | " + " | ".join("—" if v is None else f"{v:.2f}" for v in vals) + " |")
    lines += ["", "Speed-up of each ring over the fastest transformers sliding cache at the same batch and context "
              "(> 1: the ring is faster): on the stock model (what `swift infer` runs without swift_liger) and on our "
              "model (the cache's own share).", "",
              "| batch | context | ring | vs stock model's best | vs our model's best |", "|---:|---:|---|---:|---:|"]
    for q in report["ratios"]:
        lines.append(f"| {q['batch']} | {q['context']} | {q['ring']} | "
                     f"{q.get('vs_stock', '—')} ({q.get('best_hf_stock', '—')}) | "
                     f"{q.get('vs_ours', '—')} ({q.get('best_hf_ours', '—')}) |")
    errors = [r for r in report["rows"] if "error" in r]
    if errors:
        lines += [""] + [f"- batch {r['batch']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.eager_decode",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", type=_ints, default=[1, 4, 8, 32])
    ap.add_argument("--contexts", type=_ints, default=[3840, 4352, 8192, 32768])
    ap.add_argument("--kinds", type=lambda s: [k for k in s.split(",") if k], default=list(DEFAULT_KINDS))
    ap.add_argument("--turn-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default="eager_decode")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (a logic check, not a measurement)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for k in args.kinds:
        parse_kind(k)
    if args.tiny:
        args.window = min(args.window, 64)
    elif not torch.cuda.is_available():
        raise SystemExit("python -m swift_liger.bench.eager_decode needs a CUDA GPU (or --tiny)")

    def save(report):
        write_report(args.out, args.name, report, markdown(report))

    args.on_row = save
    report = run(args)
    save(report)
    print(markdown(report))


if __name__ == "__main__":
    main()
