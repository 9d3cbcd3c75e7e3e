"""Log-probs from a patched causal LM's hidden states, for trainers that would otherwise read ``outputs.logits``.

Preference trainers (DPO, ORPO, CPO/SimPO, KTO) call the model without labels and run a log-softmax over the
[rows, V] logits it returns. With a model patched with ``cross_entropy="fused_linear"``:

    handle = head_for(model)                # None when it cannot apply (why_not(model) says why)
    with handle.emitting_hidden():
        out = model(**batch)                # the unchanged HF forward with the lm_head skipped:
    hidden = handle.take(out.logits)        # out.logits holds the final hidden states [B, T, H]
    res = handle.logprobs(hidden, labels, return_logit_sum=True)   # ops.fused_linear_logprobs via the lm_head

``take`` returns None when the model materialised real logits (its lm_head was replaced since apply), so the
caller runs its own code on them; it raises when what the caller hands back cannot be those hidden states, so
hidden states are never mistaken for logits. Every ``logprobs`` call is counted in the model's call counters.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch

from ...patching.state import find_states
from .forward import head_is_ours
from .sharding import lm_head_cross_entropy, lm_head_jsd, lm_head_jsd_topk, lm_head_logprobs
from .state import KEY, HeadState


def _find(model: torch.nn.Module) -> Tuple[Optional[torch.nn.Module], Optional[HeadState], str]:
    for root, st in find_states(model):
        head = st.parts.get(KEY)
        if head is None or head.lm_head is None:
            return None, None, ("the model is not patched with cross_entropy=fused_linear "
                                f"(cross_entropy={st.config.cross_entropy})")
        if not head_is_ours(root, head):
            return None, None, (f"{head.lm_head_name} was replaced after patching (LoRA or modules_to_save on "
                                f"{head.lm_head_name}?), so the model computes its own logits")
        cap = getattr(getattr(root, "config", None), "final_logit_softcapping", None)
        if cap and head.softcap_attr != "final_logit_softcapping":
            return None, None, ("the model softcaps its logits inside forward (final_logit_softcapping), which "
                                "would apply to the hidden states")
        return root, head, ""
    return None, None, "the model is not patched by swift_liger"


def why_not(model: torch.nn.Module) -> str:
    """Why :func:`head_for` returns None for this model ("" when it does not)."""
    return _find(model)[2]


def head_for(model: torch.nn.Module) -> Optional["HeadHandle"]:
    """A handle on the patched lm_head inside `model` (PEFT / DDP / DeepSpeed wrappers are looked through)."""
    root, head, _ = _find(model)
    return HeadHandle(root, head) if root is not None else None


@contextlib.contextmanager
def keep_logits(model: torch.nn.Module, enabled: bool = True):
    """Inside this block a fused_linear-patched model returns real logits even in training with labels
    (for trainers that read ``outputs.logits``, e.g. to log token accuracy). The loss still uses our kernels."""
    heads = [st.parts[KEY] for _, st in find_states(model) if KEY in st.parts]
    before = [head.keep_logits for head in heads]
    for head in heads:
        head.keep_logits = enabled
    try:
        yield
    finally:
        for head, value in zip(heads, before):
            head.keep_logits = value


class HeadHandle:
    def __init__(self, root: torch.nn.Module, head: HeadState):
        self.root, self.state = root, head

    @property
    def head(self) -> torch.nn.Module:
        return self.state.lm_head

    @property
    def vocab_size(self) -> int:
        return int(self.state.lm_head.out_features)   # not weight.shape[0]: a ZeRO-3 partition has shape [0]

    def usable(self) -> bool:
        """Still applies now (the lm_head may be wrapped after the handle was made)."""
        return head_is_ours(self.root, self.state)

    @contextlib.contextmanager
    def emitting_hidden(self) -> Iterator["HeadHandle"]:
        st = self.state
        before = st.hidden_mode
        st.hidden_mode, st.emitted = True, None
        try:
            yield self
        finally:
            st.hidden_mode = before

    @contextlib.contextmanager
    def predicting(self) -> Iterator[list]:
        """Inside this block the model's fused loss (training with labels, no logits returned) also keeps each
        position's arg max over the vocabulary; the yielded list receives it ([N] int64 over the shifted positions,
        the last of each row included) when the block ends. Empty when the loss did not run fused."""
        st, got = self.state, []
        before = st.want_argmax
        st.want_argmax, st.argmax = True, None
        try:
            yield got
        finally:
            st.want_argmax = before
            if st.argmax is not None:
                got.append(st.argmax)
            st.argmax = None

    def take(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The hidden states the model returned as ``logits``, or None when they are real logits.

        Returns the model's own tensor (its dtype, its autograd graph): ``logits`` may be a copy of it, e.g. the
        fp32 copy accelerate's mixed-precision wrapper makes of every output, or a suffix of it along the sequence
        (the ``[:, -T:]`` trainers take when the model returns more positions than labels)."""
        emitted, self.state.emitted = self.state.emitted, None
        if emitted is None:
            return None
        if logits is emitted:
            return emitted
        if (torch.is_tensor(logits) and logits.dim() == emitted.dim() >= 2 and logits.shape[0] == emitted.shape[0]
                and logits.shape[2:] == emitted.shape[2:] and logits.shape[1] <= emitted.shape[1]):
            return emitted if logits.shape[1] == emitted.shape[1] else emitted[:, emitted.shape[1] - logits.shape[1]:]
        raise RuntimeError(f"swift_liger: the model returned hidden states {tuple(emitted.shape)} in place of logits, "
                           f"but the log-prob computation got a tensor of shape {tuple(logits.shape)}; refusing to "
                           "treat it as logits")

    def _with_softcap(self, options: dict) -> dict:
        cap = self.softcap()
        if cap:   # the forward skipped its softcap along with the lm_head (Gemma-2/3)
            if options.get("softcap") not in (None, cap):
                raise ValueError(f"softcap={options['softcap']} differs from the model's "
                                 f"{self.state.softcap_attr}={cap}")
            options["softcap"] = cap
        return options

    def logprobs(self, hidden: torch.Tensor, labels: torch.Tensor, **options):
        """ops.fused_linear_logprobs(hidden, lm_head.weight, labels, lm_head.bias, **options), with the
        head gathered when ZeRO-3 / FSDP2 shard it."""
        options = self._with_softcap(options)
        self.state.calls["fused_linear_logprobs"] += 1
        return lm_head_logprobs(self.state.lm_head, hidden, labels, **options)

    def softcap(self) -> Optional[float]:
        """The logit softcap the head-skipped forward leaves to the loss (Gemma-2/3), or None."""
        st = self.state
        cap = getattr(self.root.config, st.softcap_attr, None) if st.softcap_attr else None
        return float(cap) if cap else None

    def jsd(self, hidden: torch.Tensor, teacher: "HeadHandle", teacher_hidden: torch.Tensor, labels: torch.Tensor,
            **options):
        """ops.fused_linear_jsd with this head as the student's and ``teacher``'s as the teacher's (GKD), heads
        gathered when ZeRO-3 / FSDP2 shard them. Neither head may softcap (the op has no softcap)."""
        for h in (self, teacher):
            if h.softcap() is not None:
                raise ValueError(f"fused_linear_jsd has no logit softcap; {h.state.softcap_attr}={h.softcap()}")
        self.state.calls["fused_linear_jsd"] += 1
        return lm_head_jsd(self.state.lm_head, hidden, teacher.state.lm_head, teacher_hidden, labels, **options)

    def jsd_topk(self, hidden: torch.Tensor, labels: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                 **options):
        """ops.fused_linear_jsd_topk with this head as the student's and the teacher's top-k values and ids given
        (a teacher served by API), the head gathered when ZeRO-3 / FSDP2 shard it. No softcap."""
        if self.softcap() is not None:
            raise ValueError(f"fused_linear_jsd_topk has no logit softcap; {self.state.softcap_attr}={self.softcap()}")
        self.state.calls["fused_linear_jsd"] += 1
        return lm_head_jsd_topk(self.state.lm_head, hidden, labels, values, ids, **options)

    def cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor, **options):
        """ops.fused_linear_cross_entropy(hidden, lm_head.weight, labels, lm_head.bias, **options) (labels already
        aligned with hidden), with the head gathered when ZeRO-3 / FSDP2 shard it."""
        options = self._with_softcap(options)
        self.state.calls["fused_linear_cross_entropy"] += 1
        return lm_head_cross_entropy(self.state.lm_head, hidden, labels, **options)
