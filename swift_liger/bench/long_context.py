"""Longest trainable context (or largest batch at one length) per variant: peak memory and speed (plain PyTorch loop).

    python -m swift_liger.bench.long_context --out DIR [--variants plain,liger,swift_liger,long_context]
        [--seqs 8k,16k,32k,64k,128k,256k,512k] [--layers 32] [--steps 2] [--model llama3-8b|qwen2.5-7b|tiny]
        [--tuner lora|qlora|full] [--deadline SECONDS] [--mem-cap-gib 24 | --mem-fraction F] [--project-layers 32]
    python -m swift_liger.bench.long_context --out DIR --seqs 8k --batches 1,2,4,8 [...]   # batch sweep at one length
    python -m swift_liger.bench.long_context --model tiny --device cpu --seqs 32,64 --steps 1 --out /tmp/lc
                                                                        # pipeline check on CPU (no memory numbers)

Random-init model of the released shapes (llama3-8b: hidden 4096, intermediate 14336, 32 layers, 32/8 heads of 128,
vocab 128256, rope_theta 5e5; qwen2.5-7b: hidden 3584, intermediate 18944, 28 layers, 28/4 heads of 128, vocab
152064, rope_theta 1e6), batch 1 (or --batches), bf16, SDPA, gradient checkpointing (non-reentrant, input grads
enabled), LoRA r=16 alpha 32 dropout 0 on every linear (or full fine-tuning), AdamW. --tuner qlora is that LoRA over
a 4-bit base: after the variant's patch, every nn.Linear of the decoder layers (not lm_head, not the embeddings)
becomes a bitsandbytes Linear4bit, NF4 with double quantization and the model dtype as compute dtype (what
transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
loads), one layer at a time. Variants:

* plain:        the model as transformers builds it;
* liger:        Liger-Kernel (rope, rms_norm, swiglu, fused linear cross-entropy), skipped when not importable;
* swift_liger:  `swift_liger.apply(model)` (defaults);
* long_context: `swift_liger.apply(model, tiled_mlp=8192, offload_checkpoints=True)` (configs/liger/long_context.yaml);
* swift_liger_fp8: `swift_liger.apply(model, fp8_base=True)`, then `swift_liger.quantize_lora_bases(model)` after
  PEFT (LoRA bases in FP8; an sm_89+ GPU, or SWIFT_LIGER_FP8_EMULATE=1 on CPU).

A point is a (sequence length, batch size) pair: (s, 1) for each of --seqs, or with --batches (one --seqs value)
(seq, b) for each b, the [b, seq] batches of a point starting with the same row as batch 1's. For each point
(increasing) every variant still in the race trains 1 warm-up + --steps measured steps in a process of its own
(`--one VARIANT SEQ --batch B`, one JSON line on stdout), so an OOM or a fragmented allocator never
touches the next point. A variant leaves the race at its first point that is not ok: "oom"
(torch.cuda.OutOfMemoryError), "timeout" (the point ran past min(remaining --deadline, --point-timeout); not an
OOM: the peak so far is kept as a lower bound) or "error". Measured per point: peak allocated and peak reserved
GiB (torch.cuda.max_memory_* over all steps, reset right before the first step: weights, optimizer state and
activations), tokens/s (seq * batch tokens per step) and seconds per step over the measured steps, the loss of every
step (same seed, same batches in every variant, so the losses of two variants at one point are comparable).

--mem-cap-gib G caps each child's allocator at exactly G GiB (set_per_process_memory_fraction(G GiB / total), the
first thing a child does): a smaller card emulated on a big one. --layers N < the model's layers measures an N-layer
model; --project-layers L then adds a separate "projection" section (never a measured row): each ok point is run
again at N//2 layers and peak(L) = peak(N) + (L - N) * (peak(N) - peak(N//2)) / (N - N//2).

Writes DIR/long_context.json, DIR/long_context.md and DIR/long_context.png (peak allocated against length, or
against batch size with --batches; not on CPU, where there are no memory numbers) after every point, so a killed run
keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch

import swift_liger

from ..ops.fp8_linear_op import fp8_device_problem
from ..patching.fp8 import emulation_allowed
from .harness import (DTYPES, GiB, counted, describe, environment, fmt, header, last_json, run_child as run_process,
                      tail, write_report)
from .shapes import SHAPES, ModelDims, build_model as build, hf_config, train_ready

VARIANTS = ("plain", "liger", "swift_liger", "long_context", "swift_liger_fp8")
OURS = ("swift_liger", "long_context", "swift_liger_fp8")
DEFAULT_SEQS = "8k,16k,32k,64k,128k,256k,512k"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = {"lora": 1e-4, "qlora": 1e-4, "full": 1e-5}
SEED = 0
DATA_SEED = 1234
POINT_TIMEOUT = 240.0
MIN_START_S = 5.0      # less than this left before the deadline: no new point is started
MODULE = "swift_liger.bench.long_context"


MODELS = {name: dims for name, dims in SHAPES.items() if dims.family in ("llama", "qwen2")}   # Liger patches both


# ----------------------------------------------------------------------------------------------- one point (child)

def parse_seq(text: str) -> int:
    t = str(text).strip().lower()
    mult = {"k": 1024, "m": 1024 ** 2}.get(t[-1:], 1)
    value = int(t[:-1] if mult > 1 else t)
    if value <= 0:
        raise ValueError(f"sequence length must be positive, got {text!r}")
    return value * mult


def seq_label(seq: Optional[int]) -> str:
    if seq is None:
        return "—"
    if seq % (1024 ** 2) == 0:
        return f"{seq // 1024 ** 2}M"
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def build_model(shape: ModelDims, layers: int, seq: int, device, dtype):
    cfg = hf_config(shape, layers=layers, max_positions=max(seq, 4096), use_cache=False)
    return build(cfg, device=device, dtype=dtype, seed=SEED)   # same weights in every variant


def _liger(model, family: str) -> str:
    import liger_kernel.transformers as lk  # lazy: optional peer (the liger variant is skipped without it)

    fn = {"llama": lk.apply_liger_kernel_to_llama, "qwen2": lk.apply_liger_kernel_to_qwen2}[family]
    fn(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    return f"Liger-Kernel {fn.__name__}(rope, rms_norm, swiglu, fused_linear_cross_entropy)"


def patch(model, variant: str, family: str, tiled_mlp: int) -> Optional[str]:
    if variant == "plain":
        return None
    if variant == "liger":
        return _liger(model, family)
    overrides = {"long_context": dict(tiled_mlp=tiled_mlp, offload_checkpoints=True),
                 "swift_liger_fp8": dict(fp8_base=True)}.get(variant, {})
    return str(swift_liger.apply(model, **overrides))


def quantize_4bit(model, dtype) -> int:
    """Every nn.Linear of model.model.layers -> bitsandbytes Linear4bit (NF4, double quant, compute dtype `dtype`), in
    place, one at a time (the full-precision weight is freed as its layer is replaced). Returns how many."""
    import bitsandbytes as bnb  # lazy: optional, --tuner qlora only

    layers = model.model.layers
    names = [n for n, m in layers.named_modules() if type(m) is torch.nn.Linear]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        lin = getattr(parent, child)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=dtype,
                              compress_statistics=True, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                     compress_statistics=True).to(lin.weight.device)   # quantizes here
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, child, q)
        del lin
    model.is_loaded_in_4bit = True   # PEFT then wraps Linear4bit bases with its lora.bnb.Linear4bit
    return len(names)


def make_batches(n: int, seq: int, vocab: int, device, batch: int = 1) -> list:
    gen = torch.Generator().manual_seed(DATA_SEED)   # same batches in every variant; row 0 the same at every batch
    more = torch.Generator().manual_seed(DATA_SEED + 1)
    return [torch.cat([torch.randint(0, vocab, (1, seq), generator=gen),
                       torch.randint(0, vocab, (batch - 1, seq), generator=more)]).to(device) for _ in range(n)]


def _progress(t0: float, phase: str, cuda: bool) -> None:
    info = {"phase": phase, "seconds": round(time.perf_counter() - t0, 2)}
    if cuda:
        info["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        info["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    print("PROGRESS " + json.dumps(info), file=sys.stderr, flush=True)


def _host_gib() -> Dict[str, Optional[float]]:
    out: Dict[str, Optional[float]] = {
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB}
    try:
        if torch.cuda.is_available():
            stats = torch.cuda.host_memory_stats()   # the caching pinned-host allocator (offloaded checkpoints)
            peak = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.peak"))
            out["pinned_host_peak_gib"] = peak / GiB if peak is not None else None
    except Exception:
        pass
    return out


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def run_point(variant: str, seq: int, *, shape: ModelDims, layers: int, steps: int, warmup: int, tuner: str,
              device: str, dtype_name: str, mem_fraction: Optional[float], mem_cap_gib: Optional[float],
              tiled_mlp: int, batch: int = 1) -> Dict[str, Any]:
    cuda = torch.device(device).type == "cuda"
    row: Dict[str, Any] = {"variant": variant, "seq": seq, "batch": batch, "layers": layers, "status": "ok"}
    t0 = time.perf_counter()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        if mem_cap_gib is not None:
            if mem_cap_gib * GiB > total:
                raise SystemExit(f"--mem-cap-gib {mem_cap_gib:g} is more than the device's {total / GiB:.1f} GiB")
            mem_fraction = mem_cap_gib * GiB / total
        if mem_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(mem_fraction, 0)   # first, before any allocation
        row.update(mem_fraction=mem_fraction, total_memory_gib=total / GiB)
    dtype = DTYPES[dtype_name]
    losses: List[float] = []
    times: List[float] = []
    try:
        model = build_model(shape, layers, seq, device, dtype)
        row["patch"] = patch(model, variant, shape.family, tiled_mlp)
        if tuner == "qlora":
            row["quantized_linears"] = quantize_4bit(model, dtype)
        model = train_ready(model, lora=tuner in ("lora", "qlora"), targets=LORA_TARGETS, seed=SEED + 1)
        if variant == "swift_liger_fp8":
            fp8 = swift_liger.quantize_lora_bases(model)
            row["fp8_weights"], row["fp8_kept_16bit"] = fp8["fp8_weights"], fp8["kept_16bit"]
            gc.collect()
        params = [p for p in model.parameters() if p.requires_grad]
        row["trainable_params"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=LR[tuner], fused=cuda)   # the HF Trainer's default (adamw_torch_fused)
        batches = make_batches(warmup + steps, seq, shape.vocab, device, batch)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            row["model_gib"] = torch.cuda.memory_allocated() / GiB
            torch.cuda.reset_peak_memory_stats()
        row["build_seconds"] = time.perf_counter() - t0
        _progress(t0, "built", cuda)
        for step, ids in enumerate(batches):
            if cuda:
                torch.cuda.synchronize()
            ts = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            _progress(t0, f"step {step} forward", cuda)
            loss.backward()
            _progress(t0, f"step {step} backward", cuda)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - ts)
            losses.append(loss.item())
            del loss
            _progress(t0, f"step {step} done (loss {losses[-1]:.5f}, {times[-1]:.2f} s)", cuda)
        row["call_counts"] = counted(model)
    except BaseException as exc:   # noqa: BLE001 - everything ends up in the one JSON line
        if isinstance(exc, KeyboardInterrupt):
            raise
        row["status"] = "oom" if cuda and _is_oom(exc) else "error"
        row["error"] = describe(exc, 400)
        if row["status"] == "error":
            traceback.print_exc()
        if cuda:
            row["peak_before_failure_gib"] = torch.cuda.max_memory_allocated() / GiB
    measured = times[warmup:]
    row["losses"] = losses
    row["step_seconds"] = times
    row["seconds_per_step"] = sum(measured) / len(measured) if measured and row["status"] == "ok" else None
    row["tokens_per_s"] = seq * batch * len(measured) / sum(measured) if measured and row["status"] == "ok" else None
    ok = row["status"] == "ok"
    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB if cuda and ok else None
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB if cuda and ok else None
    row.update(_host_gib())
    row["seconds"] = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------------------------ parent: the sweep

def _child_cmd(variant: str, seq: int, batch: int, layers: int, args) -> List[str]:
    cmd = [sys.executable, "-m", MODULE, "--one", variant, str(seq), "--batch", str(batch), "--layers", str(layers),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--tuner", args.tuner,
           "--device", args.device, "--dtype", args.dtype, "--tiled-mlp", str(args.tiled_mlp)]
    if args.mem_cap_gib is not None:
        cmd += ["--mem-cap-gib", repr(args.mem_cap_gib)]
    elif args.mem_fraction is not None:
        cmd += ["--mem-fraction", repr(args.mem_fraction)]
    return cmd


def _child_env(device: str) -> Dict[str, str]:
    env = dict(os.environ)
    if device.startswith("cpu"):
        env.setdefault("SWIFT_LIGER_BACKEND", "torch")   # CPU: the reference ops, no interpreter
        env.setdefault("OMP_NUM_THREADS", "1")   # tiny shapes: threads only fight (a loaded CI box: 0.05 -> 7 s)
    return env


def run_child(variant: str, seq: int, batch: int, layers: int, timeout: float, args) -> Dict[str, Any]:
    """One point in its own process (own session, so a timeout kills all of it). Always returns a row."""
    child = run_process(_child_cmd(variant, seq, batch, layers, args), timeout=timeout, env=_child_env(args.device))
    out, err = child.stdout, child.stderr
    if child.timed_out:
        prog = last_json(err, "PROGRESS ") or {}
        return {"variant": variant, "seq": seq, "batch": batch, "layers": layers, "status": "timeout",
                "timeout_s": timeout, "wall_seconds": child.seconds, "last_phase": prog.get("phase"),
                # lower bounds: the point was killed before it finished
                "peak_allocated_gib_so_far": prog.get("peak_allocated_gib"),
                "peak_reserved_gib_so_far": prog.get("peak_reserved_gib"),
                "peak_allocated_gib": None, "peak_reserved_gib": None, "tokens_per_s": None,
                "seconds_per_step": None, "losses": []}
    row = last_json(out)
    if row is None:
        rc = child.returncode
        why = f"exit code {rc}"
        if rc is not None and rc < 0:
            why = f"killed by signal {-rc}" + (" (host out of memory?)" if -rc == signal.SIGKILL else "")
        row = {"variant": variant, "seq": seq, "batch": batch, "layers": layers, "status": "error",
               "error": f"{why}: {tail(err or out, skip='PROGRESS ')}", "peak_allocated_gib": None,
               "peak_reserved_gib": None, "tokens_per_s": None, "seconds_per_step": None, "losses": []}
    elif row.get("status") == "error" and err:
        row["stderr_tail"] = tail(err, 6, skip="PROGRESS ")
    row["wall_seconds"] = child.seconds
    return row


def _status(r: Dict[str, Any]) -> str:
    s = r["status"]
    if s == "ok":
        return "ok"
    if s == "oom":
        return "OOM" + (f" ({r['error'][:140]})" if r.get("error") else "")
    if s == "timeout":
        why = "deadline; " if r.get("cut_by_deadline") else ""
        return f"timeout after {r['timeout_s']:.0f} s ({why}last: {r.get('last_phase') or 'starting'})"
    return "error: " + (r.get("error") or "")[:200].replace("|", "/")


def longest(rows: List[Dict[str, Any]], variant: str) -> Dict[str, Any]:
    mine = [r for r in rows if r["variant"] == variant]
    ok = [r["seq"] for r in mine if r["status"] == "ok"]
    stop = next((r for r in mine if r["status"] != "ok"), None)
    return {"seq": max(ok) if ok else None,
            "stopped_by": None if stop is None else {"seq": stop["seq"], "status": stop["status"]}}


def largest_batch(rows: List[Dict[str, Any]], variant: str) -> Dict[str, Any]:
    mine = [r for r in rows if r["variant"] == variant]
    ok = [r["batch"] for r in mine if r["status"] == "ok"]
    stop = next((r for r in mine if r["status"] != "ok"), None)
    return {"batch": max(ok) if ok else None,
            "stopped_by": None if stop is None else {"batch": stop["batch"], "status": stop["status"]}}


def summary_line(variants: Sequence[str], rows, skipped: Dict[str, str], batch_seq: Optional[int] = None) -> str:
    """'longest trained: ...', or with batch_seq (a batch sweep at that length) 'largest batch at 8k: ...'."""
    key, label, best = ("seq", seq_label, longest) if batch_seq is None else ("batch", str, largest_batch)
    parts = []
    for v in variants:
        if v in skipped:
            parts.append(f"{v} skipped")
            continue
        info = best(rows, v)
        text = f"{v} {label(info[key]) if info[key] else 'none'}"
        if info["stopped_by"]:
            st = info["stopped_by"]["status"]
            text += f" ({label(info['stopped_by'][key])}: {'OOM' if st == 'oom' else st})"
        parts.append(text)
    head = "longest trained" if batch_seq is None else f"largest batch at {seq_label(batch_seq)}"
    return head + ": " + ", ".join(parts) + f" (ours: {', '.join(v for v in variants if v in OURS)})"


def _batch_seq(setup) -> Optional[int]:
    """The one length of a batch sweep (--batches); None in a length sweep."""
    return setup["seqs"][0] if setup.get("batches") else None


def projections(rows, halves, target: int) -> List[Dict[str, Any]]:
    """Projected peaks at `target` layers from the measured ones at N and N//2 layers (see the module docstring)."""
    out = []
    for r in rows:
        h = halves.get((r["variant"], r["seq"], r["batch"]))
        if r["status"] != "ok" or h is None:
            continue
        n, m = r["layers"], h["layers"]
        p = {"variant": r["variant"], "seq": r["seq"], "batch": r["batch"], "layers_measured": [m, n],
             "target_layers": target, "peak_at_n_gib": r.get("peak_allocated_gib"),
             "peak_at_half_gib": h.get("peak_allocated_gib"), "status_half": h["status"], "per_layer_gib": None,
             "projected_peak_gib": None}
        if p["peak_at_n_gib"] is not None and p["peak_at_half_gib"] is not None and n > m:
            slope = (p["peak_at_n_gib"] - p["peak_at_half_gib"]) / (n - m)
            p["per_layer_gib"] = slope
            p["projected_peak_gib"] = p["peak_at_n_gib"] + (target - n) * slope
        out.append(p)
    return out


