"""Patch one built Hugging Face model instance with swift_liger kernels; revert it.

Only instance attributes change: a patched module gets its own bound ``forward`` (or accelerate's
``_old_forward``), the causal LM gets ``_loss_function`` (the per-instance setter of ``PreTrainedModel``), and the
root module gets one bookkeeping object. Classes, modeling-module globals, parameters and buffers are untouched,
so ``state_dict`` is identical and ``revert`` restores the exact eager model.

RoPE without copying transformers code: the attention forward calls the module-global ``apply_rotary_pos_emb``.
The patched attention instance runs a *new function object* made from the original forward's code object but
with its own globals dict (a copy of the modeling module's namespace where that one name points at our kernel).
The modeling module itself is never modified; decorators around forward are rebuilt around the new function.

Causal-LM loss, ``cross_entropy="fused_linear"``: in training with labels the CausalLM forward wrapper raises a
flag on the lm_head instance, the patched lm_head forward then returns its input hidden states, and our
``loss_function`` (called by the unchanged HF forward with ``logits=<those hidden states>``) runs the fused
linear + cross-entropy kernel against the lm_head weight (through ``sharding.lm_head_cross_entropy``, which
gathers a ZeRO-3 / FSDP2-sharded head). Logits are never materialised and the returned output has
``logits=None``: training with labels returns the loss only (``keep_logits(model)`` opts out). Eval, or no labels:
logits exactly as before. If lm_head or loss_function is replaced after apply (LoRA on lm_head, a user loss), the
shortcut turns itself off and logits are materialised.

Deep copies of a patched model are patched copies (see ``_PatchState.__deepcopy__``). Not supported while
patched: nn.DataParallel replicas and pickling the whole module (``torch.save(model)``); save the state_dict.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import LigerConfig
from .families import ACTIVATIONS, FAMILIES, Family, family_for

logger = logging.getLogger("swift_liger")

STATE_ATTR = "_swift_liger_state"
EMIT_HIDDEN_ATTR = "_swift_liger_emit_hidden"
FUSIONS = ("rms_norm", "rope", "qk_norm_rope", "swiglu", "cross_entropy", "rolling_cache", "compile_layers")


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class PatchReport:
    """What `apply` did to one model. `str(report)` is the one-line summary; `to_dict()` is JSON-serialisable.

    patched:  modules swapped per fusion. `rope` counts every attention whose rotation runs our kernel,
              `qk_norm_rope` those of them that also fuse q_norm/k_norm; `cross_entropy` is 1 when the loss is ours,
              `rolling_cache` 1 when generate() uses RollingKVCache, `compile_layers` the decoder layers that
              will run through torch.compile.
    skipped:  {fusion, reason, count, problem}. problem=False: not applicable here (switched off, no such module,
              activation without a kernel). problem=True: asked for but impossible (unexpected forward structure,
              kernel missing, module already patched by another tool); these warn, and raise under strict=True.
    """
    model_type: Optional[str]
    model_class: str
    supported: bool
    config: Dict[str, Any]
    patched: Dict[str, int] = field(default_factory=lambda: {name: 0 for name in FUSIONS})
    cross_entropy_mode: str = "off"
    activation: Optional[str] = None
    skipped: List[Dict[str, Any]] = field(default_factory=list)
    already_applied: bool = False

    def skip(self, fusion: str, reason: str, *, problem: bool = False) -> None:
        for item in self.skipped:  # one entry per distinct reason, however many layers hit it
            if item["fusion"] == fusion and item["reason"] == reason:
                item["count"] += 1
                return
        self.skipped.append({"fusion": fusion, "reason": reason, "count": 1, "problem": problem})

    @property
    def problems(self) -> List[Dict[str, Any]]:
        return [item for item in self.skipped if item["problem"]]

    @property
    def num_patched(self) -> int:
        return sum(self.patched.values())

    def to_dict(self) -> Dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def summary(self) -> str:
        if not self.supported:
            from .families import FAMILIES
            return (f"swift_liger: {self.model_class} (model_type={self.model_type!r}) is not supported (swift_liger "
                    f"patches {', '.join(sorted(FAMILIES))}); model left unpatched")
        parts = []
        for name in FUSIONS:
            count = self.patched[name]
            if name == "cross_entropy":
                if count:
                    parts.append(f"cross_entropy={self.cross_entropy_mode}")
            elif name == "rolling_cache":
                if count:
                    parts.append("rolling_cache")
            elif name == "compile_layers":
                if count:
                    parts.append(f"torch.compile on {count} decoder layers")
            elif count:
                label = self.activation if name == "swiglu" and self.activation else name
                parts.append(f"{label}x{count}")
        text = f"swift_liger: patched {self.model_class} ({self.model_type}): " + (", ".join(parts) or "nothing")
        if self.skipped:
            text += "; skipped: " + "; ".join(f"{s['fusion']} ({s['reason']})" for s in self.skipped)
        if self.already_applied:
            text += " [already applied]"
        return text

    __str__ = summary


# ---------------------------------------------------------------------------------------------------------------
# Bookkeeping stored on the patched root module
# ---------------------------------------------------------------------------------------------------------------

class _PatchState:
    """Everything `revert` needs. A plain object (not a Module, Parameter or buffer): invisible to state_dict."""

    def __init__(self, config: LigerConfig, report: PatchReport):
        self.config = config
        self.report = report
        self.saved: List[Tuple[Any, str, bool, Any]] = []  # (object, attribute, existed before, previous value)
        self.qk_attention: List[Tuple[torch.nn.Module, str, Callable, dict]] = []  # rebuilt again on deepcopy
        self.compiled: List[torch.nn.Module] = []  # compile_layers: recompiled for the copies on deepcopy
        self.lm_head: Optional[torch.nn.Module] = None
        self.lm_head_name: Optional[str] = None
        self.labels_index: Optional[int] = None
        self.keep_logits = False
        self.rolling_cache: Optional[torch.nn.Module] = None  # model whose generate() got RollingKVCache
        self.ops: Dict[str, Callable] = {}
        self.head_loss: Optional[Callable] = None
        # Counted, not configured: what the loss head really did since apply (or the last reset). Read through
        # call_counts(); the ms-swift integration logs them after the first step and writes them to its record.
        self.calls: Dict[str, int] = dict.fromkeys(LOSS_CALLS, 0)
        self.hidden_mode = False   # models.head.emitting_hidden(): the forward returns hidden states as logits
        self.emitted: Optional[torch.Tensor] = None   # the last hidden states returned that way

    def set(self, obj: Any, name: str, value: Any) -> None:
        d = obj.__dict__
        self.saved.append((obj, name, name in d, d.get(name)))
        d[name] = value  # straight into __dict__: no nn.Module registration, no hooks

    def restore(self) -> None:
        if self.rolling_cache is not None:
            from ..cache import uninstall_rolling_cache
            uninstall_rolling_cache(self.rolling_cache)
            self.rolling_cache = None
        for obj, name, existed, previous in reversed(self.saved):
            if existed:
                obj.__dict__[name] = previous
            else:
                obj.__dict__.pop(name, None)
        self.saved.clear()
        self.qk_attention.clear()
        self.compiled.clear()

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) rebinds bound methods to the copies, but function objects are shared, and the fused
        # qk-norm rope function of an attention closes over *its* attention instance. Modules are copied before
        # this object (it sits after `_modules` in the root's __dict__), so memo maps them: rebuild for the copies.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)  # functions (ops, head_loss) are copied by reference
        for attention, attr, base, spec in new.qk_attention:
            attention.__dict__[attr] = types.MethodType(_build_qk_forward(attention, base, spec), attention)
        for layer in new.compiled:   # the copied entry would still call the original layer
            layer.__dict__["_compiled_call_impl"] = torch.compile(layer._call_impl)
        return new


def _find_states(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, _PatchState]]:
    return [(m, m.__dict__[STATE_ATTR]) for m in model.modules() if STATE_ATTR in m.__dict__]


def get_report(model: torch.nn.Module) -> Optional[PatchReport]:
    """The report of the patch currently applied to `model` (or a module inside it), else None."""
    states = _find_states(model)
    return states[0][1].report if states else None


def is_patched(model: torch.nn.Module) -> bool:
    return bool(_find_states(model))


# What the loss head of a patched causal LM did, counted per call: our fused linear CE and our CE on logits (the
# model's loss_function), fused log-probs for a trainer (models.head), and forwards that returned [.., V] logits
# (eval, generation, trainers that read outputs.logits, an lm_head the tuner wrapped).
LOSS_CALLS = ("fused_linear_cross_entropy", "cross_entropy", "fused_linear_logprobs", "lm_head_logits")


def call_counts(model: torch.nn.Module, reset: bool = False) -> Optional[Dict[str, Any]]:
    """The loss-head call counters of the patched model inside `model` (None when it is not patched), with its
    cross_entropy mode. lm_head_logits is None unless cross_entropy=fused_linear (the only mode whose forward
    wrapper sees every call)."""
    states = _find_states(model)
    if not states:
        return None
    st = states[0][1]
    out: Dict[str, Any] = {"cross_entropy_mode": st.report.cross_entropy_mode, **st.calls}
    if st.lm_head is None:
        out["lm_head_logits"] = None
    if reset:
        st.calls.update(dict.fromkeys(st.calls, 0))
    return out


@contextlib.contextmanager
def keep_logits(model: torch.nn.Module, enabled: bool = True):
    """Inside this block a fused_linear-patched model returns real logits even in training with labels
    (for trainers that read ``outputs.logits``, e.g. to log token accuracy). The loss still uses our kernels."""
    states = [st for _, st in _find_states(model)]
    before = [st.keep_logits for st in states]
    for st in states:
        st.keep_logits = enabled
    try:
        yield
    finally:
        for st, value in zip(states, before):
            st.keep_logits = value


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------

# op -> the swift_liger.ops submodule defining it. Imported from there: a package attribute sharing a submodule's
# name can be the submodule rather than the function, depending on import order.
_OP_MODULES = {
    "rms_norm": "rms_norm",
    "apply_rope": "rope",
    "qk_norm_rope": "qk_norm_rope",
    "swiglu": "swiglu",
    "geglu": "swiglu",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
}


def _load_op(name: str) -> Tuple[Optional[Callable], Optional[str]]:
    try:
        module = importlib.import_module(f"{__package__.rpartition('.')[0]}.ops.{_OP_MODULES[name]}")
        return getattr(module, name), None
    except Exception as exc:  # a missing/broken kernel skips its fusion, not the whole apply
        return None, f"kernel swift_liger.ops.{name} unavailable ({type(exc).__name__}: {exc})"


def _load_head_loss() -> Optional[Callable]:
    # ZeRO-3 / FSDP2-aware fused loss on the (possibly sharded) lm_head; None: use the weight as it is
    try:
        from .sharding import lm_head_cross_entropy
    except ImportError:
        return None
    return lm_head_cross_entropy


def _forward_attr(module: torch.nn.Module) -> str:
    # accelerate hooks (device_map loading) keep the real forward in `_old_forward` and call it from `forward`
    return "_old_forward" if "_old_forward" in module.__dict__ else "forward"


def _foreign_forward(module: torch.nn.Module) -> Optional[str]:
    """Reason not to patch when the instance already carries a forward that is not just its class's."""
    attr = _forward_attr(module)
    current = module.__dict__.get(attr)
    if current is None:
        return None
    if (isinstance(current, types.MethodType) and current.__self__ is module
            and current.__func__ is type(module).forward):
        return None
    return f"{type(module).__name__} already has an instance-level {attr} (patched by another tool)"


