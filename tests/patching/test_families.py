"""The families beyond Llama/Mistral/Qwen2/Qwen3 on tiny random models (fp32, CPU): gemma, gemma2, gemma3_text,
phi3, glm4, qwen3_moe and the language model inside qwen2_5_vl / qwen3_vl.

Per family: the real Triton kernels (interpreter) against the unpatched model (eval logits, loss, every gradient);
each loss-head mode on the PyTorch references; which modules each fusion took; LoRA through lora_fusion against
PEFT's own forward; an adapter trained patched loads into an unpatched model with the same outputs, and one step
patched and unpatched saves the same adapter; revert and state_dict. Then what is particular to a family:
Gemma-2's logit softcap through the fused linear CE and the log-prob head, Qwen3-MoE's experts hook, router
logits and eager experts, the untouched vision towers.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from helpers import assert_grads_match, close_scaled as close

import swift_liger
from swift_liger import FAMILIES, call_counts
from swift_liger.fusions.loss_head.handle import head_for

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

VOCAB, SEQ, BATCH = 128, 10, 2
TEXT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)
# per family: config extras; softcap 0.05 makes Gemma's final_logit_softcapping change the loss of a tiny model
EXTRA = {
    "gemma": dict(hidden_act="gelu_pytorch_tanh"),
    "gemma2": dict(final_logit_softcapping=0.05, sliding_window=4, query_pre_attn_scalar=8),
    "gemma3_text": dict(final_logit_softcapping=0.05, sliding_window=4, query_pre_attn_scalar=8),
    "phi3": dict(partial_rotary_factor=0.5, hidden_act="silu"),
    "glm4": dict(partial_rotary_factor=0.5, hidden_act="silu"),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hidden_act="silu"),
}
VL = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
VISION = {"qwen2_5_vl": "visual", "qwen3_vl": "visual"}
NAMES = ["gemma", "gemma2", "gemma3_text", "phi3", "glm4", "qwen3_moe", "qwen2_5_vl", "qwen3_vl"]
# LoRA targets per family (the attention and MLP projections it has)
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]}
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(model_type: str, layers: int = 2, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model_type in VL:
        text = dict(TEXT, num_hidden_layers=layers, hidden_act="silu",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                      temporal_patch_size=1, spatial_merge_size=1, in_channels=3)
        if model_type == "qwen3_vl":
            vision.update(num_position_embeddings=16, deepstack_visual_indexes=[])
        cfg = AutoConfig.for_model(model_type, text_config={**text, **extra}, vision_config=vision)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, VL[model_type])(cfg).float()
    else:
        options = dict(TEXT, num_hidden_layers=layers, **EXTRA.get(model_type, {}))
        if model_type == "gemma3_text":
            options["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
        if model_type == "qwen3_moe":
            options["mlp_only_layers"] = list(range(1, layers, 2))   # odd layers dense: both MLP kinds
        cfg = AutoConfig.for_model(model_type, **{**options, **extra})
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norm weights away from their neutral value so a dropped weight cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (0.0 if model_type.startswith("gemma") else 1.0))
    return model


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return ids, labels


def pair(model_type: str, **kw):
    ref = build(model_type, **kw)
    return ref, copy.deepcopy(ref)





def instance_dicts(model) -> dict:
    return {name: sorted(k for k in m.__dict__ if k in ("forward", "_apply_gate", "_loss_function"))
            for name, m in model.named_modules()}


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def expected_patched(family: str, layers: int = 2) -> dict:
    f = FAMILIES[family]
    norms = 2 * layers + 1
    if family in ("gemma2", "gemma3_text", "glm4"):   # norms before and after attention and MLP
        norms = 4 * layers + 1
    counts = {"rms_norm": norms, "rope": layers, "swiglu": layers, "cross_entropy": 1}
    if torch.cuda.is_available():   # graph_layers installs only where CUDA graphs can replay
        counts["graph_layers"] = layers
    if f.qk_norm:
        counts["qk_norm_rope"] = layers   # q_norm/k_norm folded into the rotation: not counted as RMSNorms
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Real kernels (Triton interpreter on CPU)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NAMES)
def test_kernels_match_hf(family, device):
    ref, model = pair(family)
    ref, model = ref.to(device), model.to(device)
    report = swift_liger.apply(model)
    assert report.supported and report.cross_entropy_mode == "fused_linear", report
    assert not report.problems, report.problems
    ids, labels = (t.to(device) for t in batch())

    model.eval(), ref.eval()
    with torch.no_grad():
        close(model(ids).logits, ref(ids).logits, "eval logits")
        close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "eval loss (CE on logits)")

    model.train(), ref.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    assert call_counts(model)["fused_linear_cross_entropy"] == 1


# ---------------------------------------------------------------------------------------------------------------
# Wiring (reference backend)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("mode", ["fused_linear", "fused", "off"])
def test_train_loss_and_grads(torch_backend, family, mode):
    ref, model = pair(family)
    report = swift_liger.apply(model, cross_entropy=mode)
    assert report.cross_entropy_mode == mode
    ids, labels = batch()
    model.train(), ref.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    if mode != "fused_linear":
        close(out.logits, expected.logits, "logits")
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)


@pytest.mark.parametrize("family", NAMES)
def test_each_fusion_takes_its_modules(family):
    model = build(family, layers=2)
    report = swift_liger.apply(model)
    got = {k: v for k, v in report.patched.items() if v}
    assert got == expected_patched(family), (got, report.skipped)
    assert not report.problems
    assert report.activation == ("geglu" if family.startswith("gemma") else "swiglu")
    assert report.to_dict()["model_type"] == family


@pytest.mark.parametrize("family", NAMES)
def test_revert_and_state_dict(torch_backend, family):
    ref, model = pair(family)
    before, sd = instance_dicts(model), {k: v.clone() for k, v in model.state_dict().items()}
    swift_liger.apply(model)
    assert instance_dicts(model) != before
    after = model.state_dict()
    assert list(after) == list(sd) and all(torch.equal(after[k], sd[k]) for k in sd)
    swift_liger.revert(model)
    assert instance_dicts(model) == before
    ids, labels = batch()
    model.train(), ref.train()
    assert torch.equal(model(ids, labels=labels).loss, ref(ids, labels=labels).loss)


def lora_models(peft, family, seed=3, **lora):
    ref, model = pair(family)
    swift_liger.apply(model)
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
               target_modules=TARGETS.get(family, DEFAULT_TARGETS), **lora)
    out = []
    for m in (ref, model):
        torch.manual_seed(seed)
        out.append(peft.get_peft_model(m, peft.LoraConfig(**cfg)))
    return out


@pytest.mark.parametrize("family", NAMES)
def test_lora_same_loss_and_grads(torch_backend, family):
    peft = pytest.importorskip("peft")
    ref, model = lora_models(peft, family)
    ids, labels = batch()
    ref.train(), model.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "lora loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    counts = call_counts(model)
    assert counts["lora_fused"] > 0 and counts["fused_linear_cross_entropy"] == 1, counts


@pytest.mark.parametrize("family", NAMES)
def test_adapter_portable(torch_backend, family, tmp_path):
    """One AdamW step patched and unpatched gives the same adapter; the patched run's saved adapter loads into an
    unpatched model of the same weights and gives the same eval logits."""
    peft = pytest.importorskip("peft")
    ref, model = lora_models(peft, family)
    ids, labels = batch()
    for m in (ref, model):
        m.train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        m(ids, labels=labels).loss.backward()
        opt.step()
    sd, ref_sd = (peft.get_peft_model_state_dict(m, save_embedding_layers=False) for m in (model, ref))
    assert list(sd) == list(ref_sd)
    for k in sd:
        close(sd[k], ref_sd[k], k, atol=1e-5, rtol=1e-4)
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    loaded = peft.PeftModel.from_pretrained(build(family), tmp_path / "adapter")
    model.eval(), loaded.eval()
    with torch.no_grad():
        close(loaded(ids).logits, model(ids).logits, "logits of the loaded adapter")


# ---------------------------------------------------------------------------------------------------------------
# What is particular to a family
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_logit_softcap_through_fused_linear_and_logprobs(torch_backend, family):
    ref, model = pair(family)
    swift_liger.apply(model)
    ids, labels = batch()
    model.train(), ref.train()
    close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "softcapped loss")
    assert model.config.final_logit_softcapping == 0.05   # restored after the forward
    with torch.no_grad():
        nocap = build(family, final_logit_softcapping=None)
        assert abs(nocap(ids, labels=labels).loss.item() - ref(ids, labels=labels).loss.item()) > 1e-3
    # the preference-trainer path: log-probs from hidden states with the model's softcap
    handle = head_for(model)
    assert handle is not None
    with handle.emitting_hidden():
        out = model(ids)
    hidden = handle.take(out.logits)
    assert model.config.final_logit_softcapping == 0.05
    targets = ids[:, 1:]
    logps = handle.logprobs(hidden[:, :-1], targets)
    logps = logps[0] if isinstance(logps, tuple) else logps
    with torch.no_grad():
        expected = torch.log_softmax(ref(ids).logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    close(logps, expected, "log-probs")


def test_qwen3_moe_experts_hook_router_logits_and_eager_experts(torch_backend):
    ref, model = pair("qwen3_moe", output_router_logits=True)
    report = swift_liger.apply(model)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert experts and all("_apply_gate" in m.__dict__ for m in experts)
    assert not any("forward" in m.__dict__ for m in experts)   # the routing loop stays transformers'
    ids, labels = batch()
    model.train(), ref.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert expected.aux_loss is not None
    close(out.loss, expected.loss, "loss with the router aux loss")
    close(out.aux_loss, expected.aux_loss, "aux loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    swift_liger.revert(model)
    assert not any("_apply_gate" in m.__dict__ for m in experts)
    assert report.patched["swiglu"] == 2

    eager = build("qwen3_moe", experts_implementation="eager")
    eager.config._experts_implementation = "eager"
    for m in eager.modules():
        if hasattr(m, "config"):
            m.config._experts_implementation = "eager"
    report = swift_liger.apply(eager)
    assert report.patched["swiglu"] == 1 and not report.problems   # the dense layer only
    assert any("experts_implementation 'eager'" in s["reason"] for s in report.skipped)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_untouched(family):
    model = build(family)
    vision = getattr(model.model, VISION[family])
    before = instance_dicts(vision)
    swift_liger.apply(model)
    assert instance_dicts(vision) == before
    assert all(not v for v in before.values())


def test_unsupported_type_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swift_liger.apply(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))
    assert not report.supported
    text = " ".join(str(w.message) for w in caught)
    for name in ("gemma2", "glm4", "phi3", "qwen3_moe", "qwen2_5_vl"):
        assert name in text, text


def test_readme_lists_every_family():
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("<!-- families:begin"):text.index("<!-- families:end")]
    listed = set(re.findall(r"`([a-z0-9_]+)`", section.split("\n|---")[1]))
    assert set(FAMILIES) <= listed, sorted(set(FAMILIES) - listed)
