"""The causal-LM loss head: ``fused_linear`` (loss from hidden states, logits never materialised), ``fused`` (Triton
CE on the logits) or ``off``.

fused_linear: in training with labels the CausalLM forward wrapper raises a flag on the lm_head instance, the
patched lm_head forward then returns its input hidden states, and our ``loss_function`` (called by the unchanged HF
forward with ``logits=<those hidden states>``) runs the fused linear cross-entropy against the lm_head weight
(through ``sharding.lm_head_cross_entropy``, which gathers a ZeRO-3 / FSDP2-sharded head). The returned output has
``logits=None``: training with labels returns the loss only (``keep_logits(model)`` opts out). Eval, or no labels:
logits exactly as before. If lm_head or loss_function is replaced after apply (LoRA on lm_head, a user loss), the
shortcut turns itself off and logits are materialised. The same head path serves preference trainers, which take
log-probs from the hidden states (models/head.py, integration/preference.py).
"""
from __future__ import annotations

from typing import Callable, Optional

from .base import STATE_ATTR, Fusion

MODES = ("fused_linear", "fused", "off")
EMIT_HIDDEN_ATTR = "_swift_liger_emit_hidden"


def normalize(value):
    if value is False or value is None:
        return "off"
    if value is True:
        return "fused_linear"
    return value


def parse_flag(value):
    if value is None:
        return None
    text = str(value).strip().lower()
    # YAML 1.1 reads an unquoted `off` as false, which ms-swift then passes on as the string "False".
    if text in ("false", "no", "none", "0", "off"):
        return "off"
    if text in ("true", "yes", "1"):
        return "fused_linear"
    return text


# --- the forwards installed on the instance -------------------------------------------------------------------

def _lm_head_forward(self, hidden_states):
    if getattr(self, EMIT_HIDDEN_ATTR, False):
        return hidden_states  # fused_linear step or log-prob pass: the loss applies the weight itself
    return type(self).forward(self, hidden_states)


def head_is_ours(self, st) -> bool:
    """The lm_head the patch installed is still the one the model calls. PEFT (LoRA on lm_head, modules_to_save) or
    the user may have replaced it since apply: then hidden-state shortcuts would be wrong."""
    return st.lm_head is not None and self._modules.get(st.lm_head_name) is st.lm_head


def _forward_head_skipped(self, st, original: Callable, args: tuple, kwargs: dict):
    """The unchanged HF forward with the lm_head returning its input: ``logits`` holds the (logits_to_keep-sliced)
    final hidden states."""
    head = st.lm_head
    head.__dict__[EMIT_HIDDEN_ATTR] = True
    config = self.config if st.softcap_attr else None
    cap = getattr(config, st.softcap_attr, None) if config is not None else None
    if cap:   # the forward would softcap the hidden states: the loss applies it to the logits instead
        setattr(config, st.softcap_attr, None)
        st.softcap = float(cap)
    try:
        return original(self, *args, **kwargs)
    finally:
        head.__dict__[EMIT_HIDDEN_ATTR] = False
        if cap:
            setattr(config, st.softcap_attr, cap)
            st.softcap = None


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


def _emit_hidden(self, st, args: tuple, kwargs: dict) -> bool:
    if not self.training or st.keep_logits or st.lm_head is None:
        return False
    labels = kwargs.get("labels")
    if labels is None and st.labels_index is not None and len(args) > st.labels_index:
        labels = args[st.labels_index]
    if labels is None:
        return False
    if not head_is_ours(self, st):   # materialise logits as usual
        return False
    return getattr(self.__dict__.get("_loss_function"), "__func__", None) is _causal_lm_loss


