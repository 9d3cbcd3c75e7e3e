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
  error naming the flag (sequence parallel; a model config with attention_dropout > 0 or head_dim > 256; packed
  rows for a model whose modelling code computes attention without transformers' attention interface, so it would
  never call ours and each packed row's documents would attend to each other).
* `register_if_requested` (AttnImpl.update_attn_impl, where ms-swift writes attn_impl into every model config it
  loads: policy, ref/reward/teacher models, swift infer / export): registers the implementation with transformers
  right before the model is built, which validates the name. `--attn_impl swift_liger` works without --use_liger.

Torch-free at import (arguments.py imports it while ms-swift parses flags); swift and the attention module load
inside the functions.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
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


def _model_dir(args) -> Optional[str]:
    model_dir = getattr(getattr(args, "model_info", None), "model_dir", None)
    return model_dir if isinstance(model_dir, str) else None


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _raw_config(args) -> Optional[dict]:
    model_dir = _model_dir(args)
    text = _read(os.path.join(model_dir, "config.json")) if model_dir else None
    try:
        config = json.loads(text) if text else None
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _model_config(args) -> Optional[dict]:
    config = _raw_config(args)
    text = config.get("text_config") if config else None
    return text if isinstance(text, dict) else config


# transformers' own test of whether a model's attention goes through its AttentionInterface
# (PreTrainedModel._can_set_attn_implementation): an `*Attention*(nn.Module)` class in a modelling file that never
# looks the implementation up there computes attention itself (falcon, bloom, gptj, codegen, ... in transformers 5.17).
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"


def _modelling_code(args, config: dict):
    """(source text, what it is) of the code that will build the language model: the checkpoint's own file when
    config.json maps AutoModelForCausalLM / AutoModel to one (remote code), else transformers' file for the text
    model's type. (None, None) when it cannot be found."""
    auto = config.get("auto_map")
    ref = (auto.get("AutoModelForCausalLM") or auto.get("AutoModel")) if isinstance(auto, dict) else None
    if isinstance(ref, (list, tuple)):
        ref = ref[0] if ref else None
    model_dir = _model_dir(args)
    if isinstance(ref, str) and "--" not in ref and "." in ref and model_dir:
        path = os.path.join(model_dir, ref.rsplit(".", 1)[0].replace(".", os.sep) + ".py")
        return _read(path), f"the checkpoint's own modelling code ({os.path.basename(path)})"
    text = config.get("text_config")
    model_type = (text.get("model_type") if isinstance(text, dict) else None) or config.get("model_type")
    if not isinstance(model_type, str):
        return None, None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
        if model_type not in CONFIG_MAPPING_NAMES:
            return None, None
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
    except (ImportError, ValueError):
        return None, None
    if spec is None or not spec.origin:
        return None, None
    return _read(spec.origin), f"transformers' {model_type} modelling code"


def _bypasses_interface(args, config: dict) -> Optional[str]:
    source, what = _modelling_code(args, config)
    if source and _ATTENTION_CLASS.search(source) and _INTERFACE not in source:
        return what
    return None


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
    raw = _raw_config(args)
    if raw is None:
        return
    bypass = _bypasses_interface(args, raw) if packed(args) else None
    if bypass:
        raise ValueError(f"swift_liger: {feature(args)} with --attn_impl {ATTN_IMPL}: {bypass} computes attention "
                         "without transformers' attention interface, so it would never call swift_liger's and each "
                         "packed row's documents would attend to each other. Use --attn_impl flash_attn (flash-attn "
                         f"installed), or train without {feature(args)}")
    config = _model_config(args)
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