def _set_forward(st: _PatchState, module: torch.nn.Module, fn: Callable) -> None:
    st.set(module, _forward_attr(module), types.MethodType(fn, module))


def _resolve_config(config, overrides: Dict[str, Any]) -> LigerConfig:
    if config is None:
        config = LigerConfig()
    elif isinstance(config, Mapping):
        config = LigerConfig.from_dict(config)
    elif not isinstance(config, LigerConfig):
        raise TypeError(f"config must be a LigerConfig, a dict or None, got {type(config).__name__}")
    if overrides:
        unknown = sorted(set(overrides) - set(LigerConfig.field_names()))
        if unknown:
            raise ValueError(f"unknown swift_liger config key(s): {', '.join(unknown)}; "
                             f"known keys: {', '.join(LigerConfig.field_names())}")
        config = dataclasses.replace(config, **overrides)
    return config


# ---------------------------------------------------------------------------------------------------------------
# Per-instance forwards. They reach modules through `self` (bound methods), so deepcopy and PEFT wrapping (which
# replaces Linear children) keep working; the one exception, the fused qk-norm rope, is rebuilt on deepcopy.
# ---------------------------------------------------------------------------------------------------------------

def _make_rms_norm_forward(rms_norm: Callable) -> Callable:
    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")
    return forward


