"""What the import hook does to each ms-swift module, right after its body has run.

* swift.arguments.sft_args   -> SftArguments gains the --use_liger / --liger_* fields (arguments.py), and its
                                 _check_padding_free takes --attn_impl swift_liger for --packing / --padding_free
                                 (chosen by itself under --use_liger; attention.py).
* swift.model.utils          -> AttnImpl.update_attn_impl registers the swift_liger attention implementation with
                                 transformers before a model with --attn_impl swift_liger is built.
* swift.pipelines.base       -> parse_args first refuses unknown or abbreviated --liger_* flags (before the run
                                 directory exists).
* swift.cli.utils            -> `swift sft --help` prints every flag, ours included (ms-swift's sft entry point
                                 otherwise answers --help from a one-flag pre-parser).
* swift.pipelines.train.tuner -> TunerMixin.prepare_model patches the freshly loaded model before the tuner wraps
                                 it (sft, pt, rlhf policy, PPO value model), on every rank.
* swift.pipelines.train.rlhf -> side models (ref, reward, teacher) are patched before their adapters load, with
                                 the loss fusion off (their loss is never used), except a preference trainer's
                                 reference model, whose log-probs come from hidden states too.
* swift.arguments.infer_args -> InferArguments (so also swift deploy / app / eval) gains the same fields, validated
                                 the same way; --use_liger needs --infer_backend transformers (pt), the only engine
                                 that runs the PyTorch model.
* swift.pipelines.infer.infer -> SwiftInfer (swift infer, deploy, and app through deploy) patches the model it loads
                                 for the transformers engine, before --adapters wrap it; with liger_rolling_cache
                                 every generate call of the engine then runs on a fresh RollingKVCache.
* swift.pipelines.train.sft  -> SwiftSft.train attaches the per-step metrics and the runtime record (runtime.py) to
                                 the trainer; TrainerFactory.get_trainer_cls hands dpo/orpo/cpo/simpo/kto/grpo runs the
                                 same trainer with its log-prob seam on hidden states (preference.py).

A missing ms-swift attribute is an ImportError naming it: silently skipping would hand `--use_liger` back to
ms-swift's `--use_liger_kernel` prefix match. SWIFT_LIGER_DISABLE_HOOK=1 turns all of this off.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import warnings
import weakref
from typing import Optional

from ..cache.settings import check_settings
from . import attention
from .arguments import (FIELD_NAMES, check_argv, check_model, finalize, inject_fields, preference_fused, resolved,
                        validate, weighted_sft)
from .record import records, write_record

SUPPORTED_SWIFT = "4.6."
SIDE_ROLES = ("ref", "reward", "teacher")

_patched = weakref.WeakSet()  # models already patched here (PPO value model, repeated prepare calls)
_side_role = [None, False]  # [role of the model _prepare_single_model is building, patched yet]


def _require(obj, attr, where):
    if not hasattr(obj, attr):
        raise ImportError(
            f"swift_liger: ms-swift {_swift_version()} has no {where}.{attr}; swift_liger supports ms-swift "
            f"{SUPPORTED_SWIFT}x. Install a supported ms-swift, or set SWIFT_LIGER_DISABLE_HOOK=1 to run without "
            "the plugin.")
    return getattr(obj, attr)


def _classmethod_func(cls, name, where):
    raw = cls.__dict__.get(name)
    if not isinstance(raw, classmethod):
        raise ImportError(f"swift_liger: {where}.{name} is not a classmethod; unsupported ms-swift "
                          f"{_swift_version()} (set SWIFT_LIGER_DISABLE_HOOK=1 to bypass)")
    return raw.__func__


def _swift_version():
    try:
        from swift.version import __version__
        return __version__
    except Exception:
        return "?"


def _check_version():
    version = _swift_version()
    if not version.startswith(SUPPORTED_SWIFT):
        warnings.warn(f"swift_liger is tested with ms-swift {SUPPORTED_SWIFT}x, found {version}", stacklevel=3)


def _logger():
    from swift.utils import get_logger
    return get_logger()


def _is_master():
    from swift.utils import is_master
    return is_master()


# ---------------------------------------------------------------------------------------------------------------
# swift.arguments.sft_args
# ---------------------------------------------------------------------------------------------------------------

def patch_sft_args(module) -> None:
    _check_version()
    cls = _require(module, "SftArguments", "swift.arguments.sft_args")
    inject_fields(cls)
    orig = _require(cls, "_check_padding_free", "swift.arguments.sft_args.SftArguments")
    if getattr(orig, "_swift_liger", False):
        return

    @functools.wraps(orig)
    def _check_padding_free(self):
        attention.check_padding_free(self, orig, log=_log_info_on_master)

    _check_padding_free._swift_liger = True
    cls._check_padding_free = _check_padding_free   # RLHFArguments' override calls it first (super())


def _log_info_on_master(message: str) -> None:
    if _is_master():
        _logger().info(message)


def patch_model_utils(module) -> None:
    """AttnImpl.update_attn_impl writes --attn_impl into the config of every model ms-swift loads (ModelLoader, before
    from_pretrained): the swift_liger implementation is registered with transformers there."""
    cls = _require(module, "AttnImpl", "swift.model.utils")
    raw = cls.__dict__.get("update_attn_impl")
    if not isinstance(raw, staticmethod):
        raise ImportError(f"swift_liger: swift.model.utils.AttnImpl.update_attn_impl is not a staticmethod; "
                          f"unsupported ms-swift {_swift_version()} (set SWIFT_LIGER_DISABLE_HOOK=1 to bypass)")
    orig = raw.__func__

    @functools.wraps(orig)
    def update_attn_impl(config, attn_impl, *a, **kw):
        attention.register_if_requested(attn_impl)
        return orig(config, attn_impl, *a, **kw)

    cls.update_attn_impl = staticmethod(update_attn_impl)


def patch_pipeline_base(module) -> None:
    orig = _require(module, "parse_args", "swift.pipelines.base")

    @functools.wraps(orig)
    def parse_args(class_type, argv=None):
        ray_args = os.environ.get("RAY_SWIFT_ARGS")   # ms-swift's parse_args reads its argv from there first
        tokens = json.loads(ray_args) if ray_args else sys.argv[1:] if argv is None else argv
        if {"-h", "--help"} & set(tokens) and "use_liger" in getattr(class_type, "__dataclass_fields__", {}):
            print_help(class_type, FIELD_NAMES)
        try:
            check_argv(class_type, tokens)
            return orig(class_type, argv)
        except ValueError as e:
            # Our refusals of the command line (they all start "swift_liger"): the message alone, as argparse
            # reports a bad flag, not a traceback through ms-swift's parser. Arguments handed in from Python raise.
            if argv is None and not ray_args and str(e).startswith("swift_liger"):
                sys.stderr.write(f"error: {e}\n")
                sys.exit(2)
            raise

    module.parse_args = parse_args


def print_help(class_type, ours) -> None:
    """The arguments' help with ours in it, then exit. Our optional flags default to None ("from the preset"); their
    help states the value that means, so argparse's "(default: None)" is left off them."""
    import argparse

    from transformers import HfArgumentParser
    parser = HfArgumentParser([class_type])
    for action in parser._actions:
        if action.dest in ours:
            action.default = argparse.SUPPRESS   # printing only: the parser is dropped right after
    parser.print_help()
    sys.exit(0)


