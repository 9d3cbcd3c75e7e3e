"""The loss head's run-time state on one patched model: one HeadState, kept in PatchState.parts["cross_entropy"].

Torch-free (the spec's counters hook reads it while flags and config load without torch).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

KEY = "cross_entropy"                          # the fusion's key, and its PatchState part
EMIT_HIDDEN_ATTR = "_swift_liger_emit_hidden"  # on the patched lm_head: return the input hidden states this call

# Counted per patched model: our fused linear CE and CE (the model's loss_function), fused log-probs and GKD's fused
# divergence (this model's head as the student's) for a trainer (handle.py), forwards that returned [.., V] logits.
CALLS = ("fused_linear_cross_entropy", "cross_entropy", "fused_linear_logprobs", "fused_linear_jsd", "lm_head_logits")


class HeadState:
    """What the installed forwards, the loss function and the log-prob handle share."""

    def __init__(self, mode: str):
        self.mode = mode                              # fused_linear | fused (what the patch could install)
        self.ops: Dict[str, Callable] = {}            # "cross_entropy", "fused_linear_cross_entropy": the kernels
        self.head_loss: Optional[Callable] = None     # sharding.lm_head_cross_entropy (ZeRO-3 / FSDP2 heads)
        self.lm_head: Any = None                      # fused_linear: the nn.Linear the patch installed on
        self.lm_head_name: Optional[str] = None
        self.labels_index: Optional[int] = None       # the position of `labels` in the root's forward
        self.softcap_attr: Optional[str] = None       # the root config's logit softcap attribute (Gemma-2/3), if any
        self.softcap: Optional[float] = None          # its value while a head-skipped forward runs (the loss reads it)
        self.keep_logits = False                      # keep_logits(): materialise logits in training too
        self.hidden_mode = False                      # handle.emitting_hidden(): hidden states returned as logits
        self.emitted: Any = None                      # the last hidden states returned that way
        self.want_argmax = False                      # handle.predicting(): the loss also keeps each position's arg max
        self.argmax: Any = None                       # [N] int64 predictions of the last fused loss under want_argmax
        self.calls: Dict[str, int] = dict.fromkeys(CALLS, 0)


def counters(head: Optional[HeadState], reset: bool) -> Dict[str, Any]:
    """call_counts' loss-head entries. lm_head_logits is None unless cross_entropy=fused_linear (the only mode
    whose forward wrapper sees every call)."""
    if head is None:
        return {"cross_entropy_mode": "off", **dict.fromkeys(CALLS, 0), "lm_head_logits": None}
    out = {"cross_entropy_mode": head.mode, **head.calls}
    if head.lm_head is None:
        out["lm_head_logits"] = None
    if reset:
        head.calls.update(dict.fromkeys(head.calls, 0))
    return out
