"""Endless streaming chat in constant memory with RollingKVCache (StreamingLLM: 4 sinks + a window).

Runs offline in seconds on CPU: the model is a tiny randomly initialised Llama built in code and the tokenizer
is a character table, so the "assistant" babbles; the point is the mechanics. One cache serves the whole
conversation: each user turn is fed as one chunk, the reply streams token by token, and the cache never grows
past sinks + window tokens however long the chat runs.

    python examples/streaming_chat.py --max-tokens 2000          # canned user turns, stops after 2000 tokens
    python examples/streaming_chat.py --interactive              # type the user turns (empty line quits)
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("SWIFT_LIGER_BACKEND", "torch")   # CPU: the PyTorch reference of the write kernel
    torch.set_num_threads(1)                                # tiny matmuls: extra threads only contend

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from swift_liger.cache import RollingKVCache  # noqa: E402

CANNED = ["hello there!", "what is a ring buffer?", "and attention sinks?", "tell me a story.",
          "why does memory stay flat?", "ok, keep going."]


class CharTokenizer:
    """Printable ASCII plus newline; id 0 is padding, 1 is beginning-of-text."""

    def __init__(self):
        self.chars = ["<pad>", "<bos>", "\n"] + [chr(c) for c in range(32, 127)]
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, text: str) -> list:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids if i > 1)


def tiny_model(vocab: int, device: torch.device, seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1 << 20, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()


@torch.no_grad()
def feed(model, cache, ids, device):
    """Run one chunk of token ids through the model; returns the logits of its last token."""
    x = torch.tensor([ids], device=device)
    return model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def sample(logits, temperature: float, banned) -> int:
    logits = logits.float() / temperature
    logits[banned] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=2000, help="stop after this many generated tokens (0: never)")
    ap.add_argument("--reply-tokens", type=int, default=80, help="longest reply before the turn ends")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--mode", choices=["streaming", "absolute"], default="streaming")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--interactive", action="store_true", help="read user turns from stdin")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = CharTokenizer()
    model = tiny_model(len(tok), device, args.seed)
    # On a GPU, reply tokens after the ring is full replay one CUDA graph of the decoder each.
    cache = RollingKVCache(model, window=args.window, sinks=args.sinks, mode=args.mode,
                           cuda_graph=device.type == "cuda")
    print(f"tiny random Llama on {device}; {cache}; --max-tokens {args.max_tokens or 'unlimited'}\n")

    logits = feed(model, cache, [1], device)            # <bos>: the first tokens become the attention sinks
    newline, banned = tok.index["\n"], [0, 1]
    generated, t0, turns = 0, time.perf_counter(), itertools.cycle(CANNED)
    for turn in itertools.count(1):
        if args.interactive:
            try:
                user = input("user> ").strip()
            except EOFError:
                break
            if not user:
                break
        else:
            user = next(turns)
            print(f"user> {user}")
        logits = feed(model, cache, tok.encode(f"user: {user}\nbot: "), device)
        print("bot> ", end="", flush=True)
        for _ in range(args.reply_tokens):
            nxt = sample(logits, args.temperature, banned)
            generated += 1
            if nxt == newline:
                break
            print(tok.decode([nxt]), end="", flush=True)
            logits = feed(model, cache, [nxt], device)
            if args.max_tokens and generated >= args.max_tokens:
                break
        logits = feed(model, cache, [newline], device)   # end of the bot turn
        print(f"\n    [turn {turn}: {cache.get_seq_length()} tokens seen, cache {cache.nbytes / 1024:.1f} KiB]")
        if args.max_tokens and generated >= args.max_tokens:
            break
    dt = time.perf_counter() - t0
    print(f"\n{generated} tokens generated in {dt:.1f} s ({generated / max(dt, 1e-9):.0f} tok/s); "
          f"{cache.get_seq_length()} tokens seen; cache {cache.nbytes / 1024:.1f} KiB "
          f"(sinks {args.sinks} + window {args.window} per layer, constant)")


if __name__ == "__main__":
    main()
