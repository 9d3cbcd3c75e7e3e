"""`swift rlhf --rlhf_type dpo|orpo|cpo|simpo|kto|grpo --use_liger` (and weighted `swift sft`): the trainers'
log-probs from hidden states.

ms-swift's preference trainers call the model without labels and log-softmax the [rows, V] logits it returns. With
``cross_entropy=fused_linear`` (the default) `TrainerFactory.get_trainer_cls` hands ms-swift a subclass of its own
trainer, same name, with one mixin below in front. Each overrides the seam where that trainer turns logits into
log-probs; the loss code (every DPO loss_type and their weights, rpo_alpha, ld_alpha, padding-free sums, ORPO's
odds ratio, CPO/SimPO's gamma and length normalisation, KTO's KL term) is ms-swift's and trl's, unchanged:

* DPO, KTO: `concatenated_forward` / `forward` run inside `HeadHandle.emitting_hidden()` (the model returns its final
  hidden states as logits) and `get_per_token_logps` (ms-swift's RLHFTrainerMixin) computes what it computes from
  logits (per-token log p, masked; per-position mean or sum of logits, masked; the mask) with
  ops.fused_linear_logprobs.
* ORPO, CPO/SimPO: trl's `concatenated_forward` reads the logits in three places, so it is replaced whole by
  `_PairSeam.concatenated_forward`, which returns trl's five values from one ops.fused_linear_logprobs call:
  sequence log p (sum or mean), the chosen NLL, and, for the logits/chosen|rejected metrics, per-position logit
  means (their mean equals the mean over the full [rows, T, V] logits).

* GRPO: `_get_logps_via_local_forward` (the policy's, the old policy's and the reference's per-token log-probs of the
  completions, at the sampling temperature, and their entropies when the trainer asks: `--log_entropy`,
  `--top_entropy_quantile` < 1) from hidden states, in one pass of the head. Every loss_type, epsilon, delta, beta,
  importance-sampling level, advantage estimator and entropy mask is ms-swift's code, unchanged.
* GKD: `compute_loss` runs the student and the teacher with their heads skipped and takes ms-swift's generalized JSD
  (beta, temperature, label shift, mean over the scored tokens; sft_alpha's own loss from the same forward) from both
  hidden states with ops.fused_linear_jsd; the teacher modes, the data sources and the loss formula are ms-swift's.
* SFT / pt with per-token weights (a non-binary `--loss_scale`, `--enable_dft_loss`, `--enable_channel_loss`) or
  `--label_smoothing_factor`: ms-swift's Seq2SeqTrainer pops the labels, calls the model and turns `outputs.logits`
  into the loss with `per_token_loss_func` or transformers' LabelSmoother; `SFTSeam.compute_loss` runs that inside
  `emitting_hidden()`, where `per_token_loss` (standing in for ms-swift's `per_token_loss_func`) returns the same
  per-token cross-entropy (DFT's detached p(label) weight included) from ops.fused_linear_logprobs and
  `_FusedLabelSmoother` the same smoothed mean from ops.fused_linear_cross_entropy's label_smoothing. The weighting,
  the channel metrics and the sum over num_items_in_batch stay ms-swift's code.
* token_acc / seq_acc of every SFT / pt training step (ms-swift computes them from `outputs.logits`, which the fused
  head never returns): from each position's arg max, kept by the same head pass (the model's fused loss under
  `HeadHandle.predicting()`, or the weighted / smoothed losses above), through ms-swift's own compute_acc.

Applies to the policy and to the reference pass (the separate ref model of full fine-tuning, patched too; or the
adapter-disabled policy of LoRA). Where it cannot apply (lm_head wrapped by LoRA / modules_to_save, sequence
parallel, an unpatched model) the trainer's own code runs on real logits. Every pass is counted, by path, in
``trainer.liger_calls``; the integration logs and records those counts (runtime.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from ..fusions.loss_head.handle import HeadHandle, head_for, keep_logits, why_not

# ms-swift rlhf_type (simpo runs as cpo) -> ms-swift trainer class name
TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "orpo": "ORPOTrainer", "cpo": "CPOTrainer",
            "grpo": "GRPOTrainer", "gkd": "GKDTrainer"}
RLHF_TYPES = ("dpo", "orpo", "cpo", "simpo", "kto", "grpo", "gkd")   # as the user writes --rlhf_type
IGNORE = -100
# log-probs from hidden states / GKD's divergence from both models' hidden states / either from materialised logits
PATHS = ("fused_linear_logprobs", "fused_linear_jsd", "logits")


class _Seam:
    """Handles per model, call counts per path, and the masked per-token log-probs ms-swift's seam returns."""

    def _liger_state(self) -> dict:
        st = self.__dict__.get("_liger")
        if st is None:
            st = self.__dict__["_liger"] = {"handles": {}, "active": [], "reasons": {}}
            self.liger_calls = {f"{path}{suffix}": 0 for path in PATHS for suffix in ("", "_no_grad")}
        return st

    def _liger_handle(self, model) -> Optional[HeadHandle]:
        st = self._liger_state()
        entry = st["handles"].get(id(model))
        if entry is None or entry[0] is not model:
            handle, reason = head_for(model), ""
            if handle is None:
                reason = why_not(model)
            elif getattr(self, "is_encoder_decoder", False):
                handle, reason = None, "encoder-decoder model"
            elif getattr(getattr(self, "template", None), "sequence_parallel_size", 1) > 1:
                handle, reason = None, "sequence parallel gathers log-probs across ranks from logits"
            entry = st["handles"][id(model)] = (model, handle, reason)
        model, handle, reason = entry
        if handle is not None and not handle.usable():
            handle, reason = None, why_not(model)
        if reason:
            st["reasons"][reason] = st["reasons"].get(reason, 0) + 1
        return handle

    def _liger_count(self, path: str) -> None:
        self._liger_state()
        self.liger_calls[path + ("" if torch.is_grad_enabled() else "_no_grad")] += 1

    @contextlib.contextmanager
    def _liger_hidden(self, model):
        handle = self._liger_handle(model)
        active = self._liger_state()["active"]
        if handle is None:
            active.append(None)
            try:
                yield None
            finally:
                active.pop()
            return
        with handle.emitting_hidden():
            active.append(handle)
            try:
                yield handle
            finally:
                active.pop()

    def get_per_token_logps(self, logits, labels, label_pad_token_id=-100, reduction="mean"):
        active = self._liger_state()["active"]
        handle = active[-1] if active else None
        hidden = handle.take(logits) if handle is not None else None
        if hidden is None:
            self._liger_count("logits")
            return super().get_per_token_logps(logits, labels, label_pad_token_id=label_pad_token_id,
                                               reduction=reduction)
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"Logits (batch and sequence length dim) {tuple(hidden.shape[:-1])} and labels must "
                             f"have the same shape {tuple(labels.shape)}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"Invalid reduction: {reduction}")
        loss_mask = labels != label_pad_token_id
        res = handle.logprobs(hidden, labels.masked_fill(~loss_mask, IGNORE), return_logit_sum=True)
        reduced = res.logit_sum if reduction == "sum" else res.logit_sum / handle.vocab_size
        self._liger_count("fused_linear_logprobs")
        return res.logps, reduced.masked_fill(~loss_mask, 0.0), loss_mask