def _identity_forward(self, hidden_states):
    # q_norm/k_norm under fused qk-norm rope: the normalisation happens inside the rope kernel
    return hidden_states


def _is_peft_lora_linear(module) -> bool:
    cls = type(module)
    return cls.__name__ == "Linear" and cls.__module__.startswith("peft.tuners.lora")


def _plain_lora_parts(layer: torch.nn.Module, x: torch.Tensor):
    """(weight, bias, lora_a, lora_b, scaling, dropout) when `layer` is a PEFT LoRA Linear in its plain set-up
    (one active adapter, unmerged, vanilla LoRA, frozen nn.Linear base, no biases or hooks, LoRA branch computing
    in x's dtype, or fp32 adapters on a 16-bit x without autocast), else None: the caller then calls the layer as
    usual."""
    if not _is_peft_lora_linear(layer):
        return None
    try:
        if layer.merged or layer.disable_adapters or getattr(layer, "fan_in_fan_out", False):
            return None
        active = layer.active_adapters
        if len(active) != 1:
            return None
        name = active[0]
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        dropout, scaling = layer.lora_dropout[name], layer.scaling[name]
        if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
            return None
        base = layer.get_base_layer()
    except (AttributeError, KeyError, TypeError):
        return None
    if (type(base) is not torch.nn.Linear or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad)):
        return None
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return None
    if lora_a.bias is not None or lora_b.bias is not None or not isinstance(scaling, (int, float)):
        return None
    if type(dropout) not in (torch.nn.Identity, torch.nn.Dropout):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, base, lora_a, lora_b)):
        return None
    if type(dropout) is torch.nn.Dropout and not 0.0 <= dropout.p < 1.0:
        return None
    from ..ops.lora_linear import _compute_dtype, upcast_applies
    if _compute_dtype(x, base.weight) != x.dtype:
        return None
    if _compute_dtype(x, lora_a.weight) != x.dtype and not (
            x.is_contiguous() and upcast_applies(x, base.weight, lora_a.weight)):
        return None
    return base.weight, base.bias, lora_a.weight, lora_b.weight, scaling, dropout


