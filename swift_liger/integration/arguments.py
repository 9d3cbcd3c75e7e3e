"""The `--use_liger` / `--liger_*` arguments of `swift sft`, `swift pt` and `swift rlhf`.

They become real dataclass fields of ms-swift's `SftArguments` (so `HfArgumentParser`, YAML configs, `--help` via
`swift pt --help` and `args.json` all see them) and are validated when the arguments are built, before any model is
loaded. No torch / swift import here: this runs inside ms-swift's own import of `sft_args`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import os
import sys
import warnings
import weakref
from typing import Optional

from ..config import LigerConfig, closest, read_yaml
from ..env import backend_from_env
from ..fusions import BY_KEY, REGISTRY
from ..fusions.base import SAME
from ..patching.families import FAMILIES
from ..versions import require as require_versions
from .attention import check_arguments as check_attention
from .first_step_profile import rows_from_env as profile_rows

_BOOL_FLAG = {"nargs": "?", "const": True}  # `--liger_rope` alone means true; default None means "from the preset"

# name, type, default, help. Every name must be new to ms-swift and no prefix of an ms-swift flag, except use_liger,
# which is a prefix of use_liger_kernel on purpose: argparse prefers the exact match, so `--use_liger` is ours.
# One --liger_<key> per fusion of the registry (swift_liger/fusions/), between the plugin's own flags.
FIELDS = (
    ("use_liger", bool, False, "Patch the model with swift_liger's Triton kernels after it is loaded and before the "
                               "tuner wraps it (the default preset: every fusion on)."),
    ("liger_config", Optional[str], None, "Preset name or path to a YAML of LigerConfig keys; liger_* flags override "
                                          "it."),
    *((f.flag, Optional[bool] if f.kind == "bool" else Optional[str], None, f.help) for f in REGISTRY),
    ("liger_strict", Optional[bool], None, "An unsupported model type is an error (before the model loads) instead "
                                           "of a warning."),
    ("liger_metrics", bool, True, "Log step_time(s), tokens/s, peak memory and MFU every logging step (with or "
                                  "without --use_liger, so runs compare fairly)."),
)
FIELD_NAMES = tuple(f[0] for f in FIELDS)
# flag -> LigerConfig key
FLAG_TO_KEY = {**{f.flag: f.key for f in REGISTRY}, "liger_strict": "strict"}
PRESET_DIR_ENV = "SWIFT_LIGER_PRESET_DIR"
ENV_VARS = {   # every environment variable swift_liger reads, checked in validate()
    "SWIFT_LIGER_BACKEND": "auto (CUDA tensors run Triton, CPU tensors the PyTorch reference), triton or torch",
    PRESET_DIR_ENV: "a directory searched first for liger_config preset names",
    "SWIFT_LIGER_PEAK_TFLOPS": "peak dense TFLOP/s of one device for MFU (a number > 0), when the GPU name is unknown",
    "SWIFT_LIGER_DISABLE_HOOK": "1 turns the ms-swift import hook off (no --use_liger flags)",
    "SWIFT_LIGER_FAST_LAUNCH": "0 sends every Triton launch through kernel[grid] (default 1: decode-path kernels "
                               "replay their compiled launcher, ~7 us less host time per launch)",
    "SWIFT_LIGER_GRAPH_LAYERS": "measure (default: graph_layers times each batch shape eager vs replayed and keeps the "
                                "faster) or always (replay every replayable shape untimed, for benchmarks)",
    "SWIFT_LIGER_COMPILE_AHEAD": "0 compiles a decoder layer's kernels one after another at their first launch "
                                 "(default 1 on CUDA: graph_layers compiles a new batch shape's kernels on a thread "
                                 "pool before its first call)",
    "SWIFT_LIGER_GRAPH_NO_GRAD": "0 runs autograd-off forwards (reference, old-policy and evaluation passes) eagerly "
                                 "(default 1: graph_layers replays them too, under batch shapes of their own)",
    "SWIFT_LIGER_LORA_BASE_EPILOGUE": "0 adds a fused LoRA projection's LoRA output after its base GEMM (a rank-r "
                                      "GEMM that reads and writes the output again); default 1: the base GEMM adds "
                                      "into the LoRA output (cuBLAS beta=1), 1.6-1.7% faster at 7B-8B, 8k tokens",
    "SWIFT_LIGER_FP8_HW_CVT": "0 quantizes liger_fp8_base's activations and gradients with an IEEE division per "
                              "element; default 1: one reciprocal per row and the GPU's e4m3 conversion (sm_89+), "
                              "1.8-4.4% faster at 7B-8B, 8k tokens",
    "SWIFT_LIGER_ALLOW_UNTESTED_VERSIONS": "1 warns instead of refusing torch, triton, transformers or ms-swift "
                                           "versions outside the tested ranges (swift_liger/versions.py)",
    "SWIFT_LIGER_FP8_EMULATE": "1 lets liger_fp8_base run without an FP8 GPU, on CPU through torch's reference FP8 "
                               "GEMM (tests and accuracy studies; slow)",
    "SWIFT_LIGER_PROFILE_FIRST_STEP": "N > 0: a cProfile of the first optimizer step's host time, the N functions "
                                      "with the most cumulative and own time in liger_patch.json (runtime.first_step."
                                      "profile) and the log; slows that step",
}


def default_text(flag: str) -> str:
    """The value a flag takes when not given under --use_liger (swift_defaults(), the default preset), for help and
    docs."""
    if flag == "liger_config":
        return "none (the defaults below, the same as the default preset)"
    if flag in FLAG_TO_KEY:
        value = swift_defaults()[FLAG_TO_KEY[flag]]
        text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        return f"{text} (from the preset)"
    value = next(f[2] for f in FIELDS if f[0] == flag)
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe(flag: str) -> str:
    text = next(f[3] for f in FIELDS if f[0] == flag)
    if flag == "liger_config":
        names = preset_names()
        text = text.rstrip(".") + (f" (presets: {', '.join(names)})." if names else ".")
    return text


def help_text(flag: str) -> str:
    return f"{describe(flag)} Default: {default_text(flag)}."


def flags_markdown() -> str:
    """The README table of every flag: name, default, what it does (generated, so it cannot drift)."""
    rows = ["| flag / YAML key | default | what it does |", "|---|---|---|"]
    for name, _, _, _ in FIELDS:
        rows.append(f"| `--{name}` | {default_text(name)} | {describe(name)} |")
    rows += ["", "| environment variable | meaning |", "|---|---|"]
    rows += [f"| `{k}` | {v} |" for k, v in ENV_VARS.items()]
    return "\n".join(rows)

# id(args) -> resolved state; kept off the args object so args.json and `args:` log lines stay unchanged.
_RESOLVED: dict = {}


# ---------------------------------------------------------------------------------------------------------------
# Field injection
# ---------------------------------------------------------------------------------------------------------------

def inject_fields(cls) -> None:
    """Add FIELDS to the dataclass `cls` in place (idempotent).

    Subclasses defined afterwards (PretrainArguments, RLHFArguments) pick the fields up from
    `__dataclass_fields__` when `@dataclass` builds their `__init__`; `cls`'s own, already generated `__init__` is
    wrapped to accept them. Re-running `@dataclass` on `cls` would not regenerate `__init__`, and a same-named
    subclass would break `isinstance` checks, hence this.
    """
    dc_fields = getattr(cls, "__dataclass_fields__", None)
    if dc_fields is None:
        raise TypeError(f"swift_liger: {cls!r} is not a dataclass")
    if "use_liger" in dc_fields:
        return
    clash = sorted(set(FIELD_NAMES) & set(dc_fields))
    if clash:
        raise RuntimeError(f"swift_liger: ms-swift already defines {clash}; this ms-swift version is not supported")
    annotations = cls.__dict__.get("__annotations__")
    if annotations is None:
        annotations = {}
        cls.__annotations__ = annotations
    for name, typ, default, _ in FIELDS:
        metadata = {"help": help_text(name)}
        if typ == Optional[bool]:  # == not is: typing caches Union objects in a bounded LRU
            metadata.update(_BOOL_FLAG)
        f = dataclasses.field(default=default, metadata=metadata)
        f.name, f.type = name, typ
        f._field_type = dataclasses._FIELD  # what dataclasses.fields() filters on
        f.kw_only = False  # inherited fields must have it resolved (MISSING counts as true)
        dc_fields[name] = f
        annotations[name] = typ
        setattr(cls, name, default)

    defaults = {name: default for name, _, default, _ in FIELDS}
    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        # Set before the original __init__, whose last act is __post_init__ (where they are validated).
        for name, default in defaults.items():
            setattr(self, name, kwargs.pop(name, default))
        orig_init(self, *args, **kwargs)

    try:
        sig = inspect.signature(orig_init)
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in defaults.items()]
        params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD] + extra
        __init__.__signature__ = sig.replace(parameters=params)
    except (TypeError, ValueError):  # signature is cosmetic here
        pass
    cls.__init__ = __init__

    orig_post_init = cls.__post_init__

    @functools.wraps(orig_post_init)
    def __post_init__(self, *args, **kwargs):
        validate(self)  # before ms-swift's own checks and long before the model loads
        orig_post_init(self, *args, **kwargs)
        finalize(self)

    cls.__post_init__ = __post_init__

    # ms-swift resolves the model's config in __post_init__ and creates the run directory at its end
    # (_add_version): the model-type check goes right before that, so a refused run leaves no directory behind;
    # so does the --attn_impl swift_liger check (with or without --use_liger).
    orig_add_version = cls.__dict__.get("_add_version")
    if orig_add_version is not None:
        @functools.wraps(orig_add_version)
        def _add_version(self, *args, **kwargs):
            check_attention(self)
            check_model(self)
            return orig_add_version(self, *args, **kwargs)

        cls._add_version = _add_version


# ---------------------------------------------------------------------------------------------------------------
# Validation and resolution
# ---------------------------------------------------------------------------------------------------------------

def preset_dirs() -> list:
    """Where bare preset names are looked up: $SWIFT_LIGER_PRESET_DIR, a source checkout, the installed share dir."""
    dirs = []
    if os.environ.get(PRESET_DIR_ENV):
        dirs.append(os.environ[PRESET_DIR_ENV])
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dirs.append(os.path.join(pkg_root, "configs", "liger"))  # editable install / source checkout
    import site
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, site.getuserbase())):  # venv, system, --user
        dirs.append(os.path.join(prefix, "share", "swift-liger", "configs", "liger"))  # wheel shared-data
    return dirs


def preset_names() -> list:
    return sorted({os.path.splitext(f)[0] for d in preset_dirs() if os.path.isdir(d)
                   for f in os.listdir(d) if f.endswith(".yaml")})


def find_preset(name_or_path: str) -> str:
    if os.path.isfile(name_or_path):
        return name_or_path
    looks_like_path = os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if not looks_like_path:
        for d in preset_dirs():
            path = os.path.join(d, f"{name_or_path}.yaml")
            if os.path.isfile(path):
                return path
    names = preset_names()
    raise ValueError(f"liger_config: {name_or_path!r} is neither a file nor a known preset "
                     f"(presets: {', '.join(names) or 'none found'})")


def liger_flags_given(args) -> dict:
    return {flag: getattr(args, flag) for flag in FLAG_TO_KEY if getattr(args, flag, None) is not None}


def swift_defaults() -> dict:
    """LigerConfig's defaults as --use_liger takes them: a fusion's swift_default where it has one (safe with
    ms-swift's collators and losses only, so off in swift_liger.apply)."""
    return {**LigerConfig().to_dict(), **{f.key: f.swift_default for f in REGISTRY if f.swift_default is not SAME}}


def resolve_config(args) -> LigerConfig:
    """Preset (or swift_defaults()) overridden by the liger_* flags. A preset sets the keys it lists; the others keep
    swift_defaults(). Errors name the offending key or file."""
    data = swift_defaults()
    if args.liger_config:
        path = find_preset(args.liger_config)
        try:
            listed = read_yaml(path)
            preset = LigerConfig.from_dict(listed).to_dict()   # checked: known keys, valid values
            data.update({k: v for k, v in preset.items() if k in listed})
        except (ValueError, TypeError) as e:
            raise ValueError(f"liger_config {path}: {e}") from None
    given = liger_flags_given(args)

    def flag_error(e):   # name what the user typed, not the config field behind it
        text = str(e)
        for flag in given:
            text = text.replace(f"LigerConfig.{FLAG_TO_KEY[flag]} ", f"--{flag} ")
        return ValueError(f"swift_liger flags: {text}")
    for flag, value in given.items():
        key = FLAG_TO_KEY[flag]
        fusion = BY_KEY.get(key)
        if fusion is not None and fusion.parse_flag is not None:
            try:
                value = fusion.parse_flag(value)
            except (ValueError, TypeError) as e:
                raise flag_error(e) from None
        data[key] = value
    try:
        return LigerConfig.from_dict(data)
    except (ValueError, TypeError) as e:
        raise flag_error(e) from None


def check_argv(class_type, argv) -> None:
    """Refuse --liger_* / --use_liger* flags (CLI or YAML keys, which ms-swift turns into flags) that are not exact
    names: argparse would take an abbreviation (--liger_rms for --liger_rms_norm) silently, and ms-swift reports a
    misspelt one only after it has created the run directory. Runs before the arguments are parsed."""
    if not dataclasses.is_dataclass(class_type):
        return
    known = {f.name for f in dataclasses.fields(class_type)}
    if "use_liger" not in known:   # an ms-swift command we do not patch (export, eval, sample, ...)
        for token in argv or ():
            name = token[2:].split("=", 1)[0].replace("-", "_") if isinstance(token, str) and \
                token.startswith("--") else ""
            if name in FIELD_NAMES or name.startswith("liger_"):
                raise ValueError(f"swift_liger: --{name} does not apply to this command ({class_type.__name__}): "
                                 "swift_liger patches `swift sft|pt|rlhf` training and `swift infer|deploy|app` "
                                 "generation with the transformers engine; drop the flag here")
        return
    argv = list(argv or ())
    for i, token in enumerate(argv):
        if not isinstance(token, str) or not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name in FIELD_NAMES and "=" not in token:   # ours take one value (a YAML list becomes several)
            values = []
            for nxt in argv[i + 1:]:
                if not isinstance(nxt, str) or nxt.startswith("--"):
                    break
                values.append(nxt)
            if len(values) > 1:
                raise ValueError(f"swift_liger: --{name} takes one value, got {len(values)} ({' '.join(values)}); "
                                 f"a YAML list for {name}? give one value")
        if name in known:
            continue
        if name.startswith(("liger", "use_liger")) or difflib.get_close_matches(name, FIELD_NAMES, n=1, cutoff=0.85):
            hint = closest("--" + name, ["--" + n for n in FIELD_NAMES])
            raise ValueError(f"swift_liger: unknown flag --{name}{hint}; swift_liger's flags "
                             f"(also YAML keys): {', '.join('--' + n for n in FIELD_NAMES)}")


def _check_zero_one(name: str, empty_ok: bool = True) -> None:
    """An on/off environment variable: unset, 0 or 1 (or empty, which means its default, where empty_ok)."""
    value = os.environ.get(name)
    if value is not None and value.strip() not in (("0", "1", "") if empty_ok else ("0", "1")):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def check_environment() -> None:
    """Every environment variable swift_liger reads (ENV_VARS), checked when the arguments are built, and the
    installed dependency versions (before ms-swift loads the model)."""
    require_versions("torch", "triton", "transformers", "ms-swift")
    backend = backend_from_env()
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        torch = sys.modules.get("torch")
        if torch is not None and not torch.cuda.is_available():
            raise ValueError("SWIFT_LIGER_BACKEND=triton without CUDA needs TRITON_INTERPRET=1 (Triton's interpreter "
                             "runs the kernels on CPU); unset SWIFT_LIGER_BACKEND to use the PyTorch reference")
    preset_dir = os.environ.get(PRESET_DIR_ENV)
    if preset_dir and not os.path.isdir(preset_dir):
        raise ValueError(f"{PRESET_DIR_ENV}={preset_dir!r} is not a directory")
    _check_zero_one("SWIFT_LIGER_FAST_LAUNCH", empty_ok=False)
    for name in ("SWIFT_LIGER_FP8_EMULATE", "SWIFT_LIGER_COMPILE_AHEAD", "SWIFT_LIGER_GRAPH_NO_GRAD",
                 "SWIFT_LIGER_LORA_BASE_EPILOGUE", "SWIFT_LIGER_FP8_HW_CVT"):
        _check_zero_one(name)
    profile_rows()   # SWIFT_LIGER_PROFILE_FIRST_STEP: a number of rows
    graphs = os.environ.get("SWIFT_LIGER_GRAPH_LAYERS")
    if graphs is not None and graphs.strip() not in ("measure", "always"):
        raise ValueError(f"SWIFT_LIGER_GRAPH_LAYERS must be measure or always, got {graphs!r}")
    check_metrics_environment()


def check_metrics_environment() -> None:
    """SWIFT_LIGER_PEAK_TFLOPS, read by the per-step metrics, which run with or without --use_liger."""
    peak = os.environ.get("SWIFT_LIGER_PEAK_TFLOPS")
    if peak:
        try:
            ok = float(peak) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"SWIFT_LIGER_PEAK_TFLOPS must be a number > 0 (TFLOP/s of one device), got {peak!r}")


