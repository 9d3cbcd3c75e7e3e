"""Per-step speed and memory metrics for ms-swift (and any transformers Trainer).

Added to every training log line (logging.jsonl, TensorBoard/W&B via report_to, the progress bar), averaged over
the optimizer steps since the previous log line:

  step_time(s)       wall time from on_step_begin to on_step_end (forward+backward of all micro-batches, optimizer
                     step; CUDA is synchronised at the end so queued kernels count). Data loading for the step
                     happens before on_step_begin and is not included.
  tokens/s           non-padding tokens / step_time, summed over data-parallel ranks. Tokens per micro-batch, of
                     the batch the loss is computed on (after the trainer prepared it: GRPO's generated rows, not
                     its prompts): attention_mask.sum() for 2-D masks, else input_ids.numel() (padding-free/packed
                     batches have no padding). Prompt tokens count too: they cost forward+backward like any other.
                     For GRPO step_time includes generating the completions.
  completion_tokens/s  GRPO only: the completion tokens among them (completion_mask.sum()).
  peak_alloc(GiB)    CUDA only: torch.cuda.max_memory_allocated() with the peak reset at every step begin, max over
  peak_reserved(GiB) the logged steps (rank-local, current device). ms-swift's cumulative memory(GiB) stays right.
  alloc(GiB)         CUDA only: torch.cuda.memory_allocated() at the end of the last logged step (weights, optimizer
                     state, whatever survived the step): flat over a long run unless something accumulates.
  rss(GiB)           CPU runs only (no CUDA): process resident set size at the last step end. Not a peak.
  MFU                CUDA + bf16/fp16 weights only: achieved FLOP/s / (peak dense FLOP/s x ranks). FLOPs/token =
                     2*N_linear (forward) + 2*N_linear (activation grads) + 2*N_trainable_linear (weight grads),
                     N = weights of nn.Linear layers incl. lm_head (so LoRA counts ~4N, full fine-tuning 6N);
                     attention score/value matmuls are not counted, so MFU reads a bit low at long context.
                     Peak from PEAK_TFLOPS by device name; SWIFT_LIGER_PEAK_TFLOPS overrides (per device).

Metrics never raise into training: the first failure logs a warning and switches them off.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

GiB = 1024 ** 3

# Dense bf16/fp16 tensor-core peak TFLOP/s (no sparsity), checked in order: more specific names first.
PEAK_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 125.0),
    ("MI300X", 1307.0),
)


def peak_flops(device_name: str):
    """Peak dense bf16 FLOP/s of one device, or None when unknown."""
    env = os.environ.get("SWIFT_LIGER_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def linear_flops_per_token(model) -> float:
    """2*N (fwd) + 2*N (activation grads) + 2*N_trainable (weight grads) over nn.Linear weights."""
    import torch
    total = trainable = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            n = getattr(w, "ds_numel", None) or w.numel()  # ZeRO-3 partitions params to numel 0
            total += n
            if w.requires_grad:
                trainable += n
    return 4.0 * total + 2.0 * trainable


def _rss_bytes():
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(inputs):
    """A micro-batch as a mapping (dict or transformers' BatchEncoding, a UserDict), unwrapped from the one-element
    list GRPO may pass; None when it is not one."""
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    return inputs if isinstance(inputs, Mapping) else None


def _model_batch(inputs):
    """The mapping holding the model's input_ids: the batch itself, or the "model_inputs" of GRPO's prepared batch
    ({"model_inputs": ..., "grpo_batch": ...})."""
    inputs = _batch(inputs)
    nested = inputs.get("model_inputs") if inputs is not None else None
    return nested if isinstance(nested, Mapping) else inputs


def count_completion_tokens(inputs):
    """Completion tokens of a GRPO micro-batch (its grpo_batch.completion_mask), else 0."""
    inputs = _batch(inputs)
    mask = getattr(inputs.get("grpo_batch"), "completion_mask", None) if inputs is not None else None
    return mask.sum() if mask is not None and hasattr(mask, "sum") else 0


def count_tokens(inputs):
    """Non-padding tokens in one micro-batch (a tensor or an int)."""
    inputs = _model_batch(inputs)
    if inputs is None:
        return 0
    mask = inputs.get("attention_mask")
    if mask is not None and hasattr(mask, "dim") and mask.dim() == 2:
        return mask.sum()
    input_ids = inputs.get("input_ids")
    if input_ids is not None and hasattr(input_ids, "numel"):
        return input_ids.numel()
    return 0


class StepMetrics:
    """Collects per-step numbers from a trainer (callback + training_step/log wrappers) and emits them on log."""

    def __init__(self, trainer):
        import torch
        self.trainer = trainer
        self.cuda = torch.cuda.is_available() and trainer.args.device.type == "cuda"
        self.enabled = True
        self._pending = []  # (tokens, completion tokens) of the micro-batches of the current step
        self._counted = False  # the current micro-batch was counted from the inputs compute_loss got
        self._reset_interval()
        self.peak = None
        self.flops_per_token = None
        if self.cuda:
            self.peak = peak_flops(torch.cuda.get_device_name(trainer.args.device))
            model = trainer.model
            dtype = getattr(model, "dtype", None)
            if self.peak is not None and dtype in (torch.bfloat16, torch.float16):
                self.flops_per_token = linear_flops_per_token(model)

    def _reset_interval(self):
        self.steps = 0
        self.seconds = 0.0
        self.tokens = 0
        self.completion_tokens = 0
        self.peak_alloc = 0
        self.peak_reserved = 0
        self.alloc = 0
        self.t0 = None

    def _fail(self, where, exc):
        self.enabled = False
        try:
            from swift.utils import get_logger
            get_logger().warning(f"swift_liger metrics off after an error in {where}: {exc!r}")
        except Exception:
            pass

    # -- hooks -------------------------------------------------------------------------------------------------
    def step_begin(self):
        if not self.enabled:
            return
        try:
            if self.cuda:
                import torch
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._pending = []
            self.t0 = time.perf_counter()
        except Exception as e:
            self._fail("step_begin", e)

    def micro_batch_begin(self):
        self._counted = False

    def loss_inputs(self, inputs):
        """compute_loss's inputs: the batch as the model sees it (first call per micro-batch)."""
        if self.enabled and self.t0 is not None and not self._counted:
            try:
                self._pending.append((count_tokens(inputs), count_completion_tokens(inputs)))
                self._counted = True
            except Exception as e:
                self._fail("compute_loss", e)

    def micro_batch_end(self, inputs):
        """training_step's inputs, counted when compute_loss was not called (a trainer with its own loss path)."""
        if self.enabled and self.t0 is not None and not self._counted:
            try:
                self._pending.append((count_tokens(inputs), 0))
            except Exception as e:
                self._fail("training_step", e)
        self._counted = False

    def step_end(self):
        if not self.enabled or self.t0 is None:
            return
        try:
            import torch
            if self.cuda:
                torch.cuda.synchronize()
                self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated())
                self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())
                self.alloc = torch.cuda.memory_allocated()
            self.seconds += time.perf_counter() - self.t0
            self.tokens += int(sum(int(t) for t, _ in self._pending))
            self.completion_tokens += int(sum(int(c) for _, c in self._pending))
            self.steps += 1
            self.t0 = None
        except Exception as e:
            self._fail("step_end", e)

    def flush(self) -> dict:
        """Metrics for the steps since the last call (called on every rank: it may all-reduce)."""
        if not self.enabled or self.steps == 0:
            return {}
        try:
            import torch
            import torch.distributed as dist
            tokens, completion, world = float(self.tokens), float(self.completion_tokens), 1
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                world = dist.get_world_size()
                t = torch.tensor([tokens, completion], dtype=torch.float64, device=self.trainer.args.device)
                dist.all_reduce(t)
                tokens, completion = (float(v) for v in t.tolist())
            per_s = (lambda n: round(n / self.seconds, 2) if self.seconds > 0 else 0.0)
            out = {"step_time(s)": round(self.seconds / self.steps, 6), "tokens/s": per_s(tokens)}
            if completion > 0:
                out["completion_tokens/s"] = per_s(completion)
            if self.cuda:
                out["peak_alloc(GiB)"] = round(self.peak_alloc / GiB, 4)
                out["peak_reserved(GiB)"] = round(self.peak_reserved / GiB, 4)
                out["alloc(GiB)"] = round(self.alloc / GiB, 4)
                state = self.trainer.state  # keep ms-swift's cumulative memory(GiB) exact despite our resets
                state.max_memory = max(getattr(state, "max_memory", 0) or 0, self.peak_reserved / GiB)
                if self.flops_per_token and self.seconds > 0:
                    out["MFU"] = round(self.flops_per_token * tokens / self.seconds / (self.peak * world), 4)
            else:
                out["rss(GiB)"] = round(_rss_bytes() / GiB, 4)
            self._reset_interval()
            return out
        except Exception as e:
            self._fail("log", e)
            return {}