# Calls of PEFT LoRA projections inside patched modules since the last reset: "fused" through ops.lora_linear,
# "peft" through PEFT's own forward (not the plain set-up, or under torch.compile). Read by the ms-swift
# integration to say after the first step whether lora_fusion took effect.
LORA_CALLS = {"fused": 0, "peft": 0}


def _fused_lora(x: torch.Tensor, parts) -> torch.Tensor:
    from ..ops.lora_linear import LoRALinearFunction, LoRALinearUpcastFunction, upcast_applies
    weight, bias, lora_a, lora_b, scaling, dropout = parts
    LORA_CALLS["fused"] += 1
    p = float(dropout.p) if type(dropout) is torch.nn.Dropout and dropout.training else 0.0
    if upcast_applies(x, weight, lora_a):     # fp32 adapters, no autocast: the LoRA branch runs in fp32
        return LoRALinearUpcastFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling), p)
    if 0.0 < p < 1.0 and x.is_contiguous() and not dropout.inplace:
        return LoRALinearFunction.apply(x, None, weight, bias, lora_a, lora_b, float(scaling), p)
    x_lora = x if type(dropout) is torch.nn.Identity else dropout(x)
    return LoRALinearFunction.apply(x, x_lora, weight, bias, lora_a, lora_b, float(scaling), 0.0)


def _project(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x), through swift_liger.ops.lora_linear when layer is a plain PEFT LoRA Linear. Under torch.compile
    PEFT's forward is traced as it is: the compiler decides what to save."""
    parts = None if torch.compiler.is_compiling() else _plain_lora_parts(layer, x)
    if parts is None:
        if _is_peft_lora_linear(layer) and not torch.compiler.is_compiling():
            LORA_CALLS["peft"] += 1
        return layer(x)
    return _fused_lora(x, parts)


def _lora_projection_forward(self, x, *args, **kwargs):
    """Instance forward of a PEFT LoRA Linear for the length of one patched attention call."""
    parts = None if (args or kwargs) else _plain_lora_parts(self, x)
    if parts is None:
        LORA_CALLS["peft"] += 1
        return type(self).forward(self, x, *args, **kwargs)
    return _fused_lora(x, parts)


_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _with_lora_projections(fn: Callable) -> Callable:
    """Wrap an attention forward so that, during the call, its PEFT LoRA q/k/v/o projections run through
    ops.lora_linear. HF's attention body calls them as modules, so each gets a temporary instance forward, removed
    right after (nothing persists: deepcopy, revert and PEFT see the plain modules). Eager only: under
    torch.compile the body runs unchanged."""
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(self, *args, **kwargs)
        installed = []
        for name in _ATTENTION_PROJECTIONS:
            child = self._modules.get(name)
            if _is_peft_lora_linear(child) and "forward" not in child.__dict__:
                child.__dict__["forward"] = types.MethodType(_lora_projection_forward, child)
                installed.append(child)
        try:
            return fn(self, *args, **kwargs)
        finally:
            for child in installed:
                child.__dict__.pop("forward", None)
    return forward


def _make_mlp_forward(gated_act: Callable, lora_fusion: bool = False) -> Callable:
    if lora_fusion:
        def forward(self, x):
            # PEFT LoRA projections without PEFT's input copies (see ops/lora_linear.py); others as usual.
            gate, up = _project(self.gate_proj, x), _project(self.up_proj, x)
            return _project(self.down_proj, gated_act(gate, up, inplace_backward=True))
        return forward

    def forward(self, x):
        # Children are looked up at call time, so LoRA-wrapped gate/up/down projections are used. gate and up are
        # fresh projection outputs that only the activation reads, so its backward may overwrite them with their
        # gradients: two [tokens, intermediate] buffers fewer at the peak (2 x 224 MiB for Llama-3-8B at 8k).
        return self.down_proj(gated_act(self.gate_proj(x), self.up_proj(x), inplace_backward=True))
    return forward


def _lm_head_forward(self, hidden_states):
    if getattr(self, EMIT_HIDDEN_ATTR, False):
        return hidden_states  # fused_linear step or log-prob pass: the loss applies the weight itself
    return type(self).forward(self, hidden_states)


# --- RoPE: rebuild the attention forward with its own globals ---------------------------------------------------

_ROPE_EXTRA_PARAMS = {"unsqueeze_dim", "position_ids"}


def _rope_extra_params(rope_fn: Callable) -> Tuple[Optional[Tuple[str, ...]], Optional[str]]:
    """Names after (q, k, cos, sin) in the HF rope function, so ours accepts the same calls."""
    try:
        names = list(inspect.signature(rope_fn).parameters)
    except (TypeError, ValueError):
        return None, "cannot read the signature of the rope function"
    extra = tuple(names[4:])
    if len(names) < 4 or set(extra) - _ROPE_EXTRA_PARAMS:
        return None, f"unexpected rope function signature ({', '.join(names)})"
    return extra, None


def _unsqueeze_dim(extra: Tuple[str, ...], args: tuple, kwargs: dict) -> int:
    if not args and not kwargs:
        return 1
    values = dict(zip(extra, args))
    values.update(kwargs)
    return values.get("unsqueeze_dim", 1)