def to_markdown(env, setup, rows, skipped, projection, png: Optional[str]) -> str:
    s = setup
    shape = s["shape"]
    variants = s["variants"]
    full = s["layers"] == shape["layers"]
    batch_seq = _batch_seq(s)
    title = "Longest trainable context" if batch_seq is None else f"Largest batch at {seq_label(batch_seq)}"
    tuner = {"lora": "LoRA r=16 alpha 32 dropout 0 on all linears",
             "qlora": "QLoRA: NF4 double-quant base (bitsandbytes), LoRA r=16 alpha 32 dropout 0 on all linears "
                      f"(the decoder layers' linears in 4 bit, compute dtype {s['dtype']}; lm_head and embeddings "
                      "not)",
             "full": "full fine-tuning"}[s["tuner"]]
    qlora = ("bitsandbytes",) if s["tuner"] == "qlora" else ()
    names = ("triton", "transformers", "peft", *qlora, "liger_kernel")
    lines = header(f"{title}: {s['model']} {s['tuner']}", env, *names) + [
             f"Random init, {s['layers']} of {shape['layers']} layers, hidden {shape['hidden']}, intermediate "
             f"{shape['intermediate']}, {shape['heads']}/{shape['kv_heads']} heads of {shape['head_dim']}, vocab "
             f"{shape['vocab']}, rope_theta {shape['rope_theta']:g}; batch {'/'.join(map(str, s['batches'] or [1]))}, "
             f"{s['dtype']} on {s['device']}, SDPA, gradient checkpointing (non-reentrant), {tuner}, AdamW lr "
             f"{LR[s['tuner']]:g}; {s['warmup']} warm-up + {s['steps']} measured steps per point, "
             f"each point in its own process. long_context = swift_liger defaults + tiled_mlp={s['tiled_mlp']} + "
             f"offload_checkpoints. Peak = torch.cuda.max_memory_allocated / _reserved over all steps (reset right "
             f"before the first step; weights and optimizer state included). A variant stops at its first point "
             f"that is not ok; timeout = past min(remaining deadline, {s['point_timeout']:.0f} s), not an OOM.", ""]
    if not full:
        lines += [f"**{s['layers']}-layer model, not the {shape['layers']}-layer one**: every row below is measured "
                  f"at {s['layers']} layers." + (" Projections to more layers are in their own section."
                                                 if projection is not None else ""), ""]
    if s.get("mem_cap_gib") is not None or s.get("mem_fraction") is not None:
        cap = (f"{s['mem_cap_gib']:g} GiB" if s.get("mem_cap_gib") is not None
               else f"fraction {s['mem_fraction']:g} of the device")
        lines += [f"Memory cap: {cap} per child (`torch.cuda.set_per_process_memory_fraction`, caps the caching "
                  f"allocator's reserved memory). A real card of that size also loses a few hundred MiB to the CUDA "
                  f"context, so the cap is slightly optimistic. Offloaded checkpoints live in pinned host memory, "
                  f"outside the cap (host column).", ""]
    if s["warmup"] + s["steps"] < 2:
        lines += ["Single step per point: its peak misses the AdamW state (created by the first optimizer step, "
                  "after the backward that sets the peak; 8 bytes per trainable parameter), and tok/s includes "
                  "first-step costs.", ""]
    elif s["warmup"] == 0:
        lines += ["No warm-up step: tok/s includes first-step costs.", ""]
    if s.get("alloc_conf"):
        lines += [f"PYTORCH_CUDA_ALLOC_CONF={s['alloc_conf']}", ""]
    lines += [summary_line(variants, rows, skipped, batch_seq)
              + ("" if full else f" — at {s['layers']} layers, not {shape['layers']}"), ""]
    for v in variants:
        lines += [f"## {v}", ""]
        if v in skipped:
            lines += [f"skipped: {skipped[v]}", ""]
            continue
        mine = [r for r in rows if r["variant"] == v]
        if not mine:
            lines += ["no point finished", ""]
            continue
        lines += ["| seq | batch | peak alloc GiB | peak reserved GiB | tok/s | s/step | host peak RSS GiB | status |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in mine:
            alloc, reserved = fmt(r.get("peak_allocated_gib"), ".2f"), fmt(r.get("peak_reserved_gib"), ".2f")
            if r["status"] == "timeout" and r.get("peak_allocated_gib_so_far") is not None:
                alloc = f"≥ {r['peak_allocated_gib_so_far']:.2f}"
                reserved = f"≥ {r['peak_reserved_gib_so_far']:.2f}"
            lines.append(f"| {seq_label(r['seq'])} | {r['batch']} | {alloc} | {reserved} | "
                         f"{fmt(r.get('tokens_per_s'), '.0f')} | "
                         f"{fmt(r.get('seconds_per_step'), '.2f')} | {fmt(r.get('host_peak_rss_gib'), '.1f')} | "
                         f"{_status(r).replace('|', '/')} |")
        lines.append("")
    if s.get("stopped"):
        lines += [f"Stopped: {s['stopped']}", ""]
    if projection is not None:
        lines += [f"## Projection to {s['project_layers']} layers (projected, not measured)", "",
                  f"projected peak(L) = peak(N) + (L − N) × (peak(N) − peak(N/2)) / (N − N/2), with N = "
                  f"{s['layers']}, N/2 = {s['layers'] // 2}, L = {s['project_layers']}; peak(N) is the measured row "
                  f"above, peak(N/2) a measured run of the same point at N/2 layers. Linear in layers by assumption; "
                  f"nothing at L layers was run.", "",
                  "| variant | seq | batch | peak @N/2 GiB (measured) | peak @N GiB (measured) | GiB per layer | "
                  f"projected peak @{s['project_layers']} GiB |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for p in projection:
            lines.append(f"| {p['variant']} | {seq_label(p['seq'])} | {p['batch']} | "
                         f"{fmt(p['peak_at_half_gib'], '.2f')} | "
                         f"{fmt(p['peak_at_n_gib'], '.2f')} | {fmt(p['per_layer_gib'], '.3f')} | "
                         f"{fmt(p['projected_peak_gib'], '.2f')} (projected) |")
        if not projection:
            lines.append("| — | | | | | | no ok point with both layer counts |")
        lines.append("")
    lines += [f"Plot: `{png}`" if png else
              "No plot: no memory numbers (CPU run, or no point finished on the GPU).", ""]
    return "\n".join(lines)


def plot(path: str, env, setup, rows) -> Optional[str]:
    """Peak allocated GiB against length (against batch size in a batch sweep), one line per variant; None (nothing
    written) without memory numbers."""
    if not any(r.get("peak_allocated_gib") is not None or r.get("peak_allocated_gib_so_far") is not None
               for r in rows):
        return None
    import matplotlib  # lazy: a second to import, only when there is something to plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    cap = setup.get("mem_cap_gib")
    total = next((r["total_memory_gib"] for r in rows if r.get("total_memory_gib")), None)
    if cap is None and setup.get("mem_fraction") is not None and total:
        cap = setup["mem_fraction"] * total
    peaks = [r.get("peak_allocated_gib") or r.get("peak_allocated_gib_so_far") or 0 for r in rows]
    top = 1.12 * max([p for p in peaks] + ([cap] if cap else []) + [1e-3])
    batch_seq = _batch_seq(setup)
    key, label = ("seq", seq_label) if batch_seq is None else ("batch", str)
    fig, ax = plt.subplots(figsize=(9.5, 5))
    markers = "osD^v"
    oom_labelled = timeout_labelled = False
    for i, v in enumerate(setup["variants"]):
        mine = sorted((r for r in rows if r["variant"] == v), key=lambda r: r[key])
        ok = [(r[key], r["peak_allocated_gib"]) for r in mine if r["status"] == "ok"
              and r.get("peak_allocated_gib") is not None]
        color = f"C{i}"
        if ok:
            xs, ys = zip(*ok)
            ax.plot(xs, ys, marker=markers[i % len(markers)], color=color, label=v)
        else:
            ax.plot([], [], color=color, label=v)
        for r in mine:
            if r["status"] == "oom":   # nudged sideways per variant, so OOMs of two variants at one point both show
                nudge = 2 ** (0.06 * (i - (len(setup["variants"]) - 1) / 2))
                ax.plot([r[key] * nudge], [top * 0.97], marker="x", markersize=11, mew=2.5, color=color, linestyle="",
                        label=None if oom_labelled else "OOM (at the top)")
                oom_labelled = True
            elif r["status"] == "timeout" and r.get("peak_allocated_gib_so_far") is not None:
                ax.plot([r[key]], [r["peak_allocated_gib_so_far"]], marker="o", markersize=9, mfc="none",
                        color=color, linestyle="", label=None if timeout_labelled else "timeout (peak so far)")
                timeout_labelled = True
    if cap:
        ax.axhline(cap, linestyle="--", color="gray", label=f"cap {cap:.3g} GiB")
    xs = sorted({r[key] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([label(x) for x in xs])
    ax.minorticks_off()
    ax.set_ylim(0, top)
    ax.set_xlabel("sequence length (tokens, batch 1)" if batch_seq is None else
                  f"batch size (sequences of {seq_label(batch_seq)} tokens)")
    ax.set_ylabel("peak allocated GiB")
    ax.grid(alpha=0.3)
    ax.set_xlim(xs[0] / 2 ** 0.3, xs[-1] * 2 ** 0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    layers = f"{setup['layers']} layers" + ("" if setup["layers"] == setup["shape"]["layers"] else
                                            f" of {setup['shape']['layers']}")
    ax.set_title(f"{setup['model']} {setup['tuner']} ({layers}), {setup['dtype']}: peak memory vs "
                 f"{'length' if batch_seq is None else 'batch size at ' + seq_label(batch_seq)}\n"
                 f"{env.get('gpu') or setup['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def write(out_dir: str, env, setup, rows, skipped, projection, halves) -> str:
    os.makedirs(out_dir, exist_ok=True)
    png_path = os.path.join(out_dir, "long_context.png")
    png = plot(png_path, env, setup, rows)
    if png is None and os.path.exists(png_path):
        os.remove(png_path)
    data = {"environment": env, "setup": setup, "rows": rows, "skipped_variants": skipped}
    if _batch_seq(setup) is None:
        data["longest"] = {v: longest(rows, v) for v in setup["variants"] if v not in skipped}
    else:
        data["largest_batch"] = {v: largest_batch(rows, v) for v in setup["variants"] if v not in skipped}
    if projection is not None:
        data["projection"] = {"note": "projected, not measured", "formula": "peak(L) = peak(N) + (L - N) * "
                              "(peak(N) - peak(N//2)) / (N - N//2)", "half_layer_runs": list(halves.values()),
                              "rows": projection}
    return write_report(out_dir, "long_context", data,
                        to_markdown(env, setup, rows, skipped, projection, os.path.basename(png) if png else None))


def _skip_reason(variant: str, device: str, tuner: str = "lora") -> Optional[str]:
    if variant == "swift_liger_fp8":
        if tuner != "lora":
            return f"FP8 bases are for LoRA over 16-bit weights, not --tuner {tuner}"
        problem = fp8_device_problem(device)
        if problem is None and not device.startswith("cuda") and not emulation_allowed():
            problem = "FP8 bases on CPU need SWIFT_LIGER_FP8_EMULATE=1 (tests)"
        return problem
    if variant != "liger":
        return None
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not importable (pip install liger-kernel)"
    if not device.startswith("cuda"):
        return "Liger-Kernel needs CUDA"
    return None


def _line(r: Dict[str, Any]) -> str:
    return (f"  {r['variant']:13s} {seq_label(r['seq']):>6s} x{r['batch']:<3d} @{r['layers']}L  "
            f"{_status(r)[:90]:40s} peak "
            f"{fmt(r.get('peak_allocated_gib'), '.2f')} GiB  {fmt(r.get('tokens_per_s'), '.0f')} tok/s  "
            f"{fmt(r.get('seconds_per_step'), '.2f')} s/step  ({r.get('wall_seconds', 0):.0f} s)")


def main(argv: Optional[Sequence[str]] = None):
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory (required unless --one)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seqs", default=DEFAULT_SEQS, help="increasing lengths: 8k, 16384, 1m, ...")
    ap.add_argument("--batches", default=None,
                    help="increasing batch sizes (1,2,4,8): a batch sweep at the one length of --seqs")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--project-layers", type=int, default=None,
                    help="add a projected-peak section for this many layers (needs --layers < it)")
    ap.add_argument("--tuner", default="lora", choices=sorted(LR))
    ap.add_argument("--steps", type=int, default=2, help="measured steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                    help="auto: bf16 on cuda, fp32 on cpu")
    cap = ap.add_mutually_exclusive_group()
    cap.add_argument("--mem-cap-gib", type=float, default=None,
                     help="cap each child's allocator at exactly this many GiB (fraction from total_memory)")
    cap.add_argument("--mem-fraction", type=float, default=None,
                     help="torch.cuda.set_per_process_memory_fraction in each child")
    ap.add_argument("--tiled-mlp", type=int, default=8192, help="tokens per MLP tile of the long_context variant")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole sweep (no new point after)")
    ap.add_argument("--point-timeout", type=float, default=POINT_TIMEOUT,
                    help="seconds per point at most (also capped by the remaining deadline)")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)   # of the --one point
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "fp32" if args.device.startswith("cpu") else "bf16"
    shape = MODELS[args.model]
    layers = args.layers or shape.layers

    if args.one:
        variant, seq = args.one[0], parse_seq(args.one[1])
        if args.device.startswith("cpu"):
            os.environ.setdefault("SWIFT_LIGER_BACKEND", "torch")
        row = run_point(variant, seq, shape=shape, layers=layers, steps=args.steps, warmup=args.warmup,
                        tuner=args.tuner, device=args.device, dtype_name=args.dtype, mem_fraction=args.mem_fraction,
                        mem_cap_gib=args.mem_cap_gib, tiled_mlp=args.tiled_mlp, batch=args.batch)
        print(json.dumps(row, default=str), flush=True)
        return row

    if not args.out:
        ap.error("--out is required")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    seqs = [parse_seq(s) for s in args.seqs.split(",") if s.strip()]
    if seqs != sorted(set(seqs)):
        ap.error("--seqs must be strictly increasing")
    batches = None
    if args.batches is not None:
        try:
            batches = [int(b) for b in args.batches.split(",") if b.strip()]
        except ValueError:
            ap.error(f"--batches takes comma-separated integers, got {args.batches!r}")
        if not batches or batches[0] < 1 or batches != sorted(set(batches)):
            ap.error("--batches must be strictly increasing positive integers")
        if len(seqs) != 1:
            ap.error(f"--batches sweeps one length: --seqs must have exactly one value, got {len(seqs)}")
    points = [(seqs[0], b) for b in batches] if batches else [(s, 1) for s in seqs]
    if args.project_layers is not None and not (2 <= layers < args.project_layers):
        ap.error("--project-layers L needs 2 <= --layers N < L (the slope comes from N and N//2 layers)")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("--device cuda but CUDA is not available (use --model tiny --device cpu for a CPU check)")
    if args.tuner == "qlora":
        try:
            importlib.import_module("bitsandbytes")
        except Exception as exc:
            sys.exit(f"--tuner qlora needs bitsandbytes, which is not importable ({type(exc).__name__}: {exc}); "
                     f"pip install bitsandbytes")

    env = environment(f"python -m {MODULE}", argv, packages=("bitsandbytes",))
    skipped = {v: why for v in variants if (why := _skip_reason(v, args.device, args.tuner))}
    setup: Dict[str, Any] = {
        "model": args.model, "shape": shape.asdict(), "layers": layers, "tuner": args.tuner,
        "variants": variants, "seqs": seqs, "steps": args.steps, "warmup": args.warmup, "batches": batches,
        "device": args.device, "dtype": args.dtype, "attn": "sdpa", "mem_cap_gib": args.mem_cap_gib,
        "mem_fraction": args.mem_fraction, "tiled_mlp": args.tiled_mlp, "deadline": args.deadline,
        "point_timeout": args.point_timeout, "project_layers": args.project_layers,
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "targets": LORA_TARGETS} if args.tuner != "full" else None,
        "qlora": {"quant_type": "nf4", "double_quant": True, "compute_dtype": args.dtype, "quantized": "every "
                  "nn.Linear of model.model.layers", "library": "bitsandbytes"} if args.tuner == "qlora" else None,
        "lr": LR[args.tuner], "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "stopped": None}
    rows: List[Dict[str, Any]] = []
    halves: Dict[tuple, Dict[str, Any]] = {}
    projection = [] if args.project_layers is not None else None
    t_start = time.perf_counter()

    def remaining() -> float:
        return float("inf") if args.deadline is None else args.deadline - (time.perf_counter() - t_start)

    def flush():
        env["total_seconds"] = time.perf_counter() - t_start
        return write(args.out, env, setup, rows, skipped, projection, halves)

    for v, why in skipped.items():
        print(f"  {v}: skipped ({why})", flush=True)
    flush()
    return _sweep(args, env, setup, rows, halves, projection, skipped, layers, points, variants, remaining, flush)


def _sweep(args, env, setup, rows, halves, projection, skipped, layers, points, variants, remaining, flush):
    active = [v for v in variants if v not in skipped]
    for seq, batch in points:
        at = f"batch {batch}" if setup["batches"] else seq_label(seq)
        for v in list(active):
            left = remaining()
            if left < MIN_START_S:
                setup["stopped"] = (f"deadline ({args.deadline:g} s) reached before {v} at {at}; "
                                    f"not run: {', '.join(active)} from {at} on")
                break
            row = run_child(v, seq, batch, layers, min(left, args.point_timeout), args)
            if row["status"] == "timeout" and left < args.point_timeout:
                row["cut_by_deadline"] = True
            rows.append(row)
            print(_line(row), flush=True)
            if row["status"] != "ok":
                active.remove(v)
            flush()
        if setup["stopped"] or not active:
            break
    if projection is not None:   # the same ok points again at N//2 layers: the per-layer slope
        half = layers // 2
        for r in [r for r in rows if r["status"] == "ok"]:
            left = remaining()
            if left < MIN_START_S:
                setup["stopped"] = (setup["stopped"] or "") + " projection runs at N/2 layers cut by the deadline"
                break
            h = run_child(r["variant"], r["seq"], r["batch"], half, min(left, args.point_timeout), args)
            halves[(r["variant"], r["seq"], r["batch"])] = h
            print(_line(h) + "  [for the projection]", flush=True)
            projection[:] = projections(rows, halves, args.project_layers)
            flush()
    md = flush()
    print(md, flush=True)
    return rows


if __name__ == "__main__":
    main()
