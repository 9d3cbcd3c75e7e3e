"""`--attn_impl swift_liger` in ms-swift: packing / padding-free training without flash-attn.

ms-swift 4.6 takes `--packing true` / `--padding_free true` only with a flash-attention `--attn_impl`
(SftArguments._check_padding_free; RLHFArguments adds its list of rlhf types). Its padding-free collator hands the
model one row per batch, documents back to back, position ids restarting at each, and no attention mask: exactly
what the "swift_liger" attention implementation (swift_liger/fusions/varlen_attention.py) reads. Here:

* `check_padding_free` (SftArguments._check_padding_free, which RLHFArguments' override calls first): with
  `--use_liger` and packing / padding_free, an unset, sdpa or eager `--attn_impl` becomes swift_liger (one info log
  line); an explicit flash-attention choice is kept. swift_liger then passes ms-swift's flash-only check (packing
  still turns padding_free on, as ms-swift does); any other attn_impl gets ms-swift's own error, plus a hint.
* `check_arguments` (before the run directory exists): combinations swift_liger attention cannot run are an
  error naming the flag (sequence parallel; a model config with attention_dropout > 0 or head_dim > 256).
* `register_if_requested` (AttnImpl.update_attn_impl, where ms-swift writes attn_impl into every model config it
  loads: policy, ref/reward/teacher models, swift infer / export): registers the implementation with transformers
  right before the model is built, which validates the name. `--attn_impl swift_liger` works without --use_liger.

Torch-free at import (arguments.py imports it while ms-swift parses flags); swift and the attention module load
inside the functions.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

ATTN_IMPL = "swift_liger"   # == swift_liger.fusions.varlen_attention.NAME (a test checks)
FLASH_IMPLS = ("flash_attn", "flash_attention_2", "flash_attention_3", "flash_attention_4")
REPLACEABLE = (None, "sdpa", "eager")   # what --use_liger replaces under packing / padding_free
MAX_HEAD_DIM = 256
HINT = ("swift_liger: or --attn_impl swift_liger (Triton attention over packed rows, no flash-attn package needed; "
        "--use_liger picks it by itself)")


def packed(args) -> bool:
    return bool(getattr(args, "padding_free", False) or getattr(args, "packing", False))


def feature(args) -> str:
    return "--packing" if getattr(args, "packing", False) else "--padding_free"


def choose(args) -> Optional[str]:
    """Switch attn_impl to swift_liger when --use_liger trains packed rows with SDPA / eager / nothing chosen.
    Returns the log line, or None when nothing changed."""
    if not (getattr(args, "use_liger", False) and packed(args)):
        return None
    before = getattr(args, "attn_impl", None)
    if before not in REPLACEABLE:
        return None
    args.attn_impl = ATTN_IMPL
    was = f"--attn_impl {before}" if before else "no --attn_impl"
    return (f"swift_liger: {feature(args)} with --use_liger and {was}: using --attn_impl {ATTN_IMPL} (Triton "
            "attention within each packed document; --attn_impl flash_attn keeps flash-attn)")


def check_padding_free(args, orig, log=None) -> None:
    """SftArguments._check_padding_free with swift_liger accepted (see the module doc). `orig` is ms-swift's."""
    note = choose(args)
    if note and log is not None:
        log(note)
    if packed(args) and getattr(args, "attn_impl", None) == ATTN_IMPL:
        if getattr(args, "packing", False):
            args.padding_free = True   # what ms-swift's check does for packing
        return
    try:
        orig(args)
    except ValueError as exc:
        if packed(args) and getattr(args, "attn_impl", None) not in FLASH_IMPLS:
            raise ValueError(f"{exc} {HINT}") from None
        raise


def _model_config(args) -> Optional[dict]:
    model_dir = getattr(getattr(args, "model_info", None), "model_dir", None)
    path = os.path.join(model_dir, "config.json") if isinstance(model_dir, str) else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def check_arguments(args) -> None:
    """Refuse, before the run directory exists, what --attn_impl swift_liger cannot train."""
    if getattr(args, "attn_impl", None) != ATTN_IMPL:
        return
    training = dataclasses.is_dataclass(args) and "gradient_checkpointing" in {f.name for f in dataclasses.fields(args)}
    sp = getattr(args, "sequence_parallel_size", 1) or 1
    if sp > 1:
        raise ValueError(f"swift_liger: --attn_impl {ATTN_IMPL} does not run ms-swift's sequence parallel "
                         f"(--sequence_parallel_size {sp}), which splits attention across ranks with flash-attn: "
                         "use --attn_impl flash_attn, or --sequence_parallel_size 1")
    config = _model_config(args)
    if config is None:
        return
    dropout = config.get("attention_dropout") or 0.0
    if training and isinstance(dropout, (int, float)) and dropout > 0:
        raise ValueError(f"swift_liger: --attn_impl {ATTN_IMPL} has no attention dropout, and the model's "
                         f"config.json sets attention_dropout={dropout}: set it to 0 there, or use --attn_impl "
                         "flash_attn")
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int):
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        raise ValueError(f"swift_liger: --attn_impl {ATTN_IMPL} takes head dims up to {MAX_HEAD_DIM}; this model's "
                         f"is {head_dim}: use --attn_impl flash_attn or sdpa")


def register_if_requested(attn_impl) -> None:
    """Register the implementation with transformers when a model config is about to get it."""
    if attn_impl == ATTN_IMPL:
        from ..fusions.varlen_attention import register   # lazy: torch and transformers, only when requested
        register()