class DPOSeam(_Seam):
    def concatenated_forward(self, model, batch, *args, **kwargs):
        with self._liger_hidden(model):
            return super().concatenated_forward(model, batch, *args, **kwargs)


class KTOSeam(_Seam):
    def forward(self, model, batch, *args, **kwargs):   # the completion pass and the KL pass
        with self._liger_hidden(model):
            return super().forward(model, batch, *args, **kwargs)


class _PairSeam(_Seam):
    """trl's ORPO/CPO concatenated_forward from one ops.fused_linear_logprobs call over the concatenated
    chosen+rejected rows."""

    average_log_prob = True
    logits_metric_positions = slice(None)

    def _liger_nll_mask(self, mask, batch) -> Optional[torch.Tensor]:
        return mask

    def concatenated_forward(self, model, batch, *args, **kwargs):
        handle = self._liger_handle(model)
        if handle is None:
            self._liger_count("logits")
            return super().concatenated_forward(model, batch, *args, **kwargs)
        # the model call of ms-swift's RLHFTrainerMixin.concatenated_forward
        model_kwargs = dict(batch)
        labels = model_kwargs.pop("labels")
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        with handle.emitting_hidden():
            outputs = model(**model_kwargs, use_cache=False)
            hidden = handle.take(outputs.logits)
        if hidden is None:   # the lm_head stood aside during the call: the trainer's own code, on real logits
            self._liger_count("logits")
            return super().concatenated_forward(model, batch, *args, **kwargs)
        if hidden.shape[1] != labels.shape[1]:
            hidden = hidden[:, -labels.shape[1]:]
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE)   # position t predicts token t+1 (trl's shift)
        res = handle.logprobs(hidden, target, return_logit_sum=True)
        self._liger_count("fused_linear_logprobs")
        mask = target != IGNORE
        logps = res.logps.sum(-1)
        if self.average_log_prob:
            logps = logps / mask.sum(-1)
        n = labels.shape[0] // 2
        nll_mask = self._liger_nll_mask(mask, batch)
        if nll_mask is None:
            nll = torch.tensor(0.0).to(self.accelerator.device)
        else:   # nn.CrossEntropyLoss() over the chosen rows: mean over their counted tokens
            nll_mask = nll_mask[:n]
            nll = -(res.logps[:n] * nll_mask).sum() / nll_mask.sum()
        mean_logits = (res.logit_sum / handle.vocab_size)[:, self.logits_metric_positions]
        out = (logps[:n], logps[n:], mean_logits[:n], mean_logits[n:], nll)
        if self.aux_loss_enabled:
            out += (outputs.aux_loss,)
        return out