HELP_SCRIPTS = {"sft.py": "SftArguments", "pt.py": "PretrainArguments", "rlhf.py": "RLHFArguments"}


def patch_cli_utils(module) -> None:
    """`swift sft --help` runs swift/cli/sft.py, whose unsloth pre-parser prints a help of one flag and exits; when
    that script is the one starting, with -h/--help, print the full help (ms-swift's and ours) instead."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    cli_dir = os.path.join("swift", "cli") + os.sep
    name = os.path.basename(script)
    if name not in HELP_SCRIPTS or cli_dir not in script or not {"-h", "--help"} & set(sys.argv[1:]):
        return
    import swift.arguments

    print_help(getattr(swift.arguments, HELP_SCRIPTS[name]), FIELD_NAMES)


MEGATRON_REFUSAL = ("swift_liger: --use_liger / --liger_* do not apply to `megatron {cmd}`: Megatron-Core builds "
                    "its own model, not the Hugging Face modules swift_liger patches. Supported: `swift sft|pt|rlhf "
                    "--use_liger` (tested on one GPU and with DDP or --fsdp fsdp2 on CPU ranks; DeepSpeed has not been "
                    "run), and `swift infer|deploy --infer_backend transformers --use_liger`.")


def _liger_requested(tokens) -> bool:
    """--use_liger (not followed by false) or any --liger_* flag in argv, or use_liger / liger_* keys in a YAML
    config given as the first argument."""
    for i, tok in enumerate(tokens):
        key = tok.split("=", 1)[0]
        if key.startswith("--liger_"):
            return True
        if key == "--use_liger":
            value = tok.split("=", 1)[1] if "=" in tok else (tokens[i + 1] if i + 1 < len(tokens) else "true")
            if value.startswith("--") or value.strip().lower() not in ("false", "0", "no", "off"):
                return True
    if tokens and tokens[0].endswith((".yaml", ".yml")) and os.path.exists(tokens[0]):
        try:
            import yaml
            with open(tokens[0]) as f:
                cfg = yaml.safe_load(f) or {}
        except Exception:
            return False
        if isinstance(cfg, dict):
            return bool(cfg.get("use_liger")) or any(str(k).startswith("liger_") for k in cfg)
    return False


def patch_megatron_cli(module) -> None:
    """`megatron sft|pt|rlhf|export --use_liger`: a clear refusal before anything starts (ms-swift would otherwise
    fail later with an unused-argument error, or train unpatched)."""
    orig = _require(module, "cli_main", "swift.cli._megatron.main")

    @functools.wraps(orig)
    def cli_main(*a, **kw):
        if _liger_requested(sys.argv[2:]):
            cmd = sys.argv[1] if len(sys.argv) > 1 else "..."
            sys.exit(MEGATRON_REFUSAL.format(cmd=cmd))
        return orig(*a, **kw)

    module.cli_main = cli_main


# ---------------------------------------------------------------------------------------------------------------
# Patching one model
# ---------------------------------------------------------------------------------------------------------------

def _config_for(args, role):
    res = resolved(args)
    if res is None:  # args built without __post_init__ (e.g. copied); resolve now, same rules
        validate(args)
        finalize(args)
        res = resolved(args)
    cfg, notes = res
    if role in SIDE_ROLES and cfg.fp8_base is True:   # no LoRA trains on a side model; "all" stores its linears
        cfg = dataclasses.replace(cfg, fp8_base=False)
    if role == "ref" and preference_fused(args, cfg):
        notes = [n for n in notes if not n.startswith("cross_entropy")]
        notes.append("ref model: cross_entropy=fused_linear for the reference log-probs from hidden states")
    elif role == "teacher" and getattr(args, "rlhf_type", None) in ("gkd", "grpo") and preference_fused(args, cfg):
        notes = [n for n in notes if not n.startswith("cross_entropy")]
        what = "GKD's divergence" if args.rlhf_type == "gkd" else "GRPO's teacher log-probs (OPD-RL)"
        notes.append(f"teacher model: cross_entropy=fused_linear for {what} from its hidden states")
    elif role in SIDE_ROLES and cfg.cross_entropy != "off":
        cfg = dataclasses.replace(cfg, cross_entropy="off")
        notes = [n for n in notes if not n.startswith("cross_entropy")]  # the policy's fallback is not theirs
        notes.append(f"{role} model: cross_entropy off (its loss is never computed)")
    return cfg, notes


def _report_dict(report):
    to_dict = getattr(report, "to_dict", None)
    return to_dict() if callable(to_dict) else {"report": str(report)}


def patch_model(args, model, role: str):
    """Apply swift_liger to one loaded model; record and log what changed. Returns the PatchReport (or None)."""
    if model is None or model in _patched:
        return None
    from ..patcher import apply   # lazy: torch and the kernels load when a model is patched, not with the arguments
    cfg, notes = _config_for(args, role)
    report = apply(model, cfg)
    _patched.add(model)
    ranks = _gather_ranks(report)
    master = _is_master()
    if master:
        logger = _logger()
        for note in notes:
            logger.info(f"swift_liger: {note}")
        same = all(r["model_class"] == ranks[0]["model_class"] and r["patched"] == ranks[0]["patched"] for r in ranks)
        where = f" (the same on all {len(ranks)} ranks)" if len(ranks) > 1 and same else ""
        if report.supported:
            logger.info(f"swift_liger: patched the {role} model{where}:\n{report}")
        else:
            verb = "runs" if role == "inference" else "trains"
            logger.warning(f"swift_liger: the {role} model {verb} unpatched:\n{report}")
        if not same:
            logger.warning(f"swift_liger: the ranks patched the {role} model differently: {ranks}")
        head_note = _lm_head_note(args, role, report)
        if head_note:
            logger.info(f"swift_liger: {head_note}")
        _save_record(args, role, cfg, notes, report, ranks)
    return report


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def fp8_bases(args, model, role: str = "policy") -> None:
    """With liger_fp8_base: store the frozen bases under the tuner's LoRA layers in FP8 (patching/fp8.py; "all": every
    frozen linear of the attention and MLP modules, and a side model's once ms-swift has frozen it) and log how many,
    the device bytes before and after, and which stayed 16-bit and why."""
    if model is None or resolved(args) is None:
        return
    cfg, _ = _config_for(args, role)
    if not cfg.fp8_base:
        return
    from ..patching.fp8 import quantize_lora_bases   # lazy: needs torch
    from ..patching.state import is_patched   # lazy: needs torch
    logger = _logger()
    if not is_patched(model):   # an unsupported model type trains unpatched (warned when it was patched)
        if _is_master():
            logger.warning(f"swift_liger: fp8_base: the {role} model is not patched, so nothing is stored in FP8")
        return
    record = quantize_lora_bases(model)
    if not _is_master():
        return
    kept = "; ".join(f"{n} kept 16-bit: {why}" for why, n in record["kept_16bit"].items())
    what = "LoRA base weights" if cfg.fp8_base is True else "frozen linear weights"
    line = (f"swift_liger: fp8_base: the {role} model's {record['fp8_weights']} {what} in FP8 e4m3 "
            f"({_size(record['bytes_16bit'])} -> {_size(record['bytes_fp8'])} on the device; the 16-bit weights "
            "wait in host memory)" + (f"; {kept}" if kept else ""))
    if record["fp8_weights"]:
        logger.info(line)
    else:
        logger.warning(line + " -- nothing was stored in FP8")


def _lm_head_adapted(args) -> Optional[str]:
    """The flag that makes the tuner wrap lm_head (so the fused loss head stands aside), if any."""
    for flag in ("modules_to_save", "target_modules"):
        value = getattr(args, flag, None) or []
        if "lm_head" in ([value] if isinstance(value, str) else list(value)):
            return flag
    return None


def _lm_head_note(args, role, report) -> Optional[str]:
    """What the fused loss head means for this run's logs, said only when it applies."""
    if role != "policy" or report.cross_entropy_mode != "fused_linear" or not report.patched.get("cross_entropy"):
        return None
    flag = _lm_head_adapted(args)
    if flag:
        return (f"--{flag} covers lm_head, so the tuner wraps it and the fused linear loss head stands aside: the "
                "model materialises logits as without swift_liger (the first-step log counts it)")
    if getattr(args, "rlhf_type", None):
        return None
    return ("cross_entropy=fused_linear computes the loss from hidden states, so the model returns no logits in "
            "training; ms-swift's token_acc comes from the fused head's arg max of each position (same pass); "
            "--liger_config keep_logits keeps the logits")