def _make_rope(apply_rope: Callable, extra: Tuple[str, ...]) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        return apply_rope(q, k, cos, sin, unsqueeze_dim=_unsqueeze_dim(extra, args, kwargs))
    return apply_rotary_pos_emb


def _make_qk_rope(attention: torch.nn.Module, qk_norm_rope: Callable, extra: Tuple[str, ...]) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # weights read at call time: never a stale copy (ZeRO-3 keeps these tiny norm weights persistent)
        q_norm, k_norm = attention.q_norm, attention.k_norm
        return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps=q_norm.variance_epsilon,
                            casting="llama", unsqueeze_dim=_unsqueeze_dim(extra, args, kwargs))
    return apply_rotary_pos_emb


def _cell_contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _copy_function(fn: types.FunctionType, new_globals: dict, closure) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    new.__dict__.update(fn.__dict__)
    return new


def _rebuild_with_globals(fn: Callable, overrides: Dict[str, Any],
                          required: Tuple[str, ...]) -> Tuple[Optional[Callable], Optional[str]]:
    """A copy of `fn` whose innermost function resolves `overrides` from its own globals dict.

    Decorator layers (functools.wraps wrappers holding the next function in a closure cell) are rebuilt around
    the new inner function, so they keep working. Returns (None, reason) when the structure is not as expected.
    """
    if not isinstance(fn, types.FunctionType):
        return None, f"forward is a {type(fn).__name__}, not a Python function"
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        missing = [name for name in required if name not in fn.__code__.co_names]
        if missing:
            return None, f"{fn.__qualname__} does not reference {', '.join(missing)}"
        new_globals = dict(fn.__globals__)  # snapshot of the modeling module's namespace; the module is untouched
        new_globals.update(overrides)
        # without __name__, torch.compile guards on this dict itself rather than on the module of that name
        # (whose globals still hold the HF functions)
        new_globals.pop("__name__", None)
        return _copy_function(fn, new_globals, fn.__closure__), None
    new_inner, reason = _rebuild_with_globals(inner, overrides, required)
    if new_inner is None:
        return None, reason
    cells = fn.__closure__ or ()
    hits = [i for i, cell in enumerate(cells) if _cell_contents(cell) is inner]
    if len(hits) != 1:
        return None, f"cannot see through the decorator around {fn.__qualname__}"
    closure = tuple(types.CellType(new_inner) if i == hits[0] else cell for i, cell in enumerate(cells))
    new = _copy_function(fn, fn.__globals__, closure)
    new.__wrapped__ = new_inner
    return new, None


def _innermost(fn: Callable) -> Callable:
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _build_qk_forward(attention: torch.nn.Module, base: Callable, spec: dict) -> Callable:
    rope = _make_qk_rope(attention, spec["op"], spec["extra"])
    new, reason = _rebuild_with_globals(base, {spec["name"]: rope}, spec["required"])
    if new is None:  # checked at apply time; only reachable if the class changed under us
        raise RuntimeError(f"swift_liger: cannot rebuild {type(attention).__name__}.forward: {reason}")
    return _with_lora_projections(new) if spec.get("lora_fusion") else new


# --- Causal LM: forward wrapper + loss function ---------------------------------------------------------------

def _ours(fn: Any, func: Callable) -> bool:
    return getattr(fn, "__func__", None) is func


def _causal_lm_forward(self, *args, **kwargs):
    # Call the class's function with self explicitly: dynamo in torch 2.11 cannot trace `function.__get__`.
    original = type(self).forward
    st = getattr(self, STATE_ATTR, None)
    if st is not None and st.hidden_mode and head_is_ours(self, st):
        # for a trainer that computes log-probs from the hidden states (models.head); any mode, with or without grad
        out = _forward_head_skipped(self, st, original, args, kwargs)
        st.emitted = getattr(out, "logits", None)
        return out
    if st is None:
        return original(self, *args, **kwargs)
    if not _emit_hidden(self, st, args, kwargs):
        out = original(self, *args, **kwargs)
        if getattr(out, "logits", None) is not None:   # whichever module made them (a PEFT copy of lm_head too)
            st.calls["lm_head_logits"] += 1
        return out
    return _drop_logits(_forward_head_skipped(self, st, original, args, kwargs))


def _forward_head_skipped(self, st: _PatchState, original: Callable, args: tuple, kwargs: dict):
    """The unchanged HF forward with the lm_head returning its input: ``logits`` holds the (logits_to_keep-sliced)
    final hidden states."""
    head = st.lm_head
    head.__dict__[EMIT_HIDDEN_ATTR] = True
    try:
        return original(self, *args, **kwargs)
    finally:
        head.__dict__[EMIT_HIDDEN_ATTR] = False


def head_is_ours(self, st: _PatchState) -> bool:
    """The lm_head the patch installed is still the one the model calls. PEFT (LoRA on lm_head, modules_to_save) or
    the user may have replaced it since apply: then hidden-state shortcuts would be wrong."""
    return st.lm_head is not None and self._modules.get(st.lm_head_name) is st.lm_head