class ORPOSeam(_PairSeam):
    # trl ORPO: mean log p per sequence; NLL over the chosen rows where attention_mask == 1; logits metrics over
    # positions [:-1]
    average_log_prob = True
    logits_metric_positions = slice(None, -1)

    def _liger_nll_mask(self, mask, batch):
        attention = batch.get("attention_mask")
        if attention is None:
            return mask
        return mask & F.pad(attention[:, 1:] == 1, (0, 1), value=False)


class CPOSeam(_PairSeam):
    # trl CPO: mean log p for loss_type ipo/simpo, else the sum; NLL only when cpo_alpha != 0; logits metrics over
    # every position
    logits_metric_positions = slice(None)

    @property
    def average_log_prob(self):
        return self.loss_type in ("ipo", "simpo")

    def _liger_nll_mask(self, mask, batch):
        return None if self.cpo_alpha == 0 else mask


class GRPOSeam(_Seam):
    """ms-swift's GRPOTrainer: the per-token log-probs of the completions (policy, old policy, reference) from the
    hidden states, at the trainer's temperature, and with ``compute_entropy`` their entropies from the same pass of
    the head (no gradient: ms-swift uses them for the entropy mask and the entropy metrics only). Every loss formula
    stays ms-swift's."""

    def _get_logps_via_local_forward(self, model, model_inputs, logits_to_keep, input_ids, compute_entropy=False):
        handle = self._liger_handle(model)
        if handle is None:
            self._liger_count("logits")
            return super()._get_logps_via_local_forward(model, model_inputs, logits_to_keep, input_ids,
                                                        compute_entropy=compute_entropy)
        if "use_cache" in self.model_kwarg_keys:   # the model call of ms-swift's own method
            model_inputs["use_cache"] = False
        if "logits_to_keep" in self.model_kwarg_keys:
            model_inputs["logits_to_keep"] = logits_to_keep + 1
        with handle.emitting_hidden():
            hidden = handle.take(model(**model_inputs).logits)
        if hidden is None:   # the lm_head stood aside: the trainer's own code (it calls the model again)
            self._liger_count("logits")
            return super()._get_logps_via_local_forward(model, model_inputs, logits_to_keep, input_ids,
                                                        compute_entropy=compute_entropy)
        hidden = hidden[:, -(logits_to_keep + 1):-1]   # position t predicts token t+1
        res = handle.logprobs(hidden, input_ids[:, -logits_to_keep:], temperature=float(self.temperature),
                              return_entropy=bool(compute_entropy))
        self._liger_count("fused_linear_logprobs")
        if not compute_entropy:
            return res, None   # a plain logps tensor
        return res.logps, res.entropy