def _gather_ranks(report):
    """What each rank patched, as a list indexed by rank (one entry when not distributed).

    Under torchrun every rank loads and patches its own copy of the model, but only rank 0 logs and writes
    liger_patch.json; gathering the per-rank summaries there makes "every rank patched the same modules" visible in
    one log line and one record. ms-swift calls prepare_model (and rlhf's side-model set-up) on every rank, after the
    process group is up, so this collective is matched on all ranks; a rank that fails before it ends the torchrun job.
    """
    info = _report_dict(report)
    mine = {"model_class": info.get("model_class"), "patched": info.get("patched")}
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        distributed = False
    if not distributed:
        return [{"rank": 0, **mine}]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), **mine})
    return ranks


def _save_record(args, role, cfg, notes, report, ranks):
    output_dir = getattr(args, "output_dir", None)
    if not output_dir:
        return
    record = records.get(output_dir)
    if record is None:
        from .. import __version__   # lazy: read only when the first record is written
        record = records[output_dir] = {
            "swift_liger": __version__,
            "ms_swift": _swift_version(),
            "backend": {k: os.environ.get(k) for k in ("SWIFT_LIGER_BACKEND", "TRITON_INTERPRET")},
            "world_size": len(ranks),
            "models": {},
        }
    record["models"][role] = {"config": cfg.to_dict(), "notes": notes, "report": _report_dict(report), "ranks": ranks}
    if role == "policy":
        record["config"], record["notes"] = cfg.to_dict(), notes
    write_record(output_dir, record)


