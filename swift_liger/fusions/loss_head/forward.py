"""The forwards the loss-head patch installs on one model instance, and its loss function.

    lm_head.forward      returns its input hidden states while EMIT_HIDDEN_ATTR is raised on the instance
    root.forward         the unchanged HF forward; in training with labels (fused_linear) it raises the flag, so
                         ``logits`` holds hidden states and the loss applies the head weight itself
    root._loss_function  Hugging Face ForCausalLMLoss semantics on our kernels
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...patching.state import STATE_ATTR
from .state import EMIT_HIDDEN_ATTR, KEY


def lm_head_forward(self, hidden_states):
    if getattr(self, EMIT_HIDDEN_ATTR, False):
        return hidden_states  # fused_linear step or log-prob pass: the loss applies the weight itself
    return type(self).forward(self, hidden_states)


def head_is_ours(root, head) -> bool:
    """The lm_head the patch installed is still the one the model calls. PEFT (LoRA on lm_head, modules_to_save) or
    the user may have replaced it since apply: then hidden-state shortcuts would be wrong."""
    return head.lm_head is not None and root._modules.get(head.lm_head_name) is head.lm_head


def forward_head_skipped(self, head, original: Callable, args: tuple, kwargs: dict):
    """The unchanged HF forward with the lm_head returning its input: ``logits`` holds the (logits_to_keep-sliced)
    final hidden states."""
    module = head.lm_head
    module.__dict__[EMIT_HIDDEN_ATTR] = True
    config = self.config if head.softcap_attr else None
    cap = getattr(config, head.softcap_attr, None) if config is not None else None
    if cap:   # the forward would softcap the hidden states: the loss applies it to the logits instead
        setattr(config, head.softcap_attr, None)
        head.softcap = float(cap)
    try:
        return original(self, *args, **kwargs)
    finally:
        module.__dict__[EMIT_HIDDEN_ATTR] = False
        if cap:
            setattr(config, head.softcap_attr, cap)
            head.softcap = None


def causal_lm_forward(self, *args, **kwargs):
    # Call the class's function with self explicitly: dynamo in torch 2.11 cannot trace `function.__get__`.
    original = type(self).forward
    st = getattr(self, STATE_ATTR, None)
    head = st.parts.get(KEY) if st is not None else None
    if head is None:
        return original(self, *args, **kwargs)
    if head.hidden_mode and head_is_ours(self, head):
        # for a trainer that computes log-probs from the hidden states (handle.py); any mode, with or without grad
        out = forward_head_skipped(self, head, original, args, kwargs)
        head.emitted = getattr(out, "logits", None)
        return out
    if not _emit_hidden(self, head, args, kwargs):
        out = original(self, *args, **kwargs)
        if getattr(out, "logits", None) is not None:   # whichever module made them (a PEFT copy of lm_head too)
            head.calls["lm_head_logits"] += 1
        return out
    return _drop_logits(forward_head_skipped(self, head, original, args, kwargs))


def _emit_hidden(self, head, args: tuple, kwargs: dict) -> bool:
    if not self.training or head.keep_logits or head.lm_head is None:
        return False
    labels = kwargs.get("labels")
    if labels is None and head.labels_index is not None and len(args) > head.labels_index:
        labels = args[head.labels_index]
    if labels is None:
        return False
    if not head_is_ours(self, head):   # materialise logits as usual
        return False
    return getattr(self.__dict__.get("_loss_function"), "__func__", None) is causal_lm_loss


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


def causal_lm_loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **kwargs):
    """Hugging Face ForCausalLMLoss semantics (label shift, shift_labels, num_items_in_batch) on our kernels."""
    head = self.__dict__[STATE_ATTR].parts[KEY]
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n; last position ignored
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    # the kernels take num_items_in_batch with reduction="mean" as HF's sum / num_items_in_batch
    options = dict(ignore_index=ignore_index, reduction="mean", num_items_in_batch=num_items_in_batch)
    module = head.lm_head
    if module is not None and getattr(module, EMIT_HIDDEN_ATTR, False):
        if head.softcap:
            options["softcap"] = head.softcap
        hidden = logits.reshape(-1, logits.shape[-1])
        head.calls["fused_linear_cross_entropy"] += 1
        if head.want_argmax:   # the predictions a trainer's token accuracy needs, from the same pass
            options["return_argmax"] = True
        if head.head_loss is not None:
            out = head.head_loss(module, hidden, target, **options)
        else:
            out = head.ops["fused_linear_cross_entropy"](hidden, module.weight, target, module.bias, **options)
        if head.want_argmax:
            head.argmax, out = out.argmax, out.loss
        return out
    head.calls["cross_entropy"] += 1
    return head.ops["cross_entropy"](logits.reshape(-1, logits.shape[-1]), target, **options)