class GKDSeam(_Seam):
    """ms-swift's GKDTrainer: the generalized JSD between the student and the teacher from both models' final hidden
    states and heads (ops.fused_linear_jsd: no [tokens, vocab] logits for either), with ms-swift's beta, temperature,
    label shift and mean over the scored tokens, its teacher modes (a teacher model; self-distillation through the
    adapter-disabled student; OPSD, where the teacher scores its own prompt) and ``sft_alpha`` (the student's own
    loss from the same forward, through the fused linear CE) and top-k distillation (``gkd_logits_topk``: the
    divergence over the teacher's k largest logits per token, the student's logits at those ids only). A teacher
    served by API sends its top-k log-probs with the batch: the student's logits at those ids come the same way
    (ops.fused_linear_jsd_topk). A softcapped head, a student vocabulary wider than the teacher's (top-k excepted:
    its ids index the student's head) and evaluation passes run ms-swift's own code on logits."""

    def _liger_gkd_handles(self, model):
        """(student handle, teacher handle, teacher module) when the fused path applies to this call (teacher handle
        and module None for a teacher served by API), else None (the reason recorded)."""
        why = ""
        if not model.training:
            why = "evaluation passes keep ms-swift's loss on logits"
        student = teacher = teacher_model = None
        api = bool(getattr(self, "use_teacher_api", False))   # its top-k log-probs arrive with the batch
        if not why:
            student = self._liger_handle(model)
            if not api:
                teacher_model = model if getattr(self, "_is_self_distillation", False) else self.teacher_model
                teacher = student if teacher_model is model else self._liger_handle(teacher_model)
            if student is None or (teacher is None and not api):   # _liger_handle recorded why
                return None
            capped = [h.state.softcap_attr for h in (student, teacher) if h is not None and h.softcap() is not None]
            if capped:
                why = f"the model softcaps its logits ({capped[0]})"
            elif (not api and getattr(self, "gkd_logits_topk", None) is None
                  and student.vocab_size > teacher.vocab_size):   # a wider teacher is aligned in the op, as ms-swift
                why = (f"the student's vocabulary is wider than the teacher's ({student.vocab_size} vs "
                       f"{teacher.vocab_size})")
        if why:
            reasons = self._liger_state()["reasons"]
            reasons[why] = reasons.get(why, 0) + 1
            return None
        return student, teacher, teacher_model

    def _liger_teacher_context(self, model, teacher_model):
        """ms-swift's context for the teacher's forward (GKDTrainer.compute_loss)."""
        from swift.trainers import disable_gradient_checkpointing
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        if teacher_model is model:   # self-distillation: the student with its adapters off, when it has them
            if getattr(self, "_teacher_use_disable_adapter", False):
                stack.enter_context(self.accelerator.unwrap_model(model).disable_adapter())
        elif getattr(self.args, "offload_teacher_model", False):
            stack.enter_context(self.load_teacher_model_context())
        stack.enter_context(disable_gradient_checkpointing(teacher_model, self.args.gradient_checkpointing_kwargs))
        return stack

    def _liger_gkd_on_logits(self, model, inputs, return_outputs, num_items_in_batch):
        """ms-swift's own compute_loss on the student's real logits (with sft_alpha the student is called with
        labels, where a fused_linear model would otherwise return its loss without logits)."""
        self._liger_count("logits")
        with keep_logits(model):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        found = self._liger_gkd_handles(model)
        if found is None:
            return self._liger_gkd_on_logits(model, inputs, return_outputs, num_items_in_batch)
        student, teacher, teacher_model = found
        model_inputs, teacher_inputs = inputs["model_inputs"], inputs["teacher_model_inputs"]
        labels, sft_alpha = model_inputs["labels"], float(getattr(self.args, "sft_alpha", 0) or 0)
        forward = {k: v for k, v in model_inputs.items() if k != "labels"}
        if sft_alpha > 0:   # the model's own loss too: the fused linear CE from the same hidden states
            forward["labels"] = labels
        with student.emitting_hidden():
            out_student = model(**forward)
            hidden = student.take(out_student.logits)
        if hidden is None:   # the student's lm_head stood aside: ms-swift's code (it runs the models again)
            return self._liger_gkd_on_logits(model, inputs, return_outputs, num_items_in_batch)
        if teacher is None:   # served by API: the teacher's top-k log-probs per position of its labels
            batch = inputs["gkd_batch"]
            teacher_labels = torch.roll(teacher_inputs["labels"], shifts=-1, dims=1)
            loss = student.jsd_topk(hidden, torch.roll(labels, shifts=-1, dims=1), batch.teacher_topk_logprobs,
                                    batch.teacher_topk_indices, teacher_labels=teacher_labels,
                                    beta=float(self.beta), temperature=float(self.temperature), reduction="mean")
            self._liger_count_scored(teacher_labels, batch.teacher_topk_logprobs)   # shapes checked by jsd_topk
            return self._liger_gkd_finish(loss, inputs, out_student, sft_alpha, return_outputs)
        with self._liger_teacher_context(model, teacher_model), teacher.emitting_hidden():
            teacher_hidden = teacher.take(teacher_model(**{k: v for k, v in teacher_inputs.items() if k != "labels"
                                                           }).logits)
        if teacher_hidden is None:   # the teacher's lm_head stood aside: ms-swift's code (it runs both again)
            return self._liger_gkd_on_logits(model, inputs, return_outputs, num_items_in_batch)
        # ms-swift's _compute_jsd_loss: position t scores label t+1, mean over the scored tokens (0 with none)
        loss = student.jsd(hidden, teacher, teacher_hidden.detach(), torch.roll(labels, shifts=-1, dims=1),
                           teacher_labels=torch.roll(teacher_inputs["labels"], shifts=-1, dims=1),
                           beta=float(self.beta), temperature=float(self.temperature), reduction="mean",
                           topk=getattr(self, "gkd_logits_topk", None))
        return self._liger_gkd_finish(loss, inputs, out_student, sft_alpha, return_outputs)

    def _liger_count_scored(self, teacher_labels, topk_logprobs) -> None:
        """Adds [positions the teacher server scored, positions trained] of this batch to a device counter (no host
        sync; runtime.py reads it with the record). A server whose chat template or tokenizer differs from the
        student's scores another token sequence: ms-swift aligns by position and leaves unscored ones out, so
        most or all trained positions can go unscored without an error (a loss of 0)."""
        trained = teacher_labels != IGNORE   # [B, S]: the frame's leading shape
        scored = trained & torch.isfinite(topk_logprobs).any(-1)
        counts = torch.stack([scored.sum(), trained.sum()])
        st = self._liger_state()
        st["api_scored"] = counts if st.get("api_scored") is None else st["api_scored"] + counts

    def _liger_gkd_finish(self, loss, inputs, out_student, sft_alpha, return_outputs):
        self._liger_count("fused_linear_jsd")
        if sft_alpha > 0:
            from swift.rlhf_trainers.gkd_loss import DataSource
            if inputs["gkd_batch"].data_source != DataSource.STUDENT:
                loss = loss + sft_alpha * out_student.loss
        if return_outputs:   # its logits are hidden states: never handed out as logits
            return loss, None
        return loss


