"""What the fusions did, counted while training: logged after the first optimizer step, recorded in liger_patch.json.

The patch report says what was installed; this says what ran. Sources:
* each patched model's counters (swift_liger.call_counts): our fused linear CE and CE calls (the model's own
  loss), fused log-prob passes, forwards that returned [rows, V] logits, and lora_fusion's LoRA projection calls
  through ops.lora_linear or PEFT's own forward;
* a preference trainer's log-prob passes by path (preference.py): from hidden states or from real logits, with
  gradient (the policy) or without (the reference pass, KTO's KL pass, eval);
* the policy's attention implementation and, for ``swift_liger``, its calls since training began: through the
  packed-row kernel (``varlen``), handed to SDPA or the softcap-aware eager softmax, document bounds computed.
* Triton's kernel builds (compiles on a cold cache, loads from disk on a warm one) until the first optimizer step
  ends (compile_watch.py): the part of the first step's time that later steps do not pay;
* with SWIFT_LIGER_PROFILE_FIRST_STEP=N, a cProfile of the first step's host time (first_step_profile.py).
"liger_patch.json" gets ``runtime: {"first_step": {...}, "total": {...}}``; "total" is written at the end of training.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ..fusions import varlen_attention
from ..patcher import call_counts
from .compile_watch import CompileWatch
from .compile_watch import describe as describe_compiles
from .first_step_profile import FirstStepProfile, rows_from_env
from .first_step_profile import describe as describe_profile
from .preference import fallback_reasons, teacher_api_scored
from .record import update_record


def _models(trainer):
    out = [("policy", trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        out.append(("ref", ref))
    return out


def _attention(model, since: dict) -> dict:
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    out = {"impl": impl}
    if impl == varlen_attention.NAME:   # COUNTS is process-wide: the calls since on_train_begin
        for key in ("varlen", "sdpa", "eager", "bounds", "dense_masks"):
            out[key] = varlen_attention.COUNTS[key] - since.get(key, 0)
    return out


def snapshot(trainer, attention_since: dict | None = None) -> dict:
    out = {}
    for role, model in _models(trainer):
        counts = call_counts(model)
        if counts is not None:
            out[role] = counts
    calls = getattr(trainer, "liger_calls", None)
    if calls is not None:
        out["trainer"] = {"class": type(trainer).__name__, "log_prob_passes": dict(calls),
                          "logits_fallback_reasons": fallback_reasons(trainer)}
        scored = teacher_api_scored(trainer)
        if scored is not None:
            out["trainer"]["teacher_api_positions"] = scored
    policy = out.get("policy")
    if policy and (policy["lora_fused"] or policy["lora_peft"]):   # the reference pass of LoRA runs on the policy
        out["lora_fusion"] = {"ops.lora_linear": policy["lora_fused"], "peft": policy["lora_peft"]}
    out["attention"] = _attention(trainer.model, attention_since or {})
    rollouts = _rolling_generate_counts(trainer.model)
    if rollouts is not None:
        out["rolling_cache"] = rollouts
    return out


def _rolling_generate_counts(model):
    """The policy's generate calls on a RollingKVCache (GRPO / GKD rollouts through ms-swift's pt engine)."""
    try:
        from ..cache.install import generate_counts   # lazy: needs transformers' cache classes
    except ImportError:
        return None
    return generate_counts(model)


def describe(snap: dict, when: str = "in the first step") -> list:
    """Log lines for a snapshot (what a user reads after the first step)."""
    lines = []
    trainer = snap.get("trainer")
    if trainer:
        p = trainer["log_prob_passes"]
        fused, stock = p["fused_linear_logprobs"], p["logits"]
        fused_ng, stock_ng = p["fused_linear_logprobs_no_grad"], p["logits_no_grad"]
        jsd = p.get("fused_linear_jsd", 0) + p.get("fused_linear_jsd_no_grad", 0)
        if jsd:   # GKD
            line = (f"{when} {trainer['class']} computed {jsd} distillation losses (generalized JSD) from hidden "
                    f"states (the student's; the teacher's, or its top-k log-probs when served by API; no [tokens, "
                    f"vocab] logits) and {stock + stock_ng} from materialised logits")
        else:
            line = (f"{when} {trainer['class']} took {fused + fused_ng} log-prob passes from hidden states "
                    f"(the fused linear head, no [tokens, vocab] logits; {fused} with gradient, {fused_ng} "
                    f"without) and {stock + stock_ng} from materialised logits")
        if trainer["logits_fallback_reasons"]:
            line += " because " + "; ".join(trainer["logits_fallback_reasons"])
        lines.append(line)
        api = trainer.get("teacher_api_positions")
        if api:
            line = (f"{when} the teacher server's top-k log-probs covered {api['scored']} of the {api['trained']} "
                    "trained positions (unscored ones are left out, as ms-swift leaves them out)")
            if api["scored"] < 0.5 * api["trained"]:
                line += ("; under half: the server scored another token sequence than the student trains on (its "
                         "chat template or tokenizer differs from the student's?)")
            lines.append(line)
    for role in ("policy", "ref"):
        c = snap.get(role)
        if c is None or c["cross_entropy_mode"] == "off":
            continue
        ran = [f"{k} {c[k]}" for k in ("fused_linear_cross_entropy", "cross_entropy", "fused_linear_logprobs",
                                       "fused_linear_jsd") if c.get(k)]
        if ran:
            line = f"{when} the {role} model's loss head ran " + ", ".join(ran)
        else:
            line = (f"{when} the {role} model's loss head (cross_entropy={c['cross_entropy_mode']}) ran none of "
                    "swift_liger's losses: the trainer computed its loss from the logits itself")
        if c["lm_head_logits"] is not None:
            line += f"; its lm_head materialised logits {c['lm_head_logits']} times"
        lines.append(line)
    offload = (snap.get("policy") or {}).get("offloaded_checkpoints")
    if offload:
        line = (f"offload_checkpoints {when}: {offload['offloaded']} decoder-layer inputs kept on the host, "
                f"{offload['prefetched']} prefetched one layer ahead, {offload['fetched_late']} fetched on demand")
        if not offload["offloaded"]:
            line += " (gradient checkpointing is off: nothing to offload)"
        lines.append(line)
    fp8 = snap.get("policy") or {}
    if fp8.get("fp8_weights") is not None:
        lines.append(f"fp8_base {when}: {fp8['fp8_weights']} frozen weights in FP8; the base GEMMs of fused LoRA "
                     "projections ran FP8, and the FP8 linears' own forward (PEFT with adapters disabled, frozen "
                     f"linears without LoRA) {fp8['fp8_base_calls']} times")
    kept = (snap.get("policy") or {}).get("saved_attention")
    if kept:
        line = f"save_attention {when}: {kept['kept']} attention outputs kept in the forward for the recompute"
        if not kept["kept"]:
            line += (" (gradient checkpointing off, or attention did not reach a fused SDPA kernel: eager, flex or "
                     "a masked batch on the math path)")
        lines.append(line)
    att = snap.get("attention") or {}
    if att.get("impl") == varlen_attention.NAME:
        line = (f"attention {when}: {att['varlen']} calls through swift_liger's packed-row kernel, "
                f"{att['sdpa']} handed to SDPA, {att['eager']} to the eager softcap softmax; document bounds "
                f"computed {att['bounds']} times")
        if att["sdpa"] or att["eager"]:
            line += " (SDPA / eager take cached decode steps, 4D masks and padding inside a row)"
        lines.append(line)
    ring = snap.get("rolling_cache")
    if ring is not None and (ring["generate"] or ring["own_cache"] or ring.get("unsized")):
        line = (f"rolling_cache {when}: {ring['generate']} generate calls of the policy on a fresh RollingKVCache, "
                f"{ring['forwards']} decoder forwards, {ring['graph_steps']} of them CUDA-graph decode steps "
                "(captured at a call's first, replayed after)")
        if ring["own_cache"]:
            line += f"; {ring['own_cache']} calls brought their own cache (or none) and kept it"
        if ring.get("unsized"):
            line += f"; {ring['unsized']} calls without a readable new-token budget kept transformers' cache"
        if ring.get("graph_error"):
            line += f"; capturing a decode step failed ({ring['graph_error']}), so decoding went on eagerly"
        lines.append(line)
    graphs = (snap.get("policy") or {}).get("graph_layers")
    if graphs and (graphs["captures"] or graphs["replays"] or graphs["eager"]):
        line = (f"graph_layers {when}: {_replayed(graphs)}, {graphs['captures']} captured "
                f"({graphs['capture_s']:.1f} s: a layer's first call per batch shape"
                + "".join(f"; {k.replace('_', ' ')} {v:.2f}" for k, v in (graphs.get("capture_parts_s") or {}).items()
                          if v >= 0.005) + ")")
        if graphs.get("compiled_ahead") is not None:
            line += (f"; {graphs['compiled_ahead']} kernels compiled ahead on a thread pool"
                     + (f" ({graphs['compile_ahead_failed']} failed there)" if graphs.get("compile_ahead_failed")
                        else ""))
        if graphs.get("compile_ahead_error"):
            line += f"; the compile-ahead pass stopped ({graphs['compile_ahead_error']})"
        if graphs["eager"]:
            line += "; run eagerly: " + "; ".join(f"{n} x {why}" for why, n in graphs["eager"].items())
        if graphs.get("inferred"):
            line += f"; batch shapes decided by a measured one, untimed: {graphs['inferred']}"
        if graphs.get("measured"):
            line += ("; timed per batch shape, a layer's forward eager vs replayed, max(host, GPU) ms per call: "
                     + "; ".join(_graph_timing(m) for m in graphs["measured"]))
        lines.append(line)
    sdpa = (snap.get("policy") or {}).get("sdpa")
    if sdpa and (sdpa["cudnn_calls"] or sdpa["torch_calls"]):
        line = (f"cudnn_attention {when}: {sdpa['cudnn_calls']} decoder-layer calls ran SDPA cuDNN-first, "
                f"{sdpa['torch_calls']} in torch's own order"
                + (" (torch's order starts with cuDNN here: nothing timed)" if sdpa.get("cudnn_already") else ""))
        if sdpa.get("measured"):
            line += ("; timed per batch shape, attention ms FlashAttention-2 vs cuDNN: "
                     + "; ".join(f"{m['rows']} x {m['tokens']} tokens "
                                 + ("refused" if m["flash_ms"] is None else f"{m['flash_ms']:.2f}") + " vs "
                                 + ("refused" if m["cudnn_ms"] is None else f"{m['cudnn_ms']:.2f}")
                                 + ("" if m.get("cudnn_first_ms") is None
                                    else f" (cuDNN's first call {m['cudnn_first_ms']:.2f})")
                                 + f" -> {m['chose']}" for m in sdpa["measured"]))
        lines.append(line)
    lora = snap.get("lora_fusion")
    if lora:
        line = (f"lora_fusion {when}: {lora['ops.lora_linear']} LoRA projection calls through ops.lora_linear, "
                f"{lora['peft']} through PEFT's forward")
        if graphs and graphs["replays"]:
            line += " (counted in Python: replayed layer passes run none, captures one)"
        if lora["peft"]:
            line += (" (lora_fusion takes plain LoRA on nn.Linear and bitsandbytes 4-bit layers; DoRA, 8-bit bases, "
                     "merged, disabled (a DPO reference pass) or several active adapters run PEFT's own forward)")
        lines.append(line)
    return lines


class RuntimeRecord(TrainerCallback):
    def __init__(self, trainer, args):
        self.trainer, self.args = trainer, args
        self.first = None
        self.attention_since = {}
        self.compiles = CompileWatch()
        self.profile = FirstStepProfile(rows_from_env())

    def _master(self):
        from swift.utils import is_master
        return is_master()

    def on_train_begin(self, args, state, control, **kwargs):
        for _, model in _models(self.trainer):
            call_counts(model, reset=True)
        self.attention_since = dict(varlen_attention.COUNTS)
        self.compiles.start()
        self.profile.start()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1 or self.first is not None:
            return
        self.compiles.stop()
        profile = self.profile.stop()
        if not self._master():
            return
        from swift.utils import get_logger

        self.first = snapshot(self.trainer, self.attention_since)
        compiles = self.compiles.summary()
        if compiles:
            self.first["triton_compiles"] = compiles
        if profile:
            self.first["profile"] = profile
        logger = get_logger()
        for line in describe(self.first) + [describe_compiles(compiles)] * bool(compiles) + [
                describe_profile(profile)] * bool(profile):
            logger.info(f"swift_liger: {line}")
        update_record(self.args, "runtime", {"first_step": self.first})

    def on_train_end(self, args, state, control, **kwargs):
        self.compiles.stop()   # a run that ended before its first optimizer step
        self.profile.stop()
        if not self._master():
            return
        total = snapshot(self.trainer, self.attention_since)
        update_record(self.args, "runtime", {"first_step": self.first, "total": total,
                                             "optimizer_steps": state.global_step})
        from swift.utils import get_logger
        for line in describe_run(total, state.global_step):
            get_logger().info(f"swift_liger: {line}")


def describe_run(total: dict, steps: int) -> list:
    """Log lines at the end of training: what graph_layers did over the whole run (rows of varying length meet a
    new batch shape, so captures go on after the first step; the graphs' memory is not in ms-swift's memory(GiB))."""
    g = (total.get("policy") or {}).get("graph_layers")
    if not g or not (g["captures"] or g["replays"]):
        return []
    line = (f"graph_layers over {steps} optimizer steps: {_replayed(g)}, {g['captures']} captured "
            f"({g['capture_s']:.1f} s); batch shapes: {g.get('keys_replayed', 0)} "
            f"kept for graphs, {len(g.get('measured') or [])} timings, {g.get('inferred', 0)} decided by a timed "
            "one")
    if g["eager"]:
        line += "; run eagerly: " + "; ".join(f"{n} x {why}" for why, n in g["eager"].items())
    if g.get("static_mib") is not None:
        line += f"; static buffers {g['static_mib']:.0f} MiB"
    if g.get("device_outside_torch_mib") is not None:
        line += (f"; GPU memory outside torch's allocator {g['device_outside_torch_mib']} MiB (the CUDA context, "
                 "cuBLAS workspaces, the captured graphs: not in memory(GiB))")
    return [line]


def _replayed(g: dict) -> str:
    """graph_layers' replay count for the log, the autograd-off passes' share named where there were any."""
    no_grad = g.get("no_grad_replays")
    return (f"{g['replays']} decoder-layer passes replayed from CUDA graphs"
            + (f" ({no_grad} of them forwards of autograd-off passes)" if no_grad else ""))


def _graph_timing(m: dict) -> str:
    """One graph_layers timing for the log: eager vs replayed ms per layer forward, or eager alone where the host
    issued it in well under the GPU's time and nothing was captured."""
    if m.get("graph_ms") is None:
        return (f"{m['rows']} x {m['tokens']} tokens {m['eager_ms']:.2f} eager (host {m['eager_host_ms']:.2f}, GPU "
                f"{m['eager_gpu_ms']:.2f}: GPU-bound, not captured) -> eager")
    return (f"{m['rows']} x {m['tokens']} tokens {m['eager_ms']:.2f} vs {m['graph_ms']:.2f}"
            + (f" (host {m['eager_host_ms']:.2f} / {m['graph_host_ms']:.2f}, GPU "
               f"{m['eager_gpu_ms']:.2f} / {m['graph_gpu_ms']:.2f})" if "eager_host_ms" in m else "")
            + f" -> {'graphs' if m['graphs'] else 'eager'}"
            + (f" (at {m['when']})" if m.get("when", "capture") != "capture" else ""))