# ---------------------------------------------------------------------------------------------------------------
# swift.pipelines.train.tuner
# ---------------------------------------------------------------------------------------------------------------

def patch_tuner(module) -> None:
    mixin = _require(module, "TunerMixin", "swift.pipelines.train.tuner")
    orig = _classmethod_func(mixin, "prepare_model", "swift.pipelines.train.tuner.TunerMixin")

    @functools.wraps(orig)
    def prepare_model(cls, args, model, *a, **kw):
        role = None
        if getattr(args, "use_liger", False):
            task_type = kw.get("task_type")
            role = "value" if getattr(args, "rlhf_type", None) and task_type == "seq_cls" else "policy"
            patch_model(args, model, role)  # before LoRA & co. wrap the model
        wrapped = orig(cls, args, model, *a, **kw)
        if role == "policy":
            fp8_bases(args, wrapped)        # after LoRA: the frozen bases under its adapters
        return wrapped

    mixin.prepare_model = classmethod(prepare_model)


# ---------------------------------------------------------------------------------------------------------------
# swift.pipelines.train.rlhf
# ---------------------------------------------------------------------------------------------------------------

def patch_rlhf_pipeline(module) -> None:
    rlhf_cls = _require(module, "SwiftRLHF", "swift.pipelines.train.rlhf")
    orig_single = _require(rlhf_cls, "_prepare_single_model", "swift.pipelines.train.rlhf.SwiftRLHF")
    orig_adapter = _require(module, "prepare_adapter", "swift.pipelines.train.rlhf")

    @functools.wraps(orig_single)
    def _prepare_single_model(self, key, origin_key, *a, **kw):
        role = origin_key or key
        _side_role[:] = [role, False]
        try:
            result = orig_single(self, key, origin_key, *a, **kw)
            done = _side_role[1]
        finally:
            _side_role[:] = [None, False]
        if result is not None and not done and role in SIDE_ROLES and getattr(self.args, "use_liger", False):
            patch_model(self.args, result[0], role)  # only if prepare_adapter below was not reached
        if result is not None and role in SIDE_ROLES and getattr(self.args, "use_liger", False):
            fp8_bases(self.args, result[0], role)   # liger_fp8_base all: the side model, frozen by now
        return result

    @functools.wraps(orig_adapter)
    def prepare_adapter(args, model, *a, **kw):
        role = _side_role[0]
        if role in SIDE_ROLES and getattr(args, "use_liger", False):
            patch_model(args, model, role)  # before the side model's adapters wrap it
            _side_role[1] = True
        return orig_adapter(args, model, *a, **kw)

    rlhf_cls._prepare_single_model = _prepare_single_model
    module.prepare_adapter = prepare_adapter  # the name rlhf.py's _prepare_single_model looks up