class _SFTCall:
    """The SFTSeam.compute_loss call in progress: its trainer, head handle and the hidden states the model returned
    (taken once; both the per-token loss and the label smoother read them), and the head's arg max per position for
    token_acc."""

    def __init__(self, trainer, handle: Optional[HeadHandle]):
        self.trainer, self.handle, self._hidden, self._taken = trainer, handle, None, False
        self.preds: Optional[torch.Tensor] = None

    def hidden(self, outputs) -> Optional[torch.Tensor]:
        if not self._taken and self.handle is not None:
            self._hidden, self._taken = self.handle.take(outputs.logits), True
        return self._hidden


_SFT_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("swift_liger_sft_seam", default=None)


def per_token_loss(original):
    """ms-swift's per_token_loss_func(outputs, labels, enable_dft_loss=False, **kw) -> [rows * T] fp32, computed from
    the hidden states the model returned when an SFTSeam call is active; `original` otherwise."""

    @functools.wraps(original)
    def wrapper(outputs, labels, enable_dft_loss: bool = False, **kwargs):
        call = _SFT_ACTIVE.get()
        hidden = call.hidden(outputs) if call is not None else None
        if hidden is None:
            if call is not None:
                call.trainer._liger_count("logits")
            return original(outputs, labels, enable_dft_loss=enable_dft_loss, **kwargs)
        target = torch.roll(labels, shifts=-1, dims=-1)   # ms-swift's shift: position t predicts token t+1
        if hidden.shape[:-1] != target.shape:
            raise ValueError(f"swift_liger: hidden states {tuple(hidden.shape)} do not match labels "
                             f"{tuple(target.shape)}")
        res = call.handle.logprobs(hidden, target.to(hidden.device), return_argmax=True)
        call.preds = res.argmax
        loss = -res.logps.reshape(-1)   # 0 where the label is -100
        if enable_dft_loss:
            loss = loss * torch.exp(-loss).detach()
        call.trainer._liger_count("fused_linear_logprobs")
        outputs.logits = None   # they were hidden states: nothing downstream may read them as logits
        return loss

    wrapper._swift_liger_original = original
    return wrapper


