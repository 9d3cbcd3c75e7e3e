"""FP8 frozen bases under LoRA: after PEFT has wrapped a patched model, each plain LoRA projection's frozen
nn.Linear weight becomes an ops.fp8_linear_op.Fp8Weight (e4m3 rows + fp32 row scales on the GPU; the exact 16-bit
weight moves to host memory, where revert and every read outside the FP8 matmuls find it). With fp8_base "all",
every other frozen nn.Linear child of the patched attention and MLP modules too (a policy with LoRA on some of its
projections; a reference or teacher model, frozen whole).

Which LoRA layers keep a 16-bit base, and why, is `base_problem`'s answer (DoRA and other LoRA variants read the base
weight in their own maths; quantized or non-Linear bases; dims that are not multiples of 16; weights tied to another
module), and on a GPU `size_problem`'s (too small for FP8 to be faster: MIN_SIZE). The LoRA op
(patching/lora.py -> ops.lora_linear) multiplies through FP8 when it meets an Fp8Weight; each converted nn.Linear
gets an instance forward through ops.fp8_linear, so PEFT's own forward (adapters disabled: DPO/KTO/GRPO reference
passes) and plain linears use the same FP8 weight. Revert puts the same Parameter objects
back, their data copied back to the device.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from ..ops import _launch
from ..ops.fp8_linear_op import Fp8Weight, InputGroup, fp8_device_problem, fp8_linear, fp8_weight_problem
from .families import ATTENTION_INPUTS, SPLIT_MLP
from .lora import is_peft_lora_linear
from .state import PatchState, find_states, set_forward

PART = "fp8_base"
EMULATE_ENV = "SWIFT_LIGER_FP8_EMULATE"   # "1": allow FP8 bases on CPU (torch's reference FP8 GEMM; tests only)


# FP8 pays for a weight [out, in] when its GEMMs' saving outweighs quantizing the activations (`in` elements per
# token) and output gradients (`out` per token) and transposing the codes: per token ~in*out*1.1e-15 s saved
# (FP8 ~1200 vs bf16 ~720 TFLOP/s) against ~(in+out)*1e-12 s spent, so in*out/(in+out) must reach ~1000.
# Measured on an H200 (forward + input gradient): [3584, 3584] (1792) ran 1.11x faster than bf16 and
# [18944, 3584] (3014) 1.4x at 8192 tokens; [1536, 1536] (768) ran 2x slower at 2048 tokens (GPU time) and
# [512, 3584] (448) lost in the op benchmark.
MIN_SIZE = 1280

# Projections that read one input tensor, by attribute name under their attention / MLP module: where two or more of
# them are FP8, x is quantized once for all of them (ops.fp8_linear_op.InputGroup).
SHARED_INPUTS = (ATTENTION_INPUTS, (SPLIT_MLP.gate, SPLIT_MLP.up))


def size_problem(out_features: int, in_features: int, device_type: str, min_size: Optional[int] = None):
    """Why a CUDA weight [out, in] stays 16-bit for speed (None: FP8 pays); CPU (emulated FP8) takes every size."""
    min_size = MIN_SIZE if min_size is None else min_size
    size = out_features * in_features / max(1, out_features + in_features)
    if device_type != "cuda" or size >= min_size:
        return None
    return f"too small for FP8 to pay (in*out/(in+out) < {min_size})"


def emulation_allowed() -> bool:
    return os.environ.get(EMULATE_ENV, "") == "1"


def new_part() -> dict:
    """The patch state's record: what became FP8, what stayed 16-bit and why, and the base-forward calls."""
    return {"converted": [], "kept": {}, "seen": set(), "calls": {"fp8_base_calls": 0}, "bytes_16bit": 0,
            "bytes_fp8": 0}


def base_problem(layer: torch.nn.Module) -> Optional[str]:
    """Why this PEFT LoRA layer's base stays 16-bit (None: it becomes FP8)."""
    try:
        base = layer.get_base_layer()
        variants = getattr(layer, "lora_variant", {}) or {}
        dora = any(getattr(layer, "use_dora", {}).values())
    except AttributeError as exc:
        return f"not a PEFT LoRA layer PEFT's API describes ({exc})"
    if dora or variants:
        return "DoRA / LoRA variant (its maths reads the base weight)"
    return linear_problem(base)


def linear_problem(base: torch.nn.Module) -> Optional[str]:
    """Why this module's weight stays 16-bit (None: it can be stored in FP8)."""
    if type(base) is not torch.nn.Linear:
        return f"base is {type(base).__name__}, not torch.nn.Linear"
    weight = base._parameters.get("weight")
    if isinstance(weight, Fp8Weight):
        return None
    problem = fp8_weight_problem(weight)
    if problem:
        return problem
    if base.bias is not None and base.bias.requires_grad:
        return "the bias trains"
    device = fp8_device_problem(weight.device)
    if device:
        return device
    if weight.device.type == "cpu" and not emulation_allowed():
        return f"weight is on the CPU (FP8 GEMMs need an sm_89+ GPU; {EMULATE_ENV}=1 emulates them, for tests)"
    return None


def _fp8_base_forward(self, x, *args, **kwargs):
    """nn.Linear.forward of an FP8 base: PEFT calls it with adapters disabled, or for a layer it runs itself."""
    weight = self._parameters.get("weight")
    if args or kwargs or not isinstance(weight, Fp8Weight):
        return type(self).forward(self, x, *args, **kwargs)
    calls = self.__dict__.get("_swift_liger_fp8_calls")
    if calls is not None and not _launch.compiling_ahead():   # the compile-ahead pass is not a training call
        calls["fp8_base_calls"] += 1
    return fp8_linear(x, weight, self.bias)


