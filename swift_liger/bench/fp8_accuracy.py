"""FP8 base accuracy on real text: LoRA on a bf16 base vs the same base stored in FP8, eval loss side by side.

Corpus: the running Python's standard library ``.py`` files (no site-packages, test, tests, idlelib, lib2to3), split
by a hash of each file's relative path into a pretraining part (60%) and a held-out part, itself split into LoRA-train
(30%: about one epoch of the default LoRA steps, so the adapters see fresh text) and LoRA-eval (10%) files. A
byte-level BPE is trained on the pretraining part only. A tiny Llama, built from its config with a fixed seed, is
pretrained (fp32 master weights, bf16 autocast, AdamW, warmup + cosine) and cast to bf16: the shared base of both
arms. Each arm patches a copy with ``swift_liger.apply`` (the FP8 arm with ``fp8_base=True``, then
``swift_liger.quantize_lora_bases`` after PEFT) and trains LoRA r16 on all seven projections with the same seed,
data order and steps, evaluating on the same LoRA-eval windows every ``--eval-every`` steps.

On CPU the FP8 GEMM is torch's CPU ``torch._scaled_mm`` (SWIFT_LIGER_FP8_EMULATE=1; same e4m3 rounding and row
scales as the GPU path) and the other ops run their PyTorch reference (SWIFT_LIGER_BACKEND=torch).

    python -m swift_liger.bench.fp8_accuracy --out docs/benchmarks [--device cpu|cuda] [--quick] [--max-files N]

Writes fp8_accuracy.json, fp8_accuracy.md and fp8_accuracy.png (when matplotlib imports) under --out.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EOF_TOKEN = "<|endoftext|>"


def split_corpus(max_files=None):
    """{part: [(relative path, text)]} for pretrain / lora_train / lora_eval, by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = {"pretrain": [], "lora_train": [], "lora_eval": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]):
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10
        part = "pretrain" if bucket < 6 else ("lora_train" if bucket < 9 else "lora_eval")
        if max_files is None or len(parts[part]) < max_files:
            parts[part].append((rel, path.read_text(encoding="utf-8", errors="replace")))
    return parts


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOF_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok, files) -> torch.Tensor:
    """All files' tokens, each file followed by the end-of-text token, as one int64 tensor."""
    eof = tok.token_to_id(EOF_TOKEN)
    ids = []
    for enc in tok.encode_batch([text for _, text in files]):
        ids.extend(enc.ids)
        ids.append(eof)
    return torch.tensor(ids, dtype=torch.long)


def random_batches(stream, steps, batch, seq, seed):
    """`steps` lists of `batch` window starts drawn uniformly from the stream (seeded: the same for every arm)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(stream) - seq, (steps, batch), generator=g)


def eval_windows(stream, n, seq) -> torch.Tensor:
    """n non-overlapping windows spread evenly over the stream: [n, seq]."""
    n = min(n, len(stream) // seq)
    stride = len(stream) // n
    return torch.stack([stream[i * stride:i * stride + seq] for i in range(n)])


def lm_loss(model, ids, device, autocast):
    ids = ids.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids).loss


@torch.no_grad()
def evaluate(model, windows, batch, device) -> float:
    """The mean next-token loss over the windows (all full length), under the same bf16 autocast as training."""
    model.eval()
    total = sum(lm_loss(model, windows[i:i + batch], device, True).float().item() * len(windows[i:i + batch])
                for i in range(0, len(windows), batch))
    model.train()
    return total / len(windows)


def lr_lambda(steps, warmup):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def train(model, params, stream, starts, seq, lr, warmup, eval_fn, eval_every, device, weight_decay):
    """AdamW over `params` on the windows `starts` ([steps, batch]); eval_fn at step 0, every eval_every, the end."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(len(starts), warmup))
    offsets = torch.arange(seq)
    curve = {"train_step": [], "train_loss": [], "eval_step": [0], "eval_loss": [eval_fn()]}
    t0 = time.perf_counter()
    for step, row in enumerate(starts, 1):
        loss = lm_loss(model, stream[row[:, None] + offsets], device, True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        curve["train_step"].append(step)
        curve["train_loss"].append(loss.item())
        if step % eval_every == 0 or step == len(starts):
            curve["eval_step"].append(step)
            curve["eval_loss"].append(eval_fn())
            print(f"  step {step}/{len(starts)} train {loss.item():.4f} eval {curve['eval_loss'][-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    curve["train_seconds"] = time.perf_counter() - t0
    return curve


def lora_arm(base, fp8, a, data, device):
    import peft

    import swift_liger   # lazy: main sets the SWIFT_LIGER_* env of a CPU run before the ops load
    model = copy.deepcopy(base)
    report = swift_liger.apply(model, fp8_base=fp8)
    torch.manual_seed(a.seed)                     # the same adapter init in both arms
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                       target_modules=TARGETS))
    record = swift_liger.quantize_lora_bases(model, min_size=0) if fp8 else None   # every weight: the numerics
    if fp8 and record["fp8_weights"] != 7 * a.layers:
        raise RuntimeError(f"FP8 arm: {record['fp8_weights']} FP8 bases, expected {7 * a.layers}: {record}")
    adapters = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    curve = train(model, params, data["lora_train"], data["lora_starts"], a.seq, a.lora_lr, a.lora_warmup,
                  lambda: evaluate(model, data["eval"], a.batch, device), a.eval_every, device, 0.0)
    curve.update(fp8_record=record, patched=dict(report.patched), trainable_params=sum(p.numel() for p in params),
                 call_counts=swift_liger.call_counts(model))
    return curve, adapters


