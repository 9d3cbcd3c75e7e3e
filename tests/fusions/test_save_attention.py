"""save_attention: with gradient checkpointing, each decoder layer's SDPA output is kept by the forward and reused by
the recompute (one fused attention kernel call per layer per step instead of two), with the losses and gradients of
HF's own checkpointing (fp32, CPU flash SDPA). Counted through the policy and checked by counting the kernel calls
themselves; checkpointing enabled before or after apply; beside offload_checkpoints on the first N layers; deep
copies, revert, a padded (masked) batch that takes SDPA's math path, and the first-step log line."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_grads_match, close_scaled as close, tiny_causal_lm

import swift_liger
from swift_liger import call_counts
from swift_liger.patching import checkpoint_funcs

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 128, 3


def build(model_type="llama", seed=0):
    return tiny_causal_lm(model_type, layers=LAYERS, vocab=VOCAB, attn="sdpa", seed=seed)


def batch(seed=0, rows=2, t=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, t), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def enable(m, reentrant=False):
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    m.enable_input_require_grads()
    m.train()


class CountAttention(TorchDispatchMode):
    """Counts fused SDPA kernel calls (forward ops only) below autograd."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.ops = set(checkpoint_funcs.attention_ops())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def step(model, ids, labels, **kw):
    with CountAttention() as mode:
        out = model(ids, labels=labels, **kw)
        out.loss.backward()
    return out, mode.n


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("when", ["before_apply", "after_apply"])
def test_same_loss_and_grads_one_attention_call_per_layer(torch_backend, family, when):
    ref = build(family)
    model = copy.deepcopy(ref)
    enable(ref, reentrant=True)   # HF's own checkpointing as ms-swift runs it (reentrant)
    if when == "before_apply":
        enable(model)
    report = swift_liger.apply(model, save_attention=True)
    assert report.patched["save_attention"] == LAYERS and not report.problems
    if when == "after_apply":
        enable(model)
    ids, labels = batch()
    expected, ref_calls = step(ref, ids, labels)
    out, calls = step(model, ids, labels)
    close(out.loss, expected.loss, "loss")
    assert_grads_match(model, ref)
    assert ref_calls == 2 * LAYERS and calls == LAYERS   # HF recomputes attention; we reuse the forward's
    assert call_counts(model)["saved_attention"] == {"kept": LAYERS}


def test_beside_partial_offload_and_under_autocast(torch_backend):
    ref = build()
    model = copy.deepcopy(ref)
    enable(ref)
    report = swift_liger.apply(model, save_attention=True, offload_checkpoints=2)
    assert report.patched["offload_checkpoints"] == 2 and report.patched["save_attention"] == LAYERS - 2
    enable(model)
    ids, labels = batch(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = step(ref, ids, labels)
        out, calls = step(model, ids, labels)
    close(out.loss, expected.loss, "loss", atol=1e-2, rtol=1e-2)
    assert_grads_match(model, ref, atol=3e-2, rtol=3e-2)
    assert calls == 2 * 2 + (LAYERS - 2)   # offloaded layers recompute attention, the last one reuses it
    counts = call_counts(model)
    assert counts["saved_attention"] == {"kept": 1}
    assert counts["offloaded_checkpoints"]["offloaded"] == 2


def test_every_layer_offloaded_is_said(torch_backend):
    model = build()
    report = swift_liger.apply(model, save_attention=True, offload_checkpoints=True)
    assert report.patched["save_attention"] == 0 and report.patched["offload_checkpoints"] == LAYERS
    assert any(s["fusion"] == "save_attention" and "offloaded" in s["reason"] for s in report.skipped)


def test_masked_batch_takes_math_path_and_stays_exact(torch_backend):
    ref = build()
    model = copy.deepcopy(ref)
    enable(ref)
    swift_liger.apply(model, save_attention=True)
    enable(model)
    ids, labels = batch(2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0   # left padding: SDPA gets a mask
    labels[1, :4] = -100
    expected, _ = step(ref, ids, labels, attention_mask=mask)
    out, _ = step(model, ids, labels, attention_mask=mask)
    close(out.loss, expected.loss, "loss")
    assert_grads_match(model, ref)


def test_deepcopy_and_revert(torch_backend):
    ref = build()
    model = copy.deepcopy(ref)
    swift_liger.apply(model, save_attention=True)
    twin = copy.deepcopy(model)
    enable(twin)
    enable(ref)
    ids, labels = batch(3)
    expected, _ = step(ref, ids, labels)
    out, calls = step(twin, ids, labels)
    close(out.loss, expected.loss, "loss")
    assert calls == LAYERS and call_counts(twin)["saved_attention"] == {"kept": LAYERS}
    assert call_counts(model)["saved_attention"] == {"kept": 0}   # the original's counters
    swift_liger.revert(model)
    enable(model)
    model.zero_grad(set_to_none=True)
    _, calls = step(model, ids, labels)
    assert calls == 2 * LAYERS   # HF's checkpointing again
    assert "_set_gradient_checkpointing" not in model.__dict__


def test_first_step_log_line():
    from swift_liger.integration.runtime import describe
    lines = describe({"policy": {"cross_entropy_mode": "off", "saved_attention": {"kept": 28}}})
    assert any("save_attention in the first step: 28 attention outputs kept in the forward for the recompute" in x
               for x in lines)