def _emit_hidden(self, st: _PatchState, args: tuple, kwargs: dict) -> bool:
    if not self.training or st.keep_logits or st.lm_head is None:
        return False
    labels = kwargs.get("labels")
    if labels is None and st.labels_index is not None and len(args) > st.labels_index:
        labels = args[st.labels_index]
    if labels is None:
        return False
    if not head_is_ours(self, st):   # materialise logits as usual
        return False
    return _ours(self.__dict__.get("_loss_function"), _causal_lm_loss)


def _drop_logits(out):
    """In the fused_linear step `logits` holds hidden states: never hand them out as logits."""
    if isinstance(out, tuple):
        # to_tuple() drops None fields: (loss, logits, ...) with the loss present since labels were given
        if len(out) >= 2 and torch.is_tensor(out[0]) and out[0].dim() == 0:
            return out[:1] + out[2:]
        return out
    if hasattr(out, "logits"):
        fields = {key: value for key, value in out.items() if key != "logits"}
        return type(out)(**fields)
    return out


def _causal_lm_loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                    shift_labels=None, **kwargs):
    """Hugging Face ForCausalLMLoss semantics (label shift, shift_labels, num_items_in_batch) on our kernels."""
    st = self.__dict__[STATE_ATTR]
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n; last position ignored
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    # the kernels take num_items_in_batch with reduction="mean" as HF's sum / num_items_in_batch
    options = dict(ignore_index=ignore_index, reduction="mean", num_items_in_batch=num_items_in_batch)
    head = st.lm_head
    if head is not None and getattr(head, EMIT_HIDDEN_ATTR, False):
        hidden = logits.reshape(-1, logits.shape[-1])
        st.calls["fused_linear_cross_entropy"] += 1
        if st.head_loss is not None:
            return st.head_loss(head, hidden, target, **options)
        return st.ops["fused_linear_cross_entropy"](hidden, head.weight, target, head.bias, **options)
    st.calls["cross_entropy"] += 1
    return st.ops["cross_entropy"](logits.reshape(-1, logits.shape[-1]), target, **options)


# ---------------------------------------------------------------------------------------------------------------
# apply / revert
# ---------------------------------------------------------------------------------------------------------------

def _class_in(module: torch.nn.Module, names: Tuple[str, ...]) -> bool:
    return type(module).__name__ in names