def _drop_logits(out):
    """In the fused_linear step `logits` holds hidden states: never hand them out as logits."""
    import torch
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
    import torch.nn.functional as F

    st = self.__dict__[STATE_ATTR]
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n; last position ignored
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    # the kernels take num_items_in_batch with reduction="mean" as HF's sum / num_items_in_batch
    options = dict(ignore_index=ignore_index, reduction="mean", num_items_in_batch=num_items_in_batch)
    head = st.lm_head
    if head is not None and getattr(head, EMIT_HIDDEN_ATTR, False):
        if st.softcap:
            options["softcap"] = st.softcap
        hidden = logits.reshape(-1, logits.shape[-1])
        st.calls["fused_linear_cross_entropy"] += 1
        if st.head_loss is not None:
            return st.head_loss(head, hidden, target, **options)
        return st.ops["fused_linear_cross_entropy"](hidden, head.weight, target, head.bias, **options)
    st.calls["cross_entropy"] += 1
    return st.ops["cross_entropy"](logits.reshape(-1, logits.shape[-1]), target, **options)


def _labels_index(forward: Callable) -> Optional[int]:
    import inspect
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if "labels" not in names:
        return None
    return names.index("labels") - 1  # minus self


def _head_loss() -> Optional[Callable]:
    # ZeRO-3 / FSDP2-aware fused loss on the (possibly sharded) lm_head; None: use the weight as it is
    try:
        from ..models.sharding import lm_head_cross_entropy
    except ImportError:
        return None
    return lm_head_cross_entropy


# --- the patch --------------------------------------------------------------------------------------------------

def patch(ctx) -> None:
    import functools
    import types

    import torch

    from ..models.state import class_in, foreign_forward, load_op, set_forward
    root, family, st, report = ctx.root, ctx.family, ctx.state, ctx.report
    if not class_in(root, family.causal_lm):
        report.skip("cross_entropy", f"{type(root).__name__} is not a {'/'.join(family.causal_lm)}")
        return
    ce, why = load_op("cross_entropy")
    if ce is None:
        report.skip("cross_entropy", why, problem=True)
        return
    st.ops["cross_entropy"] = ce
    mode = ctx.config.cross_entropy
    if mode == "fused_linear":
        flce, why = load_op("fused_linear_cross_entropy")
        head = root._modules.get(family.lm_head)
        labels_index = _labels_index(type(root).forward)
        if why is None and not isinstance(head, torch.nn.Linear):
            why = f"{family.lm_head} is {type(head).__name__}, not nn.Linear"
        if why is None:
            why = foreign_forward(head) or foreign_forward(root)
        if why is None and labels_index is None:
            why = f"{type(root).__name__}.forward has no labels argument"
        if why is None:
            st.ops["fused_linear_cross_entropy"] = flce
            st.head_loss = _head_loss()
            st.lm_head, st.lm_head_name, st.labels_index = head, family.lm_head, labels_index
            st.softcap_attr = family.logit_softcap
            st.set(head, EMIT_HIDDEN_ATTR, False)
            set_forward(st, head, _lm_head_forward)
            wrapper = functools.update_wrapper(
                types.FunctionType(_causal_lm_forward.__code__, _causal_lm_forward.__globals__,
                                   _causal_lm_forward.__name__),
                type(root).forward)  # __wrapped__ keeps inspect.signature(model.forward) (Trainer columns) intact
            set_forward(st, root, wrapper)
        else:
            report.skip("cross_entropy", f"fused_linear unavailable, using fused: {why}", problem=True)
            mode = "fused"
    st.set(root, "_loss_function", types.MethodType(_causal_lm_loss, root))
    report.patched["cross_entropy"] = 1
    report.cross_entropy_mode = mode




FUSION = Fusion(key="cross_entropy", default="fused_linear", kind="choice", choices=MODES, off="off",
                help="fused_linear (the loss, or for rlhf dpo/orpo/cpo/simpo/kto the log-probs, from hidden states: "
                     "no logits), fused (Triton CE on logits) or off.",
                applies_to="the ...ForCausalLM's loss_function, lm_head (nn.Linear) and forward", order=40,
                patch=patch, normalize=normalize, parse_flag=parse_flag)