# ---------------------------------------------------------------------------------------------------------------
# swift.pipelines.train.sft
# ---------------------------------------------------------------------------------------------------------------

def patch_sft_pipeline(module) -> None:
    sft_cls = _require(module, "SwiftSft", "swift.pipelines.train.sft")
    orig_train = _require(sft_cls, "train", "swift.pipelines.train.sft.SwiftSft")
    factory = _require(module, "TrainerFactory", "swift.pipelines.train.sft")
    orig_get = _classmethod_func(factory, "get_trainer_cls", "swift.trainers.TrainerFactory")

    @functools.wraps(orig_get)
    def get_trainer_cls(cls, args, *a, **kw):
        trainer_cls = orig_get(cls, args, *a, **kw)
        if getattr(args, "use_liger", False):
            cfg = _config_for(args, "policy")[0]
            if preference_fused(args, cfg):
                from .preference import SEAMS, trainer_class   # lazy: the seams import torch; rlhf only
                if trainer_cls.__name__ not in SEAMS:
                    raise RuntimeError(f"swift_liger: rlhf_type={args.rlhf_type} runs {trainer_cls.__name__}, which "
                                       f"has no log-prob seam here (known: {', '.join(SEAMS)})")
                trainer_cls = trainer_class(trainer_cls)
            elif cfg.cross_entropy == "fused_linear" and not getattr(args, "rlhf_type", None):
                # SFTSeam: weighted losses and label smoothing from hidden states, token_acc from the head's arg max
                from . import preference   # lazy: the seams import torch
                weighted = weighted_sft(args)
                if trainer_cls.__name__ == "Seq2SeqTrainer":
                    preference.install_per_token_loss(sys.modules[trainer_cls.__module__])
                    trainer_cls = preference.trainer_class(trainer_cls)
                elif weighted:
                    raise RuntimeError(f"swift_liger: {', '.join(weighted)} with cross_entropy=fused_linear "
                                       f"needs ms-swift's Seq2SeqTrainer; this run uses {trainer_cls.__name__}")
        return trainer_cls

    factory.get_trainer_cls = classmethod(get_trainer_cls)

    @functools.wraps(orig_train)
    def train(self, trainer):
        args = self.args
        if getattr(args, "liger_metrics", False):   # with or without --use_liger; false means off for both
            from .metrics import attach   # lazy: loads only when --liger_metrics is on
            attach(trainer)
        if getattr(args, "use_liger", False):
            from .runtime import RuntimeRecord   # lazy: imports the patcher (torch), needed once training starts
            trainer.add_callback(RuntimeRecord(trainer, args))
        result = orig_train(self, trainer)
        if getattr(args, "use_liger", False):
            destroy_gloo_group_at_exit()
        return result

    sft_cls.train = train