def _callback_class():
    from transformers import TrainerCallback

    class StepMetricsCallback(TrainerCallback):
        def __init__(self, metrics):
            self.metrics = metrics

        def on_step_begin(self, args, state, control, **kwargs):
            self.metrics.step_begin()

        def on_step_end(self, args, state, control, **kwargs):
            self.metrics.step_end()

    return StepMetricsCallback


def is_train_log(logs) -> bool:
    return isinstance(logs, dict) and "loss" in logs and not any(str(k).startswith("eval_") for k in logs)


def attach(trainer) -> StepMetrics:
    """Attach to a built transformers/ms-swift Trainer (idempotent). Works for any Trainer subclass."""
    existing = getattr(trainer, "_swift_liger_metrics", None)
    if existing is not None:
        return existing
    metrics = StepMetrics(trainer)
    trainer._swift_liger_metrics = metrics
    trainer.add_callback(_callback_class()(metrics))

    orig_step = trainer.training_step
    orig_loss = getattr(trainer, "compute_loss", None)

    def training_step(model, inputs, *args, **kwargs):
        metrics.micro_batch_begin()
        try:
            return orig_step(model, inputs, *args, **kwargs)
        finally:
            metrics.micro_batch_end(inputs)

    def compute_loss(model, inputs, *args, **kwargs):
        metrics.loss_inputs(inputs)
        return orig_loss(model, inputs, *args, **kwargs)

    orig_log = trainer.log

    def log(logs, *args, **kwargs):
        # Before the callbacks run, so TensorBoard, logging.jsonl and the progress bar all get the keys.
        if is_train_log(logs):
            logs.update(metrics.flush())
        return orig_log(logs, *args, **kwargs)

    trainer.training_step = training_step
    if orig_loss is not None:
        trainer.compute_loss = compute_loss
    trainer.log = log
    return metrics
