"""models.head: log-probs from a patched model's hidden states equal the log-softmax of its real logits."""
from __future__ import annotations

import copy

import pytest
import torch

import swift_liger
from swift_liger.fusions.loss_head import handle as H
from swift_liger import call_counts
from swift_liger.patching.state import STATE_ATTR

from test_patcher import ALL_OFF, VOCAB, batch, build, close

peft = pytest.importorskip("peft")


def stock_logps(model, ids, labels):
    """What a preference trainer does with outputs.logits: log_softmax, gather, zero the masked positions."""
    logits = model(input_ids=ids).logits
    mask = labels != -100
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(mask, logp, 0.0), torch.where(mask, logits.float().mean(-1), 0.0)


def fused_logps(model, ids, labels):
    handle = H.head_for(model)
    assert handle is not None, H.why_not(model)
    with handle.emitting_hidden():
        out = model(input_ids=ids)
    hidden = handle.take(out.logits)
    assert hidden is not None and hidden.shape[-1] == model.config.hidden_size
    res = handle.logprobs(hidden, labels, return_logit_sum=True)
    mask = labels != -100
    return res.logps, torch.where(mask, res.logit_sum / handle.vocab_size, 0.0)


def shifted(labels):
    """labels[t] = the token predicted at t (a trainer's roll), nothing predicted at the last position."""
    out = torch.roll(labels, -1, dims=1)
    out[:, -1] = -100
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_logps_and_grads_match_real_logits(family, tuner):
    ref = build(family)
    model = copy.deepcopy(ref)
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    if tuner == "lora":
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                               init_lora_weights=False)
        torch.manual_seed(3)
        ref = peft.get_peft_model(ref, lora)
        torch.manual_seed(3)
        model = peft.get_peft_model(model, copy.deepcopy(lora))
    ids, labels = batch()
    labels = shifted(labels)
    for m in (ref, model):
        m.train()
    expected, expected_mean = stock_logps(ref, ids, labels)
    got, got_mean = fused_logps(model, ids, labels)
    close(got, expected, "logps")
    close(got_mean, expected_mean, "mean logits")
    weights = torch.linspace(0.5, 2.0, labels.numel()).view(labels.shape)   # any per-token gradient
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            close(p.grad, named[name].grad, name)
    counts = call_counts(model)
    assert counts["fused_linear_logprobs"] == 1 and counts["lm_head_logits"] == 0
    # outside the block the model is the stock model: real logits, counted
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == VOCAB
    assert call_counts(model)["lm_head_logits"] == 1


def test_no_grad_reference_pass_and_eval():
    model = build("llama")
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    ids, labels = batch()
    labels = shifted(labels)
    model.eval()
    with torch.no_grad():
        expected, _ = stock_logps(model, ids, labels)
        got, _ = fused_logps(model, ids, labels)
    close(got, expected, "logps")


def test_replaced_head_stands_aside():
    model = build("llama")
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    handle = H.head_for(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert H.head_for(wrapped) is None and "modules_to_save" in H.why_not(wrapped)
    assert not handle.usable()
    ids, _ = batch()
    with handle.emitting_hidden():
        out = wrapped(input_ids=ids)
    assert out.logits.shape[-1] == VOCAB and handle.take(out.logits) is None   # real logits, the caller's own path


def test_not_applicable_reasons():
    assert "not patched" in H.why_not(build("llama"))
    model = build("llama")
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused"})
    assert H.head_for(model) is None and "cross_entropy=fused" in H.why_not(model)


def test_take_returns_the_models_own_tensor():
    """accelerate's mixed-precision wrapper hands the trainer an fp32 copy of every output: take() gives back the
    model's tensor (dtype, graph), also for the suffix trainers slice; anything else is refused."""
    model = build("llama")
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    handle = H.head_for(model)
    ids, _ = batch()
    for transform in (lambda t: t.to(torch.float64), lambda t: t[:, 3:], lambda t: t.double()[:, 2:]):
        with handle.emitting_hidden():
            out = model(input_ids=ids)
        emitted = model.__dict__[STATE_ATTR].parts["cross_entropy"].emitted
        got = handle.take(transform(out.logits))
        assert got.dtype == emitted.dtype and got.grad_fn is not None
        assert got.shape == transform(out.logits).shape
        assert torch.equal(got, emitted[:, emitted.shape[1] - got.shape[1]:])
    for bad in (lambda t: t[:1], lambda t: t[..., :-1], lambda t: t.reshape(-1, t.shape[-1])):
        with handle.emitting_hidden():
            out = model(input_ids=ids)
        with pytest.raises(RuntimeError, match="refusing to treat it as logits"):
            handle.take(bad(out.logits))


@pytest.mark.parametrize("num_items", [False, True])
def test_every_label_ignored_gives_what_transformers_gives(num_items):
    """A batch whose labels are all -100: transformers' loss is NaN (0 / 0, mean or divided by num_items_in_batch)
    with zero gradients; the patched head returns the same, not 0.0."""
    from test_patcher import pair
    ref, model = pair("llama")
    swift_liger.apply(model)
    ids, labels = batch()
    labels.fill_(-100)
    kw = {"num_items_in_batch": torch.tensor(0)} if num_items else {}
    want = ref(ids, labels=labels, **kw).loss
    got = model(ids, labels=labels, **kw).loss
    assert want.isnan() and got.isnan()
    got.backward(), want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert p.grad is not None and not p.grad.isnan().any() and torch.equal(p.grad == 0, q.grad == 0), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_predicting_gives_the_stock_logits_arg_max(family):
    """handle.predicting(): the fused loss of a training forward with labels (no logits returned) also yields each
    position's arg max, aligned with the stock model's logits (position t's prediction at t), the last position of
    each row included; the loss is unchanged. Outside the block nothing is kept."""
    ref = build(family)
    model = copy.deepcopy(ref)
    swift_liger.apply(model, **{**ALL_OFF, "cross_entropy": "fused_linear"})
    ids, labels = batch()
    for m in (ref, model):
        m.train()
    stock = ref(input_ids=ids, labels=labels)
    handle = H.head_for(model)
    with handle.predicting() as preds:
        out = model(input_ids=ids, labels=labels)
    assert out.logits is None and len(preds) == 1
    assert preds[0].dtype == torch.int64 and preds[0].numel() == labels.numel()
    assert torch.equal(preds[0].view(labels.shape), stock.logits.argmax(-1))
    close(out.loss, stock.loss, "loss")
    out = model(input_ids=ids, labels=labels)
    assert model.__dict__[STATE_ATTR].parts["cross_entropy"].argmax is None