def destroy_gloo_group_at_exit() -> None:
    """After a training run that returned, destroy a gloo default process group in an `atexit` handler.

    ms-swift never calls `destroy_process_group`. With gloo (`--ddp_backend gloo`, CPU ranks) a rank can then abort
    during interpreter finalization ("terminate called without an active exception", SIGABRT) after every step was
    logged and the run's files were written: a gloo worker thread still holding tensors takes the GIL while Python
    is being torn down (the mechanism described in pytorch/pytorch#179291, a PR that would have registered this
    handler in init_process_group), and torchrun reports the whole run as failed. `atexit` handlers run before
    finalization, so destroying the group there narrows that race; under CPU load one FSDP2 run on 2 ranks still
    hit it. Only after
    `train` returned (every rank is past its last collective) and only for gloo, whose destroy is local to the rank;
    NCCL groups are left to the user."""
    global _gloo_exit_registered
    import torch.distributed as dist
    if _gloo_exit_registered or not (dist.is_available() and dist.is_initialized()):
        return
    if "gloo" not in str(dist.get_backend()) or "nccl" in str(dist.get_backend()):
        return
    import atexit
    atexit.register(_destroy_default_group)
    _gloo_exit_registered = True


_gloo_exit_registered = False


def _destroy_default_group() -> None:
    # No gc.collect() here: collecting the trainer's cycles destroys DDP's Reducer and with it the gloo group while
    # this thread holds the GIL, and a gloo worker freeing a tensor waits for the GIL: a deadlock (seen, DDP).
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# swift.arguments.infer_args, swift.pipelines.infer.infer
# ---------------------------------------------------------------------------------------------------------------

