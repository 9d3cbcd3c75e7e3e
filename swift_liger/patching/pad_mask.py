"""Right-padded batches without a mask tensor (fusion drop_pad_mask): SDPA's causal path instead of a padding mask.

ms-swift pads training rows on the right, so a batch with rows of different lengths reaches each decoder layer with
a [rows, 1, tokens, tokens] bool mask: causal, and no key past a row's last real token. With causal attention the
real tokens never see a key after them, so they compute the same without that mask; only the pad positions' own
outputs change, and every loss ms-swift computes drops those (labels -100, loss and completion masks). Without the
mask SDPA runs its causal kernels (FlashAttention / cuDNN) instead of the masked ones, and graph_layers replays a
padded batch under the same key as an unpadded one of its length, instead of a new key with a mask (whose warm-up
pass and captures made that step 1.0-2.4 s longer at Qwen2.5-0.5B / 1.5B, 4 x 2k, on an H100 and an H200).

    masks = PadMasks(attention_config)         # one per model
    if masks.causal_only(mask, tokens):        # this forward's mask is causal + right padding: call with None
        kwargs["attention_mask"] = None

The mask is read on the GPU once per mask tensor (one host sync; transformers 5.19's SDPA mask building already syncs
twice on a padded batch: masking_utils' fast_all checks) and the verdict cached for the forward's other layers and
the recompute (the same tensor object, unchanged since: its version counter is checked). Anything else keeps its
mask: left padding (generation), packed rows, sliding-window masks, bidirectional image tokens, float masks, KV
caches, inference-mode tensors, attention implementations where no mask means no causal masking (eager), and calls
under torch.compile or a CUDA graph capture.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

BLOCK_ELEMENTS = 1 << 24   # the check compares the mask in blocks of query rows of at most this many elements
CACHED = 4                 # verdicts kept (models with sliding and full layers pass two masks per forward)


def right_padded_causal(mask: torch.Tensor) -> bool:
    """True where the [rows, 1, n, n] bool mask is exactly causal & (key < the row's real length) for a real length
    per row (right padding); one host sync."""
    rows, _, n, _ = mask.shape
    valid = mask[:, 0, -1, :]                                   # keys the last query sees: the row's real tokens
    bad = (valid[:, 1:] & ~valid[:, :-1]).any()                 # a real token after a pad: not right padding
    keys = torch.arange(n, device=mask.device)
    step = max(1, BLOCK_ELEMENTS // max(1, rows * n))
    for q0 in range(0, n, step):
        q = torch.arange(q0, min(n, q0 + step), device=mask.device)
        want = (keys[None, :] <= q[:, None])[None] & valid[:, None, :]
        bad = bad | (mask[:, 0, q0:q0 + step] != want).any()
    return not bool(bad)


class PadMasks:
    """Per model: which mask tensors were causal + right padding (cached by tensor identity and version)."""

    def __init__(self, config=None):
        self.config = config   # the attention's config: its _attn_implementation is read per call
        self.seen = []         # [(weakref to the mask, its version, verdict)], newest last
        self.stats = {"dropped": 0, "kept": 0}   # per mask tensor checked: replaced by causal attention, or kept

    def applies(self) -> bool:
        return getattr(self.config, "_attn_implementation", None) == "sdpa"

    def causal_only(self, mask, tokens: int, kwargs: Optional[dict] = None) -> bool:
        """True where the layer call can run with attention_mask=None: SDPA, no KV cache, and `mask` a [rows, 1,
        tokens, tokens] bool mask that is causal + right padding."""
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
                and mask.shape[1] == 1 and mask.shape[2] == tokens and mask.shape[3] == tokens and tokens > 1):
            return False
        if kwargs and (kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None):
            return False
        if not self.applies() or torch.compiler.is_compiling() or mask.is_inference():
            return False
        version = mask._version   # every layer and the recompute pass the same tensor: a verdict needs no sync
        for ref, ver, verdict in self.seen:
            if ref() is mask and ver == version:
                return verdict
        if mask.is_cuda and torch.cuda.is_current_stream_capturing():   # no sync inside a capture
            return False
        verdict = right_padded_causal(mask)
        self.stats["dropped" if verdict else "kept"] += 1
        self.seen = [s for s in self.seen if s[0]() is not None][-(CACHED - 1):] + [(weakref.ref(mask), version,
                                                                                     verdict)]
        return verdict