def apply(model: torch.nn.Module, config=None, **overrides) -> PatchReport:
    """Patch this model instance (and nothing else) with swift_liger kernels.

    config: LigerConfig, dict or None (defaults); keyword overrides are LigerConfig fields. Applying the same
    config twice does nothing; a different config reverts first. Apply before wrapping with PEFT: LoRA layers
    inserted afterwards are picked up. Returns a PatchReport (also logged once on logger "swift_liger").
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"swift_liger.apply expects a torch.nn.Module, got {type(model).__name__}")
    config = _resolve_config(config, overrides)
    states = _find_states(model)
    if states:
        _, st = states[0]
        if st.config.to_dict() == config.to_dict():
            report = copy.deepcopy(st.report)
            report.already_applied = True
            return report
        revert(model)

    model_config = getattr(model, "config", None)
    model_type = getattr(model_config, "model_type", None)
    family = family_for(model_type)
    report = PatchReport(model_type=model_type, model_class=type(model).__name__, supported=family is not None,
                         config=config.to_dict())
    if family is None:
        message = (f"swift_liger: model type {model_type!r} ({type(model).__name__}) is not supported (swift_liger "
                   f"patches {', '.join(sorted(FAMILIES))}); the model is left unpatched")
        if config.strict:
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=2)
        return report

    root = next((m for m in model.modules() if _class_in(m, family.causal_lm)), model)
    report.model_class = type(root).__name__
    st = _PatchState(config, report)
    try:
        _patch(root, family, config, st, report)
    except BaseException:
        st.restore()
        raise
    if report.problems:
        message = "swift_liger: " + "; ".join(
            f"{p['fusion']} skipped on {p['count']} module(s): {p['reason']}" for p in report.problems)
        if config.strict:
            st.restore()
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=2)
    if st.saved or st.rolling_cache is not None:
        root.__dict__[STATE_ATTR] = st  # after `_modules` in __dict__ order: deepcopy copies modules first
    logger.info("%s", report.summary())
    return report


def _patch(root: torch.nn.Module, family: Family, config: LigerConfig, st: _PatchState,
           report: PatchReport) -> None:
    modules = list(root.modules())
    consumed = set()  # q_norm/k_norm folded into the fused qk-norm rope

    # --- attention: rope and fused qk-norm rope ---
    attentions = [m for m in modules if _class_in(m, family.attention)]
    if not config.rope:
        report.skip("rope", "switched off")
        if config.qk_norm_rope and family.qk_norm:
            report.skip("qk_norm_rope", "needs rope=True")
    if not family.qk_norm:
        report.skip("qk_norm_rope", f"{family.name} attention has no q_norm/k_norm")
    elif not config.qk_norm_rope:
        report.skip("qk_norm_rope", "switched off")
    if config.rope and not attentions:
        report.skip("rope", f"no {'/'.join(family.attention)} module found", problem=True)
    if config.rope and attentions:
        _patch_attention(attentions, family, config, st, report, consumed)

    # --- RMSNorm ---
    norms = [m for m in modules if _class_in(m, family.rms_norm) and id(m) not in consumed]
    if not config.rms_norm:
        report.skip("rms_norm", "switched off")
    elif norms:
        op, reason = _load_op("rms_norm")
        norm_forward = _make_rms_norm_forward(op) if op is not None else None
        for norm in norms:
            why = reason or _foreign_forward(norm)
            if why is None and not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
                why = f"{type(norm).__name__} has no weight/variance_epsilon"
            if why:
                report.skip("rms_norm", why, problem=True)
                continue
            _set_forward(st, norm, norm_forward)
            report.patched["rms_norm"] += 1

    # --- gated MLP ---
    mlps = [m for m in modules if _class_in(m, family.mlp)]
    if not config.swiglu:
        report.skip("swiglu", "switched off")
    elif mlps:
        _patch_mlps(mlps, root, st, report, config.lora_fusion)

    # --- causal-LM loss ---
    if config.cross_entropy == "off":
        report.skip("cross_entropy", "switched off")
    elif not _class_in(root, family.causal_lm):
        report.skip("cross_entropy", f"{type(root).__name__} is not a {'/'.join(family.causal_lm)}")
    else:
        _patch_loss(root, family, config, st, report)

    if config.rolling_cache is not None:
        _install_rolling_cache(root, config.rolling_cache, st, report)

    if config.compile_layers:
        _compile_layers([m for m in modules if _class_in(m, family.decoder_layer)], family, st, report)


def _compile_layers(layers, family: Family, st: _PatchState, report: PatchReport) -> None:
    """What nn.Module.compile() does (compile the layer's call lazily, in place), recorded so revert undoes it.
    PEFT wraps the layers' Linear children later; dynamo traces whatever children a layer has at its first call."""
    if not layers:
        report.skip("compile_layers", f"no {'/'.join(family.decoder_layer)} module found", problem=True)
        return
    for layer in layers:
        if layer.__dict__.get("_compiled_call_impl") is not None:
            report.skip("compile_layers", f"{type(layer).__name__} is already compiled", problem=True)
            continue
        st.set(layer, "_compiled_call_impl", torch.compile(layer._call_impl))
        st.compiled.append(layer)
        report.patched["compile_layers"] += 1


def _install_rolling_cache(root: torch.nn.Module, settings: dict, st: _PatchState, report: PatchReport) -> None:
    try:
        from ..cache import install_rolling_cache
    except ImportError as exc:
        report.skip("rolling_cache", f"swift_liger.cache unavailable ({exc})", problem=True)
        return
    if "generate" in root.__dict__:
        report.skip("rolling_cache", f"{type(root).__name__} already has an instance-level generate", problem=True)
        return
    try:
        install_rolling_cache(root, **settings)
    except (ValueError, TypeError) as exc:  # unsupported attention / bad window: reported, not fatal unless strict
        report.skip("rolling_cache", str(exc), problem=True)
        return
    st.rolling_cache = root
    report.patched["rolling_cache"] = 1


def _patch_attention(attentions, family: Family, config: LigerConfig, st: _PatchState, report: PatchReport,
                     consumed: set) -> None:
    want_qk = config.qk_norm_rope and family.qk_norm
    apply_rope, rope_reason = _load_op("apply_rope")
    qk_op, qk_reason = _load_op("qk_norm_rope") if want_qk else (None, None)
    name = family.rope_function
    plain_cache: Dict[int, Any] = {}  # one rebuilt forward (and globals dict) per attention class
    for attention in attentions:
        foreign = _foreign_forward(attention)
        if foreign:
            report.skip("rope", foreign, problem=True)
            continue
        base = type(attention).forward
        hf_rope = getattr(_innermost(base), "__globals__", {}).get(name)
        extra, why = _rope_extra_params(hf_rope) if hf_rope is not None else (None, f"{name} not found")
        if why:
            report.skip("rope", f"{type(attention).__name__}: {why}", problem=True)
            continue

        if want_qk:
            qk_why = qk_reason or _qk_norm_problem(attention, family)
            if qk_why is None:
                spec = {"op": qk_op, "extra": extra, "name": name, "required": (name, "q_norm", "k_norm"),
                        "lora_fusion": config.lora_fusion}
                rope = _make_qk_rope(attention, qk_op, extra)
                new, qk_why = _rebuild_with_globals(base, {name: rope}, spec["required"])
                if new is not None:
                    if config.lora_fusion:
                        new = _with_lora_projections(new)
                    attr = _forward_attr(attention)
                    _set_forward(st, attention, new)
                    st.qk_attention.append((attention, attr, base, spec))
                    for norm in (attention.q_norm, attention.k_norm):
                        _set_forward(st, norm, _identity_forward)
                        consumed.add(id(norm))
                    report.patched["rope"] += 1
                    report.patched["qk_norm_rope"] += 1
                    continue
            report.skip("qk_norm_rope", qk_why, problem=True)  # fall through to the plain rope kernel

        if rope_reason:
            report.skip("rope", rope_reason, problem=True)
            continue
        key = id(base)
        if key not in plain_cache:
            plain_cache[key] = _rebuild_with_globals(base, {name: _make_rope(apply_rope, extra)}, (name,))
        new, why = plain_cache[key]
        if new is None:
            report.skip("rope", why, problem=True)
            continue
        _set_forward(st, attention, _with_lora_projections(new) if config.lora_fusion else new)
        report.patched["rope"] += 1


def _qk_norm_problem(attention: torch.nn.Module, family: Family) -> Optional[str]:
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    for label, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is None or not _class_in(norm, family.rms_norm):
            return f"{type(attention).__name__}.{label} is not a {'/'.join(family.rms_norm)}"
        if not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
            return f"{type(attention).__name__}.{label} has no weight/variance_epsilon"
        foreign = _foreign_forward(norm)
        if foreign:
            return foreign
    if q_norm.variance_epsilon != k_norm.variance_epsilon:
        return "q_norm and k_norm use different eps"
    return None


def _patch_mlps(mlps, root: torch.nn.Module, st: _PatchState, report: PatchReport,
                lora_fusion: bool = False) -> None:
    ops_cache: Dict[str, Tuple[Optional[Callable], Optional[str]]] = {}  # kernel -> (MLP forward, reason)
    for mlp in mlps:
        missing = [n for n in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, n)]
        if missing:
            report.skip("swiglu", f"{type(mlp).__name__} has no {', '.join(missing)}", problem=True)
            continue
        mlp_config = getattr(mlp, "config", None)
        hidden_act = getattr(mlp_config if mlp_config is not None else root.config, "hidden_act", None)
        kernel, act_classes = ACTIVATIONS.get(hidden_act, (None, ()))
        if kernel is None:
            report.skip("swiglu", f"activation {hidden_act!r} has no fused gated kernel")
            continue
        if type(mlp.act_fn).__name__ not in act_classes:
            report.skip("swiglu", f"act_fn is {type(mlp.act_fn).__name__}, expected one of "
                                  f"{', '.join(act_classes)} for {hidden_act!r}", problem=True)
            continue
        if kernel not in ops_cache:
            op, why = _load_op(kernel)
            ops_cache[kernel] = (_make_mlp_forward(op, lora_fusion) if op is not None else None), why
        mlp_forward, why = ops_cache[kernel]
        why = why or _foreign_forward(mlp)
        if why:
            report.skip("swiglu", why, problem=True)
            continue
        _set_forward(st, mlp, mlp_forward)
        report.patched["swiglu"] += 1
        report.activation = kernel