INFER_BACKENDS = ("transformers", "pt")   # `pt`: ms-swift 3.x's name, mapped to transformers in __post_init__
INFER_ROLE = "inference"


def check_infer_backend(args) -> None:
    backend = getattr(args, "infer_backend", None)
    if backend is not None and backend not in INFER_BACKENDS:
        raise ValueError(f"swift_liger: --use_liger patches the PyTorch model of --infer_backend transformers (pt); "
                         f"--infer_backend {backend} runs its own engine, which swift_liger does not patch: use "
                         "--infer_backend transformers, or drop --use_liger")


def patch_infer_args(module) -> None:
    """InferArguments (and DeployArguments, AppArguments, EvalArguments, defined after it) take the same --use_liger /
    --liger_* fields as SftArguments, validated the same way before any model loads; the model-type check, which
    sft runs before creating its run directory, runs at the end of __post_init__ (the model dir is resolved then)."""
    _check_version()
    cls = _require(module, "InferArguments", "swift.arguments.infer_args")
    inject_fields(cls)
    post_init = cls.__post_init__   # inject_fields' wrapper: validate, ms-swift's __post_init__, finalize

    @functools.wraps(post_init)
    def __post_init__(self, *a, **kw):
        if getattr(self, "use_liger", False):
            check_infer_backend(self)
        post_init(self, *a, **kw)
        check_model(self)   # a no-op without --use_liger

    cls.__post_init__ = __post_init__


