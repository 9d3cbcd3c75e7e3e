"""A tiny random causal LM with a ChatML byte-level BPE tokenizer, plus toy SFT and preference datasets.

Everything is generated offline and deterministically (fixed seeds, no hub access), in a few seconds, so the demo,
the integration tests and `examples/sft_tiny_cpu.sh` can run the real `swift` CLI on a CPU:

    python -m swift_liger.testing.tiny OUTDIR [--arch qwen3|llama|gemma2|qwen3_moe]   # or: swift-liger tiny

writes OUTDIR/model/ (config, safetensors weights, tokenizer), OUTDIR/sft.jsonl ({"messages": [...]}),
OUTDIR/pref.jsonl (plus "rejected_response": dpo, orpo, cpo, simpo) and OUTDIR/kto.jsonl (plus "label": true/false),
and prints the matching ms-swift flags.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass

# Flags ms-swift needs for a local model dir whose name is no known model id.
SWIFT_FLAGS = {
    "qwen3": ["--model_type", "qwen3", "--template", "qwen3"],
    "llama": ["--model_type", "llama", "--template", "chatml"],
    "gemma2": ["--model_type", "gemma2", "--template", "chatml"],
    "qwen3_moe": ["--model_type", "qwen3_moe", "--template", "qwen3"],
}
# Per-arch config extras: Gemma-2 with a logit softcap small enough to change the loss of a tiny model, and its
# sliding-window layers active at these lengths; Qwen3-MoE with 4 experts (2 active) and one dense layer.
ARCH_EXTRA = {
    "gemma2": dict(final_logit_softcapping=2.0, sliding_window=16, query_pre_attn_scalar=16),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1]),
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

_BASE_WORDS = ("the a of to and in is it on for with what how why when yes no not this that apple river cloud "
               "tiger stone red blue green quick slow happy number plus minus equals answer question model train "
               "token kernel loss gradient batch step learn rate small large think fast memory layer norm").split()
_SYLLABLES = "ka ri to mu ne so la vi po de fu zan or ble tri mon ex pra gol hin sa ke".split()


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3"
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 160
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    init_std: float = 0.05  # larger than HF's 0.02 so activations and losses are not all ~uniform
    seed: int = 0
    sft_rows: int = 256
    pref_rows: int = 64


class _Text:
    """Deterministic toy text: random sentences over a word list plus easy arithmetic Q/A (learnable signal)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        made = {"".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(2, 4))) for _ in range(1500)}
        self.words = _BASE_WORDS + sorted(made)

    def sentence(self, lo=4, hi=14):
        words = [self.rng.choice(self.words) for _ in range(self.rng.randint(lo, hi))]
        return " ".join(words).capitalize() + self.rng.choice(".?!")

    def qa(self):
        if self.rng.random() < 0.5:
            a, b = self.rng.randint(0, 49), self.rng.randint(0, 49)
            return f"What is {a} plus {b}?", f"{a} plus {b} equals {a + b}."
        return self.sentence(), self.sentence(6, 20)


def build_tokenizer(spec: TinySpec = TinySpec()):
    """Byte-level BPE (any text encodes, no unknown tokens) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = _Text(spec.seed + 1)
    corpus = [text.sentence() for _ in range(4000)] + [" ".join(text.qa()) for _ in range(2000)]
    corpus += [" ".join(str(i) for i in range(100)), "user assistant system\n"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]), model_max_length=2048,
        clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_model(tokenizer, spec: TinySpec = TinySpec()):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    config = AutoConfig.for_model(
        spec.arch, vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=2048, initializer_range=spec.init_std, hidden_act="silu",
        tie_word_embeddings=(spec.arch == "qwen3"),  # qwen3 small models tie, llama-3 does not: cover both
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, **ARCH_EXTRA.get(spec.arch, {}))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec.seed + 7)
    with torch.no_grad():  # non-trivial norm weights, so a wrong weight handling in a kernel cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:   # Gemma scales by (1 + w)
                centre = 0.0 if spec.arch.startswith("gemma") else 1.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    return model


def _chat(q, a):
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def sft_rows(spec: TinySpec = TinySpec()):
    text = _Text(spec.seed + 2)
    return [{"messages": _chat(*text.qa())} for _ in range(spec.sft_rows)]


def pref_rows(spec: TinySpec = TinySpec()):
    text = _Text(spec.seed + 3)
    return [{"messages": _chat(*text.qa()), "rejected_response": text.sentence()} for _ in range(spec.pref_rows)]


def kto_rows(spec: TinySpec = TinySpec()):
    """Unpaired rows for KTO: a correct answer labelled true, a random sentence labelled false, alternating."""
    text = _Text(spec.seed + 4)
    rows = []
    for i in range(spec.pref_rows):
        q, a = text.qa()
        good = i % 2 == 0
        rows.append({"messages": _chat(q, a if good else text.sentence()), "label": good})
    return rows


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build(outdir: str, arch: str = "qwen3", **overrides) -> dict:
    """Write model dir + datasets under `outdir`; returns paths and the ms-swift flags (idempotent per spec)."""
    if arch not in SWIFT_FLAGS:
        raise ValueError(f"arch must be one of {', '.join(SWIFT_FLAGS)}, got {arch!r}")
    spec = TinySpec(arch=arch, **overrides)
    if os.path.exists(outdir) and not os.path.isdir(outdir):
        raise NotADirectoryError(f"OUTDIR {outdir!r} exists and is not a directory")
    os.makedirs(outdir, exist_ok=True)
    model_dir = os.path.join(outdir, "model")
    info = {
        "model": model_dir,
        "sft": os.path.join(outdir, "sft.jsonl"),
        "pref": os.path.join(outdir, "pref.jsonl"),
        "kto": os.path.join(outdir, "kto.jsonl"),
        "swift_flags": ["--model", model_dir, *SWIFT_FLAGS[arch]],
        "spec": spec.__dict__,
    }
    stamp = os.path.join(outdir, "tiny.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            done = json.load(f)
        if done.get("spec") == info["spec"] and "params" in done:
            info["params"] = done["params"]
            return info
    tokenizer = build_tokenizer(spec)
    model = build_model(tokenizer, spec)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_jsonl(info["sft"], sft_rows(spec))
    write_jsonl(info["pref"], pref_rows(spec))
    write_jsonl(info["kto"], kto_rows(spec))
    info["params"] = sum(p.numel() for p in model.parameters())
    with open(stamp, "w") as f:
        json.dump(info, f, indent=2)
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(prog="swift-liger tiny", description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--arch", default="qwen3", choices=sorted(SWIFT_FLAGS))
    args = ap.parse_args(argv)
    try:
        info = build(args.outdir, args.arch)
    except OSError as exc:
        print(f"swift-liger tiny: {exc}", file=sys.stderr)
        return 2
    print(f"{args.arch}: {info['params']} params -> {info['model']}")
    print("swift sft " + " ".join(info["swift_flags"]) + f" --dataset {info['sft']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