def _restore(part: dict) -> None:
    for base, param in reversed(part["converted"]):
        fp8 = base._parameters.get("weight")
        if isinstance(fp8, Fp8Weight):
            param.data = fp8.original.to(fp8.device)   # the loaded values, back on the device
        base._parameters["weight"] = param
    part["converted"].clear()


def register(st: PatchState, owners=()) -> dict:
    """At patch time: the record quantize_lora_bases fills later, the attention and MLP modules whose frozen linears
    "all" converts, and its undo (so revert restores the weights)."""
    part = st.parts.setdefault(PART, new_part())
    part["owners"] = list(owners)
    st.on_restore(_restore, part)
    return part


def quantize_lora_bases(model: torch.nn.Module, min_size: Optional[int] = None) -> Dict[str, object]:
    """Store the frozen base of every plain LoRA projection of `model` (patched by swift_liger.apply with
    fp8_base=True or "all", then wrapped by PEFT) in FP8; with "all", every other frozen nn.Linear child of the
    patched attention and MLP modules too. On a GPU, weights with in*out/(in+out) below `min_size` (default
    MIN_SIZE: where FP8 ran slower than bf16) stay 16-bit; min_size=0 converts every eligible weight. Idempotent.
    Returns the record: weights converted, weights kept 16-bit by reason, their device bytes in 16 bits and in FP8.
    Raises ValueError when the model was not patched with fp8_base."""
    states = [st for _, st in find_states(model) if getattr(st.config, "fp8_base", False)]
    if not states:
        raise ValueError("quantize_lora_bases needs a model patched with swift_liger.apply(model, fp8_base=True) "
                         "before PEFT wrapped it")
    st = states[0]
    part = st.parts.get(PART) or register(st)
    counts: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    tied = {pid for pid, n in counts.items() if n > 1}   # e.g. lm_head tied to the embedding
    for module in model.modules():
        if is_peft_lora_linear(module):
            base = module.get_base_layer()
            _decide(st, part, base, base_problem(module) or _size(base, min_size), tied, "LoRA base")
    if st.config.fp8_base == "all":
        for owner in part.get("owners", ()):
            for child in owner.children():
                if type(child) is torch.nn.Linear:
                    _decide(st, part, child, linear_problem(child) or _size(child, min_size), tied,
                            "frozen linear")
    st.report.patched[PART] = len(part["converted"])
    _group_inputs(part)
    _ddp_ignore(model, part, st)
    return summary(part)


def _size(base: torch.nn.Module, min_size: Optional[int]) -> Optional[str]:
    weight = base.weight
    if isinstance(weight, Fp8Weight):
        return None
    return size_problem(weight.shape[0], weight.shape[1], weight.device.type, min_size)


def _decide(st: PatchState, part: dict, base: torch.nn.Module, reason: Optional[str], tied: set, what: str) -> None:
    """Convert `base` (once), or count why it stays 16-bit."""
    seen = part.setdefault("seen", set())              # ids of the modules already decided
    if id(base) in seen:
        return
    seen.add(id(base))
    if not reason and id(base._parameters["weight"]) in tied:
        reason = "weight tied to another module (the embedding reads it as 16-bit)"
    if reason:
        part["kept"][reason] = part["kept"].get(reason, 0) + 1
        st.report.skip(PART, f"{what} kept 16-bit: {reason}")
        return
    param = base._parameters["weight"]
    fp8 = torch.nn.Parameter(Fp8Weight.quantize(param.data), requires_grad=False)
    part["bytes_16bit"] += param.numel() * param.element_size()
    part["bytes_fp8"] += fp8.nbytes_on_device()
    base._parameters["weight"] = fp8
    param.data = fp8.original                          # the device copy is freed; revert copies it back
    part["converted"].append((base, param))
    st.set(base, "_swift_liger_fp8_calls", part["calls"])
    set_forward(st, base, _fp8_base_forward)


def _fp8_weight_of(module) -> Optional[Fp8Weight]:
    """The Fp8Weight of a converted nn.Linear or of a PEFT LoRA layer's base; None for anything else."""
    base = module.get_base_layer() if is_peft_lora_linear(module) else module
    weight = base._parameters.get("weight") if isinstance(base, torch.nn.Module) else None
    return weight if isinstance(weight, Fp8Weight) else None


def _group_inputs(part: dict) -> None:
    """Give the FP8 weights of each SHARED_INPUTS set under one attention / MLP module a common InputGroup (two or
    more of them; one alone gets none)."""
    for owner in part.get("owners", ()):
        for names in SHARED_INPUTS:
            weights = [w for w in (_fp8_weight_of(getattr(owner, n, None)) for n in names) if w is not None]
            group = InputGroup(len(weights)) if len(weights) > 1 else None
            for w in weights:
                w.input_group = group


def _ddp_ignore(model: torch.nn.Module, part: dict, st: PatchState) -> None:
    """DistributedDataParallel broadcasts every parameter from rank 0 when it wraps the model (a write into each
    Fp8Weight, which refuses it). The FP8 bases are frozen and quantized the same on every rank from the same
    checkpoint, so they are left out of DDP's sync by their names under `model` (the module DDP will wrap)."""
    converted = {id(base) for base, _ in part["converted"]}
    names = [f"{name}.weight" if name else "weight" for name, module in model.named_modules()
             if id(module) in converted]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    st.set(model, "_ddp_params_and_buffers_to_ignore", ignored + [n for n in names if n not in ignored])


def summary(part: Optional[dict]) -> Dict[str, object]:
    part = part or new_part()
    return {"fp8_weights": len(part["converted"]), "kept_16bit": dict(part["kept"]),
            "bytes_16bit": part["bytes_16bit"], "bytes_fp8": part["bytes_fp8"]}
