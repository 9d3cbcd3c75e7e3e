"""fused_projections: under no_grad one GEMM per q/k/v and per gate/up group gives the unpatched logits (fp32,
CPU) with 4 instead of 7 projection GEMMs per layer; recorded calls (training) run every projection as before with
equal losses and gradients; parameters keep their values, state_dict and memory, and revert gives each its own
storage again; a group whose weights were re-pointed elsewhere falls back; PEFT LoRA wrapped afterwards and
generate with RollingKVCache agree with the unpatched model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_match, close_scaled, tiny_causal_lm

import swift_liger
from swift_liger.cache import RollingKVCache

pytest.importorskip("transformers")

ONLY = dict(rms_norm=False, rope=False, swiglu=False, cross_entropy="off", fused_projections=True)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


class LinearCalls:
    """Counts F.linear calls and the output columns each one produced."""

    def __init__(self, monkeypatch):
        self.widths = []
        real = F.linear

        def counted(x, w, b=None):
            self.widths.append(w.shape[0])
            return real(x, w, b)
        monkeypatch.setattr(F, "linear", counted)


def ids(seed=0, batch=2, seq=7, vocab=128):
    return torch.randint(2, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_no_grad_logits_equal_with_fewer_gemms(family, monkeypatch):
    model = tiny_causal_lm(family, layers=2)
    ref = copy.deepcopy(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = swift_liger.apply(model, **ONLY)
    assert report.patched["fused_projections"] == 2 * 2   # one attention and one MLP group per layer
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items()) and model.state_dict().keys() == sd.keys()
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    x = ids()
    calls = LinearCalls(monkeypatch)
    with torch.no_grad():
        got = model(input_ids=x).logits
    fused_widths = calls.widths
    calls.widths = []
    with torch.no_grad():
        want = ref(input_ids=x).logits
    close_scaled(got, want, "logits", atol=1e-6, rtol=1e-5)
    # per layer: q|k|v, o, gate|up, down (+ the lm_head), against q, k, v, o, gate, up, down
    assert len(fused_widths) == 2 * 4 + 1 and len(calls.widths) == 2 * 7 + 1
    assert fused_widths[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_recorded_calls_unchanged(family):
    model = tiny_causal_lm(family, layers=2)
    ref = copy.deepcopy(model)
    swift_liger.apply(model, **ONLY)
    x = ids(1)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    want = ref(input_ids=x, labels=x).loss
    want.backward()
    close_scaled(loss, want, "loss", atol=1e-6, rtol=1e-6)
    assert_grads_match(model, ref, atol=1e-6, rtol=1e-5)


def test_revert_gives_each_parameter_its_storage():
    model = tiny_causal_lm("llama", layers=2)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    swift_liger.apply(model, **ONLY)
    swift_liger.revert(model)
    attn = model.model.layers[0].self_attn
    ptrs = {m.weight.untyped_storage().data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(ptrs) == 3 and "forward" not in attn.q_proj.__dict__
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_re_pointed_weights_fall_back(monkeypatch):
    model = tiny_causal_lm("llama", layers=1)
    swift_liger.apply(model, **ONLY)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data.clone() * 2   # e.g. a state dict loaded with assign
    ref = copy.deepcopy(model)
    swift_liger.revert(ref)
    calls = LinearCalls(monkeypatch)
    x = ids(2)
    with torch.no_grad():
        got = model(input_ids=x).logits
    assert calls.widths == [32, 16, 16, 32, 128, 32, 128]   # q, k, v, o separately; gate|up still one; down; head
    with torch.no_grad():
        close_scaled(got, ref(input_ids=x).logits, "logits", atol=1e-6, rtol=1e-5)
    group = attn.q_proj.__dict__["_swift_liger_fused_group"][0]
    assert group.weight is None   # the stale buffer is let go


def test_other_input_or_order_runs_its_own_projection():
    model = tiny_causal_lm("llama", layers=1)
    swift_liger.apply(model, **ONLY)
    attn = model.model.layers[0].self_attn
    a, b = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        q = attn.q_proj(a)
        k_other = attn.k_proj(b)       # another input: computed on its own, a's pending blocks untouched
        k, v = attn.k_proj(a), attn.v_proj(a)
        a.mul_(2)                      # in place: a's next call is a new product
        q2 = attn.q_proj(a)
    for got, m, x in ((q, attn.q_proj, a / 2), (k_other, attn.k_proj, b), (k, attn.k_proj, a / 2),
                      (v, attn.v_proj, a / 2), (q2, attn.q_proj, a)):
        close_scaled(got, F.linear(x, m.weight, m.bias), "projection", atol=1e-6, rtol=1e-5)


def test_peft_lora_after_the_patch():
    peft = pytest.importorskip("peft")
    model = tiny_causal_lm("llama", layers=2)
    ref = copy.deepcopy(model)
    swift_liger.apply(model, **ONLY)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
               init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    torch.manual_seed(3)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**cfg))
    x = ids(4)
    with torch.no_grad():
        close_scaled(model(input_ids=x).logits, ref(input_ids=x).logits, "logits", atol=1e-6, rtol=1e-5)


def test_generate_with_rolling_cache():
    model = tiny_causal_lm("llama", layers=2, attn="sdpa").eval()
    ref = copy.deepcopy(model)
    swift_liger.apply(model, **ONLY)
    x = ids(5, batch=1, seq=6)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = model.generate(x, past_key_values=RollingKVCache(model, window=8, sinks=2), **kw)
    want = ref.generate(x, past_key_values=RollingKVCache(ref, window=8, sinks=2), **kw)
    assert torch.equal(got, want)


def test_packed_projections_are_left_alone():
    model = tiny_causal_lm("phi3", layers=1)
    report = swift_liger.apply(model, **ONLY)
    assert report.patched["fused_projections"] == 0   # Phi-3 packs qkv_proj and gate_up_proj already


def test_deep_copy_uses_its_own_weights():
    """A deep copy (ms-swift's DPO reference model) computes with its own parameters, patched or reverted."""
    model = tiny_causal_lm("llama", layers=2)
    swift_liger.apply(model, **ONLY)
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p in copy_.parameters():
            p.mul_(0.5)
    plain = copy.deepcopy(copy_)
    swift_liger.revert(plain)
    x = ids(6)
    with torch.no_grad():
        close_scaled(copy_(input_ids=x).logits, plain(input_ids=x).logits, "copy", atol=1e-6, rtol=1e-5)
        fresh = tiny_causal_lm("llama", layers=2)
        close_scaled(model(input_ids=x).logits, fresh(input_ids=x).logits, "original", atol=1e-6, rtol=1e-5)