def install_per_token_loss(module) -> None:
    """Route `module.per_token_loss_func` (swift.trainers.seq2seq_trainer's name for it) through per_token_loss."""
    current = getattr(module, "per_token_loss_func")
    if getattr(current, "_swift_liger_original", None) is None:
        module.per_token_loss_func = per_token_loss(current)


class _FusedLabelSmoother:
    """Stands in for the trainer's transformers LabelSmoother during an SFTSeam call: the same loss,
    (1 - eps) * mean NLL + eps * mean over tokens and vocabulary of -log p (a mean over the micro-batch's counted
    tokens, as LabelSmoother takes it), from the hidden states through ops.fused_linear_cross_entropy's
    label_smoothing. Real logits go to the original."""

    def __init__(self, original, call: _SFTCall):
        self.original, self.call = original, call
        self.epsilon, self.ignore_index = original.epsilon, original.ignore_index

    def __call__(self, model_output, labels, shift_labels: bool = False):
        hidden = self.call.hidden(model_output)
        if hidden is None:
            self.call.trainer._liger_count("logits")
            return self.original(model_output, labels, shift_labels=shift_labels)
        if shift_labels:
            hidden, labels = hidden[..., :-1, :], labels[..., 1:]
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"swift_liger: hidden states {tuple(hidden.shape)} do not match labels "
                             f"{tuple(labels.shape)}")
        out = self.call.handle.cross_entropy(hidden.reshape(-1, hidden.shape[-1]),
                                             labels.reshape(-1).to(hidden.device),
                                             label_smoothing=float(self.epsilon), ignore_index=self.ignore_index,
                                             reduction="mean", return_argmax=True)
        if self.call.preds is None:   # position t's prediction at t; the last position (never scored) gets 0
            preds = out.argmax.view(labels.shape)
            self.call.preds = F.pad(preds, (0, 1)) if shift_labels else preds
        loss = out.loss
        self.call.trainer._liger_count("fused_linear_logprobs")
        model_output["logits"] = None   # hidden states: no token_acc from them
        return loss