def fp8_sources() -> dict:
    """sha256 (first 16 hex digits) of the FP8 path's source files as this process imported them, and git HEAD."""
    import subprocess

    import swift_liger.ops.lora_linear_op   # lazy: as in lora_arm
    import swift_liger.patching.fp8   # lazy: as in lora_arm
    pkg = Path(swift_liger.patching.fp8.__file__).parents[1]
    out = {f: hashlib.sha256((pkg / f).read_bytes()).hexdigest()[:16]
           for f in ("ops/fp8_linear_op.py", "ops/fp8_quant_kernel.py", "patching/fp8.py",
                     "ops/lora_linear_op.py")}
    try:
        out["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pkg, capture_output=True, text=True,
                                         timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_head"] = None
    return out


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def smooth(values, n=10):
    """The mean of each value and the up to n-1 before it."""
    return [sum(values[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(values))]


def plot(results, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    pre = results["pretrain"]
    left.plot(pre["train_step"], smooth(pre["train_loss"]), lw=1, label="train, 10-step mean (pretraining part)")
    left.plot(pre["eval_step"], pre["eval_loss"], "o-", label="eval (held-out LoRA-eval files)")
    left.set(title="Pretraining (fp32 master weights, bf16 autocast)", xlabel="step", ylabel="loss")
    for name, style in (("bf16", "o-"), ("fp8", "s--")):
        arm = results["arms"][name]
        mid.plot(arm["eval_step"], arm["eval_loss"], style, label=f"{name} base: {arm['eval_loss'][-1]:.4f}")
        right.plot(arm["train_step"], smooth(arm["train_loss"]), style[1:], label=f"{name} base")
    mid.set(title=f"LoRA eval loss (final rel. diff {results['rel_diff']:+.3%})", xlabel="step", ylabel="loss")
    right.set(title="LoRA train loss (10-step mean)", xlabel="step", ylabel="loss")
    for ax in (left, mid, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_md(r, path):
    c, s = r["config"], r["corpus"]
    bf, f8 = r["arms"]["bf16"], r["arms"]["fp8"]
    rec = f8["fp8_record"]
    lines = [
        "# FP8 base vs bf16 base under LoRA: eval loss on real text", "",
        f"`{r['environment']['command']}` on {r['environment']['device_name']} ({r['environment']['date']}).", "",
        f"Corpus: Python {platform.python_version()} standard library `.py` files, split by path hash: pretraining "
        f"{s['pretrain']['files']} files / {s['pretrain']['tokens']:,} tokens, LoRA-train {s['lora_train']['files']} "
        f"/ {s['lora_train']['tokens']:,}, LoRA-eval {s['lora_eval']['files']} / {s['lora_eval']['tokens']:,} "
        f"(byte-level BPE, vocab {s['vocab_size']}, trained on the pretraining part).",
        f"Model: Llama, hidden {c['hidden']}, {c['layers']} layers, intermediate {c['intermediate']}, "
        f"{r['model_params']:,} parameters; pretrained {c['pretrain_steps']} steps x {c['batch']} x {c['seq']} "
        f"tokens: held-out eval loss {r['pretrain']['eval_loss'][0]:.3f} -> {r['pretrain']['eval_loss'][-1]:.3f}; "
        "cast to bf16 as the shared base.",
        f"LoRA r16 alpha 32 on {', '.join(TARGETS)}; {c['lora_steps']} steps x {c['batch']} x {c['seq']}, "
        f"lr {c['lora_lr']}, same seed and data order; eval on {c['eval_windows']} fixed LoRA-eval windows. "
        f"FP8 arm: {rec['fp8_weights']} bases in e4m3 ({rec['bytes_16bit']:,} -> {rec['bytes_fp8']:,} bytes).", "",
        "| base | eval loss at step 0 | final eval loss | LoRA wall time (s) |", "|---|---|---|---|",
        f"| bf16 | {bf['eval_loss'][0]:.4f} | {bf['eval_loss'][-1]:.4f} | {bf['train_seconds']:.0f} |",
        f"| FP8 (e4m3, row scales) | {f8['eval_loss'][0]:.4f} | {f8['eval_loss'][-1]:.4f} | "
        f"{f8['train_seconds']:.0f} |", "",
        f"Relative difference of the final eval loss (FP8 - bf16) / bf16: **{r['rel_diff']:+.3%}**, "
        f"{'within' if r['within_1pct'] else 'NOT within'} 1%.", "",
    ]
    if r["config"]["device"] == "cpu":
        lines.append("On CPU the FP8 GEMM is torch's CPU `torch._scaled_mm` reference (SWIFT_LIGER_FP8_EMULATE=1): the "
                     "same e4m3 rounding and per-row scales as the GPU path, not its speed; other ops ran their "
                     "PyTorch reference (SWIFT_LIGER_BACKEND=torch).")
    if r.get("png"):
        lines += ["", f"![eval loss curves]({r['png']})"]
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m swift_liger.bench.fp8_accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="a short smoke run (fewer steps and eval windows)")
    ap.add_argument("--max-files", type=int, default=None, help="at most this many files per corpus part")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--lora-steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pretrain-lr", type=float, default=2e-3)
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a = ap.parse_args(argv)
    quick = a.quick
    a.pretrain_steps = a.pretrain_steps or (40 if quick else 800)
    a.lora_steps = a.lora_steps or (20 if quick else 240)
    a.eval_every = a.eval_every or (10 if quick else 20)
    a.eval_windows = a.eval_windows or (16 if quick else 64)
    a.pretrain_warmup, a.lora_warmup = max(1, a.pretrain_steps // 20), max(1, a.lora_steps // 20)
    if a.vocab % 16 or a.hidden % 16 or a.intermediate % 16:
        ap.error("--vocab, --hidden and --intermediate must be multiples of 16 (the FP8 GEMM's alignment)")
    device = torch.device(a.device)
    if device.type == "cpu":
        os.environ["SWIFT_LIGER_FP8_EMULATE"] = "1"
        os.environ["SWIFT_LIGER_BACKEND"] = "torch"
    os.environ.setdefault("RAYON_NUM_THREADS", str(a.threads))     # the BPE trainer's thread pool
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m swift_liger.bench.fp8_accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    import peft
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    sources = fp8_sources()
    times = {}

    t = time.perf_counter()
    parts = split_corpus(a.max_files)
    tok = train_tokenizer([text for _, text in parts["pretrain"]], a.vocab)
    streams = {name: token_stream(tok, files) for name, files in parts.items()}
    times["corpus_and_tokenizer_s"] = time.perf_counter() - t
    corpus = {name: {"files": len(parts[name]), "bytes": sum(len(x.encode()) for _, x in parts[name]),
                     "tokens": len(streams[name])} for name in parts}
    corpus.update(stdlib=sysconfig.get_paths()["stdlib"], skipped_dirs=sorted(SKIP_DIRS),
                  vocab_size=tok.get_vocab_size())
    print(f"corpus: {json.dumps({k: corpus[k] for k in parts})}, vocab {tok.get_vocab_size()} "
          f"({times['corpus_and_tokenizer_s']:.0f} s)", flush=True)

    vocab = -(-tok.get_vocab_size() // 16) * 16
    config = LlamaConfig(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=max(
                             1, a.hidden // 128), head_dim=64, max_position_embeddings=a.seq, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.token_to_id(EOF_TOKEN),
                         pad_token_id=None)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(config).to(device)
    windows = eval_windows(streams["lora_eval"], a.eval_windows, a.seq)
    data = {"eval": windows, "lora_train": streams["lora_train"],
            "lora_starts": random_batches(streams["lora_train"], a.lora_steps, a.batch, a.seq, a.seed + 2)}
    print(f"pretraining {sum(p.numel() for p in model.parameters()):,} parameters, {a.pretrain_steps} steps",
          flush=True)
    pre = train(model, list(model.parameters()), streams["pretrain"],
                random_batches(streams["pretrain"], a.pretrain_steps, a.batch, a.seq, a.seed + 1), a.seq,
                a.pretrain_lr, a.pretrain_warmup, lambda: evaluate(model, windows, a.batch, device),
                max(a.eval_every, a.pretrain_steps // 10), device, 0.1)
    times["pretrain_s"] = pre["train_seconds"]
    base = model.to(torch.bfloat16).eval()           # the shared bf16 base of both arms
    pre["eval_loss_bf16_base"] = evaluate(base, windows, a.batch, device)

    arms, adapters = {}, {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        print(f"LoRA, {name} base", flush=True)
        arms[name], adapters[name] = lora_arm(base, fp8, a, data, device)
        times[f"lora_{name}_s"] = arms[name]["train_seconds"]
    same_init = adapters["bf16"].keys() == adapters["fp8"].keys() and all(
        torch.equal(adapters["bf16"][k], adapters["fp8"][k]) for k in adapters["bf16"])
    if not same_init:
        raise RuntimeError("the two arms' LoRA adapters differ at step 0")
    final = {name: arms[name]["eval_loss"][-1] for name in arms}
    rel = (final["fp8"] - final["bf16"]) / final["bf16"]
    results = {
        "config": {k: v for k, v in vars(a).items() if k != "out"} | {"lora_r": 16, "lora_alpha": 32,
                                                                      "targets": TARGETS},
        "corpus": corpus, "model_params": sum(p.numel() for p in base.parameters()),
        "pretrain": pre, "arms": arms, "adapters_identical_at_start": same_init,
        "final_eval_loss": final, "rel_diff": rel, "within_1pct": abs(rel) < 0.01, "wall_seconds": times,
        "environment": {"command": command, "python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "peft": peft.__version__,
                        "swift_liger_sources": sources, "device": a.device, "device_name": device_name(device),
                        "torch_threads": a.threads,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "fp8_gemm": "torch._scaled_mm (CPU reference)" if device.type == "cpu"
                        else "torch._scaled_mm (cuBLASLt)"},
    }
    results["config"]["eval_windows"] = len(windows)
    results["png"] = "fp8_accuracy.png" if plot(results, out / "fp8_accuracy.png") else None
    if results["png"] is None:
        print("matplotlib is not importable: no PNG written", flush=True)
    (out / "fp8_accuracy.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_md(results, out / "fp8_accuracy.md")
    print(f"final eval loss: bf16 {final['bf16']:.4f}, fp8 {final['fp8']:.4f}, rel diff {rel:+.3%} -> "
          f"{out / 'fp8_accuracy.json'}", flush=True)
    return results


if __name__ == "__main__":
    main()
