"""offload_checkpoints: decoder-layer checkpoints kept off the device give the losses and gradients of HF's own
gradient checkpointing (fp32, CPU, where the offload is a host copy on the same code path): checkpointing enabled
before or after apply, reentrant or not, LoRA with dropout (same masks in the recompute), frozen embeddings without
enable_input_require_grads, under autocast, with tiled_mlp; every layer's input is prefetched by the layer after it
except the last one's; deep copies and revert."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_grads_match, close_scaled as close, tiny_causal_lm

import swift_liger
from swift_liger.patching.state import STATE_ATTR

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 128, 3


def build(model_type="llama", seed=0):
    return tiny_causal_lm(model_type, layers=LAYERS, vocab=VOCAB, attn="eager", seed=seed)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels





def offload_calls(model):
    roots = [m for m in model.modules() if STATE_ATTR in m.__dict__]
    return dict(roots[0].__dict__[STATE_ATTR].parts["offload_checkpoints"].calls)


def enable(m, reentrant, inputs=True):
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if inputs:
        m.enable_input_require_grads()
    m.train()


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("when", ["before_apply", "after_apply"])
def test_same_loss_and_grads_as_hf_checkpointing(torch_backend, family, reentrant, when):
    ref = build(family)
    model = copy.deepcopy(ref)
    enable(ref, reentrant)
    if when == "before_apply":
        enable(model, reentrant)
    report = swift_liger.apply(model, offload_checkpoints=True)
    assert report.patched["offload_checkpoints"] == LAYERS and not report.problems
    if when == "after_apply":
        enable(model, reentrant)
    ids, labels = batch()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    assert offload_calls(model) == {"offloaded": LAYERS, "prefetched": LAYERS - 1, "fetched_late": 1}


@pytest.mark.parametrize("inputs_require_grad", [True, False])
def test_lora_dropout_and_frozen_embeddings(torch_backend, inputs_require_grad):
    """LoRA with dropout: the recompute draws the forward's masks. Without enable_input_require_grads no layer input
    requires grad, and the adapters still get their gradients (HF's non-reentrant checkpoint is the reference)."""
    peft = pytest.importorskip("peft")
    ref = build("qwen3")
    model = copy.deepcopy(ref)
    swift_liger.apply(model, offload_checkpoints=True)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.2, init_lora_weights=False,
                target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    models = []
    for m in (ref, model):
        torch.manual_seed(5)
        m = peft.get_peft_model(m, peft.LoraConfig(**lora))
        enable(m, reentrant=False, inputs=inputs_require_grad)
        models.append(m)
    ref, model = models
    ids, labels = batch()
    torch.manual_seed(11)
    expected = ref(ids, labels=labels)
    torch.manual_seed(11)
    out = model(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().sum() > 0 for _, g in grads)
    assert_grads_match(model, ref)


def test_autocast_and_tiled_mlp_together(torch_backend):
    ref = build("llama")
    model = copy.deepcopy(ref)
    swift_liger.apply(model, offload_checkpoints=True, tiled_mlp=8)
    for m in (ref, model):
        enable(m, reentrant=True)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert abs(out.loss.item() - expected.loss.item()) < 2e-2
    out.loss.backward(), expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-2 * max(1.0, q.grad.abs().max().item()), rtol=5e-2,
                                   msg=lambda m: f"{name}: {m}")


def test_kernels_with_offload(device):
    ref = build("llama").to(device)
    model = copy.deepcopy(ref)
    swift_liger.apply(model, offload_checkpoints=True)
    for m in (ref, model):
        enable(m, reentrant=False)
    ids, labels = (t.to(device) for t in batch())
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)


def test_no_checkpointing_eval_deepcopy_and_revert(torch_backend):
    ref = build()
    model = copy.deepcopy(ref)
    swift_liger.apply(model, offload_checkpoints=True)
    ids, labels = batch()
    model.train(), ref.train()
    close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "without checkpointing")
    assert offload_calls(model)["offloaded"] == 0   # nothing to offload without gradient checkpointing
    enable(model, reentrant=False)
    with torch.no_grad():
        model(ids, labels=labels)
    assert offload_calls(model)["offloaded"] == 0   # no graph, no checkpoint
    clone = copy.deepcopy(model)
    clone_loss = clone(ids, labels=labels).loss
    clone_loss.backward()
    assert offload_calls(clone) == {"offloaded": LAYERS, "prefetched": LAYERS - 1, "fetched_late": 1}
    assert offload_calls(model)["offloaded"] == 0   # the copy has its own offloader
    enable(ref, reentrant=False)
    close(clone_loss, ref(ids, labels=labels).loss, "deep copy")
    swift_liger.revert(model)
    assert "_set_gradient_checkpointing" not in model.__dict__
    layers = model.model.layers
    assert all(layer._gradient_checkpointing_func.func is torch.utils.checkpoint.checkpoint for layer in layers)


@pytest.mark.parametrize("first", [1, 2, 99])
def test_partial_offload_first_n_layers(torch_backend, first):
    """offload_checkpoints=N: the first N decoder layers' checkpoints go to the host, the others keep HF's own
    checkpoint function; same loss and gradients. N above the layer count offloads every layer."""
    ref = build("llama")
    model = copy.deepcopy(ref)
    enable(ref, False)
    enable(model, False)
    report = swift_liger.apply(model, offload_checkpoints=first)
    n = min(first, LAYERS)
    assert report.patched["offload_checkpoints"] == n
    from swift_liger.patching.offload import checkpoint_offloaded
    assert [getattr(layer._gradient_checkpointing_func, "func", None) is checkpoint_offloaded
            for layer in model.model.layers] == [i < n for i in range(LAYERS)]
    ids, labels = batch()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    assert offload_calls(model)["offloaded"] == n


@pytest.mark.parametrize("value,canonical", [(True, True), (False, False), (0, False), (3, 3), ("5", 5),
                                             ("true", True), ("off", False)])
def test_offload_checkpoints_values(value, canonical):
    from swift_liger.config import LigerConfig
    from swift_liger.fusions.offload_checkpoints import parse_flag
    assert LigerConfig(offload_checkpoints=parse_flag(value)).offload_checkpoints == canonical


@pytest.mark.parametrize("value", [-1, 1.5, "two"])
def test_offload_checkpoints_bad_values(value):
    from swift_liger.config import LigerConfig
    from swift_liger.fusions.offload_checkpoints import parse_flag
    with pytest.raises((ValueError, TypeError), match="offload_checkpoints"):
        LigerConfig(offload_checkpoints=parse_flag(value))