class SFTSeam(_Seam):
    """Seq2SeqTrainer (swift sft / pt) on the branch of its compute_loss that pops the labels and reads
    outputs.logits itself: per-token weights and label smoothing."""

    def _liger_applies(self, model, inputs) -> bool:
        """Training, and ms-swift's compute_loss pops the labels and turns outputs.logits into the loss with
        per_token_loss_func or the label smoother (no custom loss function, no sequence parallel: those read the
        logits some other way). Evaluation keeps its logits, as the fused linear CE does."""
        args = self.args
        return (model.training and "labels" in inputs and inputs.get("compute_loss_func") is None
                and getattr(self.template, "sequence_parallel_size", 1) == 1
                and (self.label_smoother is not None or inputs.get("loss_scale") is not None
                     or getattr(args, "enable_dft_loss", False) or getattr(args, "enable_channel_loss", False)))

    def _liger_acc_handle(self, model, inputs) -> Optional[HeadHandle]:
        """The head whose fused loss will leave ms-swift without logits for token_acc in this training call (labels
        reach the model, causal LM, no sequence parallel, logits not kept), or None."""
        if not (model.training and "labels" in inputs and getattr(self, "task_type", "causal_lm") == "causal_lm"
                and getattr(self.template, "sequence_parallel_size", 1) == 1
                and getattr(self.args, "tuner_backend", None) != "unsloth"):
            return None
        handles = self.__dict__.setdefault("_liger_acc_handles", {})   # not _liger_state: no log-prob record
        entry = handles.get(id(model))
        if entry is None or entry[0] is not model:
            entry = handles[id(model)] = (model, head_for(model))
        handle = entry[1]
        if handle is None or not handle.usable() or handle.state.keep_logits:
            return None
        return handle

    def _liger_token_acc(self, preds, labels, position_ids, logits_to_keep) -> None:
        """ms-swift's token_acc / seq_acc (Seq2SeqTrainer._compute_acc) from the fused head's predictions."""
        from swift.metrics.acc import compute_acc
        cu_seqlens = None
        if self.template.padding_free and self.args.acc_strategy == "seq":
            cu_seqlens = self.get_cu_seqlens(position_ids, logits_to_keep)
        metrics = compute_acc(preds.view(labels.shape), labels, acc_strategy=self.args.acc_strategy,
                              is_encoder_decoder=self.template.is_encoder_decoder, cu_seqlens=cu_seqlens)
        mode = "train" if self.model.training else "eval"
        for key, value in (metrics or {}).items():
            self.custom_metrics[mode][key].update(value)

    def compute_loss(self, model, inputs, *args, **kwargs):
        acc = self._liger_acc_handle(model, inputs)
        if acc is not None:   # read before ms-swift's compute_loss pops them from inputs
            position_ids = inputs.get("text_position_ids")
            where = (inputs["labels"], inputs.get("position_ids") if position_ids is None else position_ids,
                     inputs.get("logits_to_keep"))
        if self._liger_applies(model, inputs):
            out, preds = self._liger_hidden_loss(model, inputs, *args, **kwargs)
        elif acc is not None:
            with acc.predicting() as got:
                out = super().compute_loss(model, inputs, *args, **kwargs)
            preds = got[0] if got else None
        else:
            return super().compute_loss(model, inputs, *args, **kwargs)
        if acc is not None and preds is not None and preds.numel() == where[0].numel():
            self._liger_token_acc(preds, *where)
        return out

    def _liger_hidden_loss(self, model, inputs, *args, **kwargs):
        """ms-swift's compute_loss with per_token_loss and the label smoother on hidden states: (loss, arg max)."""
        smoother = self.label_smoother
        with self._liger_hidden(model) as handle:
            call = _SFTCall(self, handle)
            token = _SFT_ACTIVE.set(call)
            if smoother is not None:
                self.label_smoother = _FusedLabelSmoother(smoother, call)
            try:
                return super().compute_loss(model, inputs, *args, **kwargs), call.preds
            finally:
                self.label_smoother = smoother
                _SFT_ACTIVE.reset(token)


SEAMS = {"DPOTrainer": DPOSeam, "KTOTrainer": KTOSeam, "ORPOTrainer": ORPOSeam, "CPOTrainer": CPOSeam,
         "GRPOTrainer": GRPOSeam, "GKDTrainer": GKDSeam, "Seq2SeqTrainer": SFTSeam}


@functools.lru_cache(maxsize=None)
def trainer_class(base: type) -> type:
    """`base` (an ms-swift preference trainer class) with its seam mixin in front. The subclass keeps the base's
    name: ms-swift's RLHFTrainerMixin branches on `self.__class__.__name__ == 'ORPOTrainer'`."""
    seam = SEAMS[base.__name__]
    cls = type(base.__name__, (seam, base), {"__module__": __name__, "__qualname__": base.__qualname__,
                                             "__doc__": base.__doc__})
    cls._swift_liger_seam = seam
    return cls


def fallback_reasons(trainer) -> Dict[str, int]:
    """Why passes took the trainer's own path on real logits: reason -> number of passes."""
    st = trainer.__dict__.get("_liger")
    return dict(st["reasons"]) if st else {}


def teacher_api_scored(trainer) -> Optional[Dict[str, int]]:
    """GKD with a teacher served by API: {"scored", "trained"} label positions so far (None without one)."""
    st = trainer.__dict__.get("_liger")
    counts = st.get("api_scored") if st else None
    if counts is None:
        return None
    scored, trained = (int(x) for x in counts.tolist())
    return {"scored": scored, "trained": trained}