def _rolling_cache_note(model, report):
    """(level, message) on what the rolling cache does in the transformers engine, or None if it is off.

    ms-swift's TransformersEngine calls template.generate(model, ...) -> model.generate(...) with no past_key_values
    of its own (it only drops the returned one), so the cache install_rolling_cache adds to every call is the one
    used; a generation_config that picks its own cache (cache_implementation, use_cache=False) would keep it, which
    is said here rather than silently ignored."""
    if not getattr(report, "patched", {}).get("rolling_cache"):
        return None
    from ..cache.install import INSTALL_ATTR  # lazy: it needs torch; this module loads without
    settings = (getattr(model, INSTALL_ATTR, None) or {}).get("settings", {})
    gen = getattr(model, "generation_config", None)
    impl, use_cache = getattr(gen, "cache_implementation", None), getattr(gen, "use_cache", True)
    if impl is not None or use_cache is False:
        return "warning", (f"the model's generation_config has cache_implementation={impl!r}, use_cache={use_cache}: "
                           "generate keeps that and does NOT use the RollingKVCache (edit generation_config.json)")
    window, sinks = settings.get("window"), settings.get("sinks")
    if window == "exact":
        graph = ", every decode step a CUDA-graph replay" if settings.get("cuda_graph") else ""
        return "info", ("every generate call of the inference engine runs on a fresh ring of its prompt + max new "
                        f"tokens (nothing evicted: transformers' default attention){graph}; KV storage for all of "
                        "them is allocated when the call starts")
    if window == "model":
        own = getattr(getattr(model, "config", None), "sliding_window", None)
        return "info", ("every generate call of the inference engine runs on a fresh RollingKVCache with the model's "
                        f"own sliding window ({own} tokens) on its sliding layers and the whole history on the "
                        "others: the same attention as the model's own cache, with KV storage of the sliding layers "
                        "fixed at the window")
    if sinks is None:   # RollingKVCache's default, as its settings check completes it
        sinks = check_settings(window, None)["sinks"]
    return "info", (f"every generate call of the inference engine runs on a fresh RollingKVCache(window={window}, "
                    f"sinks={sinks}, mode={settings.get('mode')!r}): KV storage is fixed at {sinks}+{window} tokens "
                    "per layer however long the chat history grows (ms-swift re-sends the whole history each turn; "
                    f"tokens older than the window, past the {sinks} sinks, fall out of attention)")


def patch_infer_pipeline(module) -> None:
    """SwiftInfer.__init__ (also SwiftDeploy's, which `swift app` runs) loads the model for the transformers engine
    through this module's prepare_model_template(args): args.get_model_processor() loads it, prepare_adapter() wraps
    it in --adapters. The model is patched between the two, once, before the engine is built (other backends are
    refused with --use_liger when the arguments are built). merge_lora's own load (--merge_lora) is not patched."""
    _require(module, "SwiftInfer", "swift.pipelines.infer.infer")
    orig = _require(module, "prepare_model_template", "swift.pipelines.infer.infer")

    @functools.wraps(orig)
    def prepare_model_template(args, *a, **kw):
        if not getattr(args, "use_liger", False):
            return orig(args, *a, **kw)
        load = args.get_model_processor   # the bound method of this args object

        @functools.wraps(load)
        def get_model_processor(*ga, **gkw):
            model, processor = load(*ga, **gkw)
            if model is not None:
                report = patch_model(args, model, INFER_ROLE)   # before prepare_adapter wraps it
                note = _rolling_cache_note(model, report) if report is not None else None
                if note is not None and _is_master():
                    getattr(_logger(), note[0])(f"swift_liger: {note[1]}")
            return model, processor

        args.__dict__["get_model_processor"] = get_model_processor   # this call only
        try:
            return orig(args, *a, **kw)
        finally:
            args.__dict__.pop("get_model_processor", None)

    module.prepare_model_template = prepare_model_template

    infer_cls = module.SwiftInfer
    orig_cli = _require(infer_cls, "infer_cli", "swift.pipelines.infer.infer.SwiftInfer")

    @functools.wraps(orig_cli)
    def infer_cli(self, *a, **kw):
        try:
            return orig_cli(self, *a, **kw)
        finally:
            if getattr(self.args, "use_liger", False):
                _join_stream_generate_threads()

    infer_cls.infer_cli = infer_cli


def _join_stream_generate_threads(timeout: float = 60.0) -> None:
    """Wait for the generate threads of TransformersEngine's streaming path before `exit` ends the process.

    _infer_stream runs model.generate in a Thread it never joins, started from the engine's daemon worker thread, so
    it is a daemon too: when the user types `exit` right after the last streamed token, the interpreter can tear down
    while that thread is still inside a forward, and the process aborts ("terminate called without an active
    exception", exit status 250) after every answer was printed. Seen with the patched model in about a third of
    streamed CLI chats on CPU; joining the thread first makes the exit clean."""
    import threading
    current = threading.current_thread()
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if thread is not current and getattr(target, "__name__", "") == "_model_generate":
            thread.join(timeout)