TRAINING_ONLY = ("offload_checkpoints", "save_attention")   # they act on training's gradient checkpoints
PAD_LOGITS_RLHF = ("cpo", "orpo", "simpo")   # trl's CPO/ORPO trainers average logits over pad positions too
SMALL_TILE = 1024   # liger_tiled_mlp below this is warned: many small MLP calls per layer


def check_takes_effect(args, cfg):
    """Settings that would be accepted and then do nothing (or only be noticed after a step): refused, naming them.
    Returns (config, notes): a preset's training-only fusions are switched off (and said) for commands that do not
    train (swift infer / deploy / app)."""
    notes = []
    # an ms-swift arguments class without the training fields (InferArguments, DeployArguments, ...)
    inference = dataclasses.is_dataclass(args) and "gradient_checkpointing" not in {
        f.name for f in dataclasses.fields(args)}
    if inference:
        for key in TRAINING_ONLY:
            if not getattr(cfg, key):
                continue
            if getattr(args, f"liger_{key}", None) is not None:
                raise ValueError(f"swift_liger: liger_{key} acts on training's gradient checkpoints; "
                                 f"{type(args).__name__} does not train (drop the flag)")
            cfg = dataclasses.replace(cfg, **{key: False})
            notes.append(f"{key} off: training only ({type(args).__name__} does not train)")
    tile = cfg.tiled_mlp
    if tile and tile < SMALL_TILE:
        message = (f"liger_tiled_mlp={tile}: the MLP runs {tile} tokens at a time, one forward (and one recompute) "
                   f"per tile, so a step slows by the number of tiles while the memory saved is small; tiles of "
                   f"{SMALL_TILE}+ tokens keep the launches few (the long_context preset uses 8192)")
        warnings.warn("swift_liger: " + message, stacklevel=2)
        notes.append(message)
    checkpointing = getattr(args, "gradient_checkpointing", None)   # training arguments only
    if cfg.graph_layers and (inference or checkpointing is False):
        why = f"{type(args).__name__} does not train" if inference else "--gradient_checkpointing false"
        if getattr(args, "liger_graph_layers", None) is not None:
            fix = "drop the flag" if inference else "keep ms-swift's default --gradient_checkpointing true"
            raise ValueError(f"swift_liger: liger_graph_layers replays training's reentrant gradient checkpoints; "
                             f"{why} here ({fix})")
        cfg = dataclasses.replace(cfg, graph_layers=False)
        notes.append(f"graph_layers off: it replays training's gradient checkpoints ({why})")
    if checkpointing is False:
        for key in TRAINING_ONLY:
            if getattr(cfg, key):
                raise ValueError(f"swift_liger: liger_{key}={getattr(cfg, key)!r} works on the gradient checkpoints "
                                 "and needs --gradient_checkpointing true (ms-swift's default); it is off here")
    if cfg.qk_norm_rope and not cfg.rope and getattr(args, "liger_qk_norm_rope", None) is not None:
        raise ValueError("swift_liger: liger_qk_norm_rope true runs inside the RoPE kernel and needs liger_rope true "
                         "(it is false here)")
    rlhf_type = getattr(args, "rlhf_type", None)
    if cfg.drop_pad_mask and getattr(args, "liger_drop_pad_mask", None) is None and (
            inference or rlhf_type in PAD_LOGITS_RLHF):
        why = (f"{type(args).__name__} does not train" if inference else f"the {rlhf_type} trainer logs logits/chosen "
               "and logits/rejected as means over every position, pads included")
        cfg = dataclasses.replace(cfg, drop_pad_mask=False)
        notes.append(f"drop_pad_mask off: {why}")
    if cfg.rolling_cache and rlhf_type in ROLLOUT_RLHF and getattr(args, "use_vllm", False):
        raise ValueError("swift_liger: liger_rolling_cache runs the policy's generate calls, and with --use_vllm "
                         f"true the {rlhf_type} rollouts run in vLLM instead: drop liger_rolling_cache, or pass "
                         "--use_vllm false (ms-swift's pt engine, which swift_liger patches)")
    if cfg.fp8_base:
        check_fp8_base(args, cfg, inference)
    if (cfg.rolling_cache or {}).get("cuda_graph"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError("swift_liger: liger_rolling_cache ',graph' replays CUDA graphs and needs a CUDA GPU; "
                             "none is available here (drop ',graph')")
    return cfg, notes


def check_fp8_base(args, cfg, inference: bool) -> None:
    """liger_fp8_base stores the frozen bases under LoRA in FP8: refused where it could only be skipped or be wrong."""
    head = "swift_liger: liger_fp8_base (FP8 frozen LoRA bases)"
    if inference:
        raise ValueError(f"{head} is a training setting; {type(args).__name__} does not train (drop the flag)")
    tuner = getattr(args, "tuner_type", None) or getattr(args, "train_type", None) or "lora"
    if tuner != "lora":
        raise ValueError(f"{head} needs --tuner_type lora (frozen base weights under LoRA adapters); with "
                         f"--tuner_type {tuner} " + ("the base weights train" if tuner == "full" else
                                                     "there is no plain LoRA base to store") + ": drop the flag")
    if getattr(args, "use_dora", False):
        raise ValueError(f"{head}: --use_dora true reads the base weight in DoRA's own maths, so every base would "
                         "stay 16-bit; drop one of them")
    for flag in ("quant_method", "quant_bits"):
        if getattr(args, flag, None):
            raise ValueError(f"{head}: --{flag} {getattr(args, flag)} already loads the base quantized; use one of "
                             f"them (FP8 bases: drop --{flag}; 4-bit QLoRA: drop liger_fp8_base)")
    for flag in ("deepspeed", "fsdp"):
        if getattr(args, flag, None):
            raise ValueError(f"{head} is built for one GPU per model copy (DDP); --{flag} shards the weights it "
                             "would store: drop one of them")
    for key in ("compile_layers", "fused_projections"):
        if getattr(cfg, key):
            raise ValueError(f"{head} does not run with liger_{key} (torch.compile does not trace the FP8 weight; "
                             "fused_projections concatenates 16-bit weights): switch one of them off")
    import torch   # lazy: argument checks load without torch; ms-swift's own arguments have imported it already

    from ..patching.fp8 import EMULATE_ENV, emulation_allowed   # lazy: needs torch
    if not torch.cuda.is_available():
        if emulation_allowed():
            return
        raise ValueError(f"{head} needs an NVIDIA GPU with FP8 tensor cores (sm_89+: L4, L40S, RTX 4090, H100, "
                         f"H200); no CUDA GPU is available here ({EMULATE_ENV}=1 emulates them on CPU, for tests)")
    from ..ops.fp8_linear_op import fp8_device_problem   # lazy: the kernels load with a model, not the arguments
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    problem = fp8_device_problem(torch.device("cuda", local % max(1, torch.cuda.device_count())))
    if problem:
        raise ValueError(f"{head}: {problem}; drop the flag on this GPU")


def check_layers(state, config_json: dict) -> None:
    """Settings that count decoder layers, against the checkpoint's num_hidden_layers."""
    layers = config_json.get("num_hidden_layers")
    n = state["config"].offload_checkpoints
    if isinstance(layers, int) and not isinstance(n, bool) and isinstance(n, int) and n > layers:
        raise ValueError(f"swift_liger: liger_offload_checkpoints={n} (the first N decoder layers) but the model has "
                         f"{layers}; give a number <= {layers} or true for every layer")


def check_model_window(state, model_dir: str) -> None:
    """liger_rolling_cache "model" on a checkpoint without (one) sliding window: refused now, from its config, rather
    than warned and skipped once the model is loaded."""
    rolling = state["config"].rolling_cache or {}
    if rolling.get("window") != "model":
        return
    from transformers import AutoConfig

    from ..cache.support import model_layer_kinds  # lazy: needs torch; arguments load without it
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return
    config = getattr(config, "text_config", None) or config
    try:
        model_layer_kinds(config)
    except ValueError as exc:
        raise ValueError(f"swift_liger: liger_rolling_cache model: {exc}") from None


def check_model(args) -> None:
    """The model type from the checkpoint's config.json (ms-swift has resolved the model dir; no weights are loaded
    yet) against the families swift_liger patches: an error under --liger_strict, else a warning saying what is
    supported."""
    state = _RESOLVED.get(id(args))
    if state is None:
        return
    model_dir = getattr(getattr(args, "model_info", None), "model_dir", None)   # local (downloaded if a hub id)
    path = os.path.join(model_dir, "config.json") if isinstance(model_dir, str) else None
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            config_json = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(config_json, dict):
        return
    check_layers(state, config_json)
    check_model_window(state, model_dir)
    model_type = config_json.get("model_type")
    if model_type is None:
        return
    if model_type in FAMILIES:
        return
    message = (f"swift_liger: model type {model_type!r} is not supported (swift_liger patches "
               f"{', '.join(sorted(FAMILIES))})")
    if state["config"].strict:
        raise ValueError(message + "; --liger_strict refuses it (drop --liger_strict to train it unpatched)")
    state["notes"].append(message[len("swift_liger: "):] + "; the model trains unpatched")
    warnings.warn(message + "; the model trains unpatched", stacklevel=2)


def validate(args) -> None:
    """Runs first thing in SftArguments.__post_init__: every liger error surfaces here, before any model loads."""
    _RESOLVED.pop(id(args), None)
    if not getattr(args, "use_liger", False):
        given = list(liger_flags_given(args)) + (["liger_config"] if getattr(args, "liger_config", None) else [])
        if given:
            raise ValueError(f"swift_liger: {', '.join('--' + g for g in given)} given without --use_liger; "
                             "add --use_liger (use_liger: true in YAML) or drop them")
        if getattr(args, "liger_metrics", True):
            check_metrics_environment()
        return
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("--use_liger (swift_liger's Triton kernels) and --use_liger_kernel (the liger-kernel "
                         "package) patch the same layers; pass only one of them")
    check_environment()
    config, notes = check_takes_effect(args, resolve_config(args))
    _RESOLVED[id(args)] = {"config": config, "notes": notes}
    try:  # forget it with the args object (ids are reused); args dataclasses are unhashable, so no WeakKeyDict
        weakref.finalize(args, _RESOLVED.pop, id(args), None)
    except TypeError:
        pass


# rlhf types whose trainer takes its log-probs from hidden states with cross_entropy=fused_linear (preference.py);
# simpo is in the list as written on the command line, ms-swift runs it as cpo. GRPO's per-token log-probs, and the
# entropies --log_entropy / --top_entropy_quantile < 1 ask for, come from hidden states in one pass of the head
# (preference.GRPOSeam). GKD's divergence comes from the student's and the teacher's hidden states (preference.GKDSeam).
PREFERENCE_RLHF = ("dpo", "orpo", "cpo", "simpo", "kto", "grpo", "gkd")


def preference_fused(args, cfg) -> bool:
    """The preference trainer computes its log-probs from hidden states (ops.fused_linear_logprobs), never from
    [rows, V] logits."""
    return getattr(args, "rlhf_type", None) in PREFERENCE_RLHF and cfg.cross_entropy == "fused_linear"


def cross_entropy_fallback_reasons(args) -> list:
    """Why labels would not reach the model, making fused_linear pointless (ms-swift pops labels and computes the
    loss from outputs.logits itself in these cases; see Seq2SeqTrainer.compute_loss). Preference rlhf types take
    fused_linear as log-probs from hidden states and fall back only for sequence parallel and non-causal tasks."""
    reasons = []
    rlhf_type = getattr(args, "rlhf_type", None)
    if rlhf_type in PREFERENCE_RLHF:
        if (getattr(args, "sequence_parallel_size", 1) or 1) > 1:
            reasons.append(f"sequence_parallel_size={args.sequence_parallel_size} (log-probs are gathered across "
                           "ranks from logits)")
        task_type = getattr(args, "task_type", "causal_lm")
        if task_type not in (None, "causal_lm"):
            reasons.append(f"task_type={task_type} has no language-model head")
        return reasons
    if rlhf_type:
        reasons.append(f"rlhf_type={rlhf_type} computes its loss from logits (labels never reach the model)")
    task_type = getattr(args, "task_type", "causal_lm")
    if task_type not in (None, "causal_lm"):
        reasons.append(f"task_type={task_type} has no language-model loss")
    if getattr(args, "loss_type", None) and not rlhf_type:
        reasons.append(f"loss_type={args.loss_type} (custom loss on logits)")
    if (getattr(args, "sequence_parallel_size", 1) or 1) > 1:
        reasons.append(f"sequence_parallel_size={args.sequence_parallel_size}")
    # enable_dft_loss, enable_channel_loss, a non-binary loss_scale and label_smoothing_factor keep fused_linear: their
    # losses come from hidden states (preference.SFTSeam), see weighted_sft()
    return reasons


def weighted_sft(args) -> list:
    """The per-token weightings (and label smoothing) of this SFT / pt run that ms-swift applies to a loss it computes
    from outputs.logits (Seq2SeqTrainer.compute_loss); with fused_linear, preference.SFTSeam computes those losses
    from hidden states instead."""
    if getattr(args, "rlhf_type", None):
        return []
    found = [name for name in ("enable_dft_loss", "enable_channel_loss") if getattr(args, name, False)]
    if (getattr(args, "label_smoothing_factor", 0) or 0) > 0:
        found.append(f"label_smoothing_factor={args.label_smoothing_factor}")
    loss_scale = getattr(args, "loss_scale", None)
    if loss_scale:
        try:
            from swift.loss_scale import get_loss_scale
            if not get_loss_scale(loss_scale).is_binary_loss_scale:
                found.append(f"loss_scale={loss_scale}")
        except Exception:   # an unknown loss_scale is ms-swift's error to raise, later
            found.append(f"loss_scale={loss_scale}")
    return found


def finalize(args) -> None:
    """After ms-swift's __post_init__: apply the fused_linear -> fused fallback now that all args are final."""
    state = _RESOLVED.get(id(args))
    if state is None:
        return
    cfg, notes = rollout_cache(args, state["config"])
    state["config"] = cfg
    state["notes"].extend(notes)
    if cfg.cross_entropy == "fused_linear":
        reasons = cross_entropy_fallback_reasons(args)
        weighted = weighted_sft(args)
        rlhf_type = getattr(args, "rlhf_type", None)
        if reasons and rlhf_type in PREFERENCE_RLHF:   # its trainer never calls the model's loss: nothing to fuse
            state["config"] = dataclasses.replace(cfg, cross_entropy="off")
            state["notes"].append(f"cross_entropy fused_linear -> off: the {rlhf_type} trainer computes log-probs "
                                  "from logits here: " + "; ".join(reasons))
        elif reasons:
            state["config"] = dataclasses.replace(cfg, cross_entropy="fused")
            state["notes"].append("cross_entropy fused_linear -> fused: " + "; ".join(reasons))
        elif weighted:
            state["notes"].append("cross_entropy=fused_linear: per-token losses for " + ", ".join(weighted)
                                  + " come from hidden states (the fused linear head), not [tokens, vocab] logits")
        elif rlhf_type == "gkd":
            teacher = ("the top-k log-probs its teacher server returns" if getattr(args, "teacher_model_server", None)
                       else "the teacher's hidden states")
            state["notes"].append("cross_entropy=fused_linear: the gkd trainer computes its divergence from the "
                                  f"student's hidden states and {teacher} (ops.fused_linear_jsd)")
        elif rlhf_type in PREFERENCE_RLHF:
            state["notes"].append(f"cross_entropy=fused_linear: the {rlhf_type} trainer takes its log-probs from "
                                  "hidden states (ops.fused_linear_logprobs), for the policy and the reference pass")


ROLLOUT_RLHF = ("grpo", "gkd")   # trainers that generate with the policy (ms-swift's RolloutTrainerMixin)
EXACT_GRAPH = {"window": "exact", "sinks": 0, "mode": "absolute", "cuda_graph": True}


def _default_rollout_cache_blocker(args) -> Optional[str]:
    """Why GRPO / GKD rollouts through the pt engine keep transformers' cache by default here (None: they take
    liger_rolling_cache exact,graph). The graph path is measured on one CUDA GPU with bf16 LoRA and full weights;
    sharded (DeepSpeed, FSDP) and quantized policies are left alone."""
    import torch   # lazy: argument checks load without torch; ms-swift's own arguments have imported it already
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    for flag in ("deepspeed", "fsdp", "quant_bits", "quant_method"):
        if getattr(args, flag, None):
            return f"--{flag} {getattr(args, flag)} (not measured with CUDA-graph decode)"
    from ..patching.families import rolling_cache_model_types  # lazy: only GRPO / GKD without vLLM need it
    model_type = getattr(args, "model_type", None)
    if model_type and model_type not in rolling_cache_model_types():
        return f"model_type {model_type} (RollingKVCache covers {', '.join(rolling_cache_model_types())})"
    return None


def rollout_cache(args, cfg):
    """(config, notes) for liger_rolling_cache in `swift rlhf --rlhf_type grpo|gkd`: the policy's rollouts through
    ms-swift's pt engine (--use_vllm false) generate on it (with vLLM an explicit setting was refused by
    check_takes_effect, before ms-swift's own checks). Left unset on a CUDA GPU it becomes "exact,graph" (a ring per
    call of prompt + new tokens, every decode step a CUDA-graph replay: the default cache's attention, 3.4-6.8x its
    tokens/s; `--liger_rolling_cache none` keeps transformers' cache). A ring shorter than --max_length +
    --max_completion_length can drop the middle of long rollouts: said."""
    rlhf_type = getattr(args, "rlhf_type", None)
    if rlhf_type not in ROLLOUT_RLHF or getattr(args, "use_vllm", False):
        return cfg, []
    rolling = cfg.rolling_cache
    if rolling is None and getattr(args, "liger_rolling_cache", None) is None:   # unset (not "none")
        why = _default_rollout_cache_blocker(args)
        if why is not None:
            return cfg, [f"rolling_cache off: the {rlhf_type} rollouts (pt engine) keep transformers' cache ({why})"]
        cfg = dataclasses.replace(cfg, rolling_cache=dict(EXACT_GRAPH))
        return cfg, [f"rolling_cache exact,graph (the default for {rlhf_type} rollouts through the pt engine): each "
                     "generate call decodes on a ring of its prompt + new tokens (the default cache's attention), "
                     "every decode step a CUDA-graph replay; --liger_rolling_cache none keeps transformers' cache"]
    if not rolling:
        return cfg, []
    window = rolling.get("window")
    graph = ", CUDA-graph decode steps" if rolling.get("cuda_graph") else ""
    if window == "exact":
        return cfg, [f"rolling_cache: the {rlhf_type} rollouts (pt engine) generate on a ring of each call's prompt + "
                     f"new tokens: exact attention{graph}"]
    if not isinstance(window, int):
        return cfg, [f"rolling_cache: the {rlhf_type} rollouts (pt engine) generate on RollingKVCache(window=model): "
                     "the model's own sliding window, exact"]
    capacity = window + (rolling.get("sinks") or 0)
    # a prompt of up to --max_length tokens, then up to --max_completion_length sampled ones
    prompt, completion = getattr(args, "max_length", None), getattr(args, "max_completion_length", None) or 0
    if isinstance(prompt, int) and capacity >= prompt + completion:
        return cfg, [f"rolling_cache: the {rlhf_type} rollouts (pt engine) generate on a RollingKVCache of "
                     f"{capacity} slots >= --max_length {prompt} + --max_completion_length {completion}: exact "
                     f"attention{graph}"]
    message = (f"rolling_cache: the {rlhf_type} rollouts (pt engine) generate on a RollingKVCache of {capacity} "
               f"slots{graph}; --max_length {prompt} + --max_completion_length {completion} can exceed it: rows "
               f"longer than {capacity} tokens attend to the first {rolling.get('sinks') or 0} and the last {window} "
               "only, so the policy samples from a shortened context while it trains on the whole row "
               "(--liger_rolling_cache exact,graph is exact)")
    warnings.warn("swift_liger: " + message, stacklevel=2)
    return cfg, [message]


def resolved(args):
    """(LigerConfig, notes) for args built with --use_liger, else None."""
    state = _RESOLVED.get(id(args))
    if state is None:
        return None
    return state["config"], list(state["notes"])
