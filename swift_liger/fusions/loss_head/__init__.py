"""The causal-LM loss head: ``fused_linear`` (loss from hidden states, logits never materialised), ``fused`` (Triton
CE on the logits) or ``off``.

fused_linear: in training with labels the CausalLM forward wrapper raises a flag on the lm_head instance, the
patched lm_head forward then returns its input hidden states, and our ``loss_function`` (called by the unchanged HF
forward with ``logits=<those hidden states>``) runs the fused linear cross-entropy against the lm_head weight
(through ``sharding.lm_head_cross_entropy``, which gathers a ZeRO-3 / FSDP2-sharded head). The returned output has
``logits=None``: training with labels returns the loss only (``keep_logits(model)`` opts out). Eval, or no labels:
logits exactly as before. If lm_head or loss_function is replaced after apply (LoRA on lm_head, a user loss), the
shortcut turns itself off and logits are materialised. The same head path serves preference trainers, which take
log-probs from the hidden states (handle.py, integration/preference.py).

The package: this spec (torch-free), ``state.py`` (HeadState: what the pieces share, and the counters),
``patch.py`` (installs), ``forward.py`` (the installed forwards and loss function), ``handle.py`` (hidden states and
log-probs for trainers, ``keep_logits``), ``sharding.py`` (ZeRO-3 / FSDP2 heads). A new loss adds files here.
"""
from __future__ import annotations

from ..base import Fusion, switch_word
from .state import counters

MODES = ("fused_linear", "fused", "off")


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
    word = switch_word(text) if text else None      # "" stays "" (refused as a mode)
    if word is None and text in ("0", "1"):
        word = text == "1"
    return text if word is None else "fused_linear" if word else "off"


def _patch(ctx) -> None:
    from .patch import patch   # lazy: the spec loads without torch
    patch(ctx)


FUSION = Fusion(key="cross_entropy", default="fused_linear", kind="choice", choices=MODES, off="off",
                help="fused_linear (the loss, or for rlhf dpo/orpo/cpo/simpo/kto/grpo the log-probs, from hidden "
                     "states: no logits), fused (Triton CE on logits) or off.",
                applies_to="the ...ForCausalLM's loss_function, lm_head (nn.Linear) and forward", order=40,
                patch=_patch, normalize=normalize, parse_flag=parse_flag, counters=counters,
                label=lambda count, report: f"cross_entropy={report.cross_entropy_mode}")