def _patch_loss(root: torch.nn.Module, family: Family, config: LigerConfig, st: _PatchState,
                report: PatchReport) -> None:
    ce, why = _load_op("cross_entropy")
    if ce is None:
        report.skip("cross_entropy", why, problem=True)
        return
    st.ops["cross_entropy"] = ce
    mode = config.cross_entropy
    if mode == "fused_linear":
        flce, why = _load_op("fused_linear_cross_entropy")
        head = root._modules.get(family.lm_head)
        labels_index = _labels_index(type(root).forward)
        if why is None and not isinstance(head, torch.nn.Linear):
            why = f"{family.lm_head} is {type(head).__name__}, not nn.Linear"
        if why is None:
            why = _foreign_forward(head) or _foreign_forward(root)
        if why is None and labels_index is None:
            why = f"{type(root).__name__}.forward has no labels argument"
        if why is None:
            st.ops["fused_linear_cross_entropy"] = flce
            st.head_loss = _load_head_loss()
            st.lm_head, st.lm_head_name, st.labels_index = head, family.lm_head, labels_index
            st.set(head, EMIT_HIDDEN_ATTR, False)
            _set_forward(st, head, _lm_head_forward)
            wrapper = functools.update_wrapper(
                types.FunctionType(_causal_lm_forward.__code__, _causal_lm_forward.__globals__,
                                   _causal_lm_forward.__name__),
                type(root).forward)  # __wrapped__ keeps inspect.signature(model.forward) (Trainer columns) intact
            _set_forward(st, root, wrapper)
        else:
            report.skip("cross_entropy", f"fused_linear unavailable, using fused: {why}", problem=True)
            mode = "fused"
    st.set(root, "_loss_function", types.MethodType(_causal_lm_loss, root))
    report.patched["cross_entropy"] = 1
    report.cross_entropy_mode = mode


def _labels_index(forward: Callable) -> Optional[int]:
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if "labels" not in names:
        return None
    return names.index("labels") - 1  # minus self


def revert(model: torch.nn.Module) -> None:
    """Undo `apply` on this model (or on the patched model inside a PEFT wrapper). No-op when not patched."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"swift_liger.revert expects a torch.nn.Module, got {type(model).__name__}")
    for module, st in _find_states(model):
        st.restore()
        module.__dict__.pop(STATE_ATTR, None)
        logger.info("swift_liger: reverted %s", type(module).__name__)
