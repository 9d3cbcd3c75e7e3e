"""swift_liger.apply / revert on tiny random llama, mistral, qwen2, qwen3 models (fp32, CPU).

Tests named test_kernels_* run the real Triton kernels (interpreter on CPU, as conftest sets up). The rest test the
patcher's wiring with the ops' PyTorch references (SWIFT_LIGER_BACKEND=torch), which keeps the suite fast: the
patched forwards, loss plumbing and bookkeeping are the same code either way.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest
import torch

from helpers import assert_grads_match, close_scaled as close

import swift_liger
from swift_liger import FAMILIES, LigerConfig, PatchReport, get_report, keep_logits
from swift_liger.fusions.rope import identity_forward
from swift_liger import call_counts
from swift_liger.patching.rebind import rebuild_with_globals

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

FAMILY_NAMES = ["llama", "mistral", "qwen2", "qwen3"]
VOCAB, SEQ, BATCH = 128, 8, 2
ALL_OFF = dict(rms_norm=False, rope=False, swiglu=False, cross_entropy="off", qk_norm_rope=False, lora_fusion=False,
               graph_layers=False, cudnn_attention=False, drop_pad_mask=False)


def build(model_type: str, layers: int = 2, seed: int = 0, **extra) -> torch.nn.Module:
    options = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, hidden_act="silu",
                   tie_word_embeddings=model_type == "qwen3", pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg = AutoConfig.for_model(model_type, **{**options, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norm weights away from 1 so a dropped weight cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt tokens
    labels[1, -2:] = -100  # padding
    return ids, labels


def pair(model_type: str, **kw):
    ref = build(model_type, **kw)
    return ref, copy.deepcopy(ref)





def instance_forwards(model) -> dict:
    """module name -> set of patched attributes ('forward' / '_loss_function') on that instance."""
    out = {}
    for name, m in model.named_modules():
        keys = {k for k in ("forward", "_old_forward", "_loss_function") if k in m.__dict__}
        if keys:
            out[name] = keys
    return out


def patched_kinds(model, family) -> dict:
    """Which module kinds carry an instance forward."""
    f = FAMILIES[family]
    kinds = {"rms_norm": 0, "attention": 0, "mlp": 0, "qk_identity": 0, "lm_head": 0, "causal_lm": 0, "loss": 0}
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        cls = type(m).__name__
        if "_loss_function" in m.__dict__:
            kinds["loss"] += 1
        if fwd is None:
            continue
        if cls in f.rms_norm:
            kinds["qk_identity" if fwd.__func__ is identity_forward else "rms_norm"] += 1
        elif cls in f.attention:
            kinds["attention"] += 1
        elif cls in f.mlp:
            kinds["mlp"] += 1
        elif cls in f.causal_lm:
            kinds["causal_lm"] += 1
        elif name.endswith("lm_head"):
            kinds["lm_head"] += 1
    return kinds


def module_dict_keys(model) -> dict:
    return {name: sorted(m.__dict__) for name, m in model.named_modules()}


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def assert_bf16_loss_and_fp32_adapter_grads_match(out, expected, model, ref):
    """bf16 model with fp32 adapters against PEFT's: loss and adapter gradients at bf16 tolerances (backward run
    here), every trainable gradient fp32."""
    assert abs(out.loss.item() - expected.loss.item()) < 2e-2 * max(1.0, abs(expected.loss.item()))
    out.loss.backward(), expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad, q.grad, atol=5e-2 * max(1.0, q.grad.abs().max().item()), rtol=5e-2,
                                       msg=lambda m: f"{name}: {m}")


def checkpointed_training(models, use_reentrant):
    """Gradient checkpointing on PEFT models (inputs made to require grad, as ms-swift does), train mode."""
    for m in models:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        m.enable_input_require_grads()
        m.train()


def lora_pair(peft, ref, model, seed, **lora):
    """Both models wrapped with the same LoRA config and the same initial adapter weights."""
    out = []
    for m in (ref, model):
        torch.manual_seed(seed)
        out.append(peft.get_peft_model(m, peft.LoraConfig(**lora)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Real kernels (Triton interpreter on CPU): all fusions on, 1 layer to stay fast
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_kernels_match_hf(family, device):
    ref, model = pair(family, layers=1)
    ref, model = ref.to(device), model.to(device)
    report = swift_liger.apply(model)
    assert report.supported and report.cross_entropy_mode == "fused_linear"
    ids, labels = (t.to(device) for t in batch())

    model.eval(), ref.eval()
    with torch.no_grad():
        close(model(ids).logits, ref(ids).logits, "eval logits")
        close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "eval loss (CE on logits)")

    model.train(), ref.train()
    out = model(ids, labels=labels)
    expected = ref(ids, labels=labels)
    assert out.logits is None  # training with labels: loss only, logits never materialised
    close(out.loss, expected.loss, "loss")
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


def test_kernels_generate_qwen3(device):
    ref, model = pair("qwen3", layers=1)
    ref, model = ref.to(device), model.to(device)
    swift_liger.apply(model)
    ids = batch()[0].to(device)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref.eval(), model.eval()
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


# ---------------------------------------------------------------------------------------------------------------
# Wiring (reference backend)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("mode", ["fused_linear", "fused", "off"])
def test_train_loss_and_grads(torch_backend, family, mode):
    ref, model = pair(family)
    report = swift_liger.apply(model, cross_entropy=mode)
    assert report.cross_entropy_mode == mode
    ids, labels = batch()
    model.train(), ref.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    if mode == "fused_linear":
        assert out.logits is None
    else:
        close(out.logits, expected.logits, "logits")
    close(out.loss, expected.loss, "loss")
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_eval_logits_and_eval_loss(torch_backend, family):
    ref, model = pair(family)
    swift_liger.apply(model)
    ids, labels = batch()
    model.eval(), ref.eval()
    with torch.no_grad():
        close(model(ids).logits, ref(ids).logits, "logits")
        out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is not None  # eval with labels: logits as before, loss from the fused CE
    close(out.logits, expected.logits, "logits")
    close(out.loss, expected.loss, "loss")


@pytest.mark.parametrize("mode", ["fused_linear", "fused"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_num_items_in_batch_and_shift_labels(torch_backend, family, mode):
    ref, model = pair(family)
    swift_liger.apply(model, cross_entropy=mode)
    ids, labels = batch()
    model.train(), ref.train()
    for kw in (dict(num_items_in_batch=7), dict(num_items_in_batch=torch.tensor(11))):
        close(model(ids, labels=labels, **kw).loss, ref(ids, labels=labels, **kw).loss, str(kw))
    shift = torch.randint(0, VOCAB, (BATCH, SEQ))
    shift[0, :4] = -100
    close(model(ids, labels=labels, shift_labels=shift).loss, ref(ids, labels=labels, shift_labels=shift).loss,
          "shift_labels")


def test_fused_linear_tuple_output_and_keep_logits(torch_backend):
    ref, model = pair("llama")
    swift_liger.apply(model)
    ids, labels = batch()
    model.train(), ref.train()
    out = model(ids, labels=labels, return_dict=False)
    expected = ref(ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(expected) - 1  # the logits slot is dropped
    close(out[0], expected[0], "loss")
    with keep_logits(model):
        kept = model(ids, labels=labels)
    close(kept.logits, expected[1], "logits kept")
    close(kept.loss, expected[0], "loss kept")
    assert model(ids, labels=labels).logits is None  # back to loss-only after the block
    # replacing loss_function or lm_head afterwards disables the hidden-state shortcut instead of breaking
    model.loss_function = ref.loss_function
    close(model(ids, labels=labels).logits, expected[1], "user loss_function")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_toggles_switch_exactly_their_fusion(family):
    layers = 2
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    cases = {
        "rms_norm": (dict(rms_norm=True), {"rms_norm": norms}),
        "rope": (dict(rope=True), {"attention": layers}),
        "swiglu": (dict(swiglu=True), {"mlp": layers}),
        "fused": (dict(cross_entropy="fused"), {"loss": 1}),
        "fused_linear": (dict(cross_entropy="fused_linear"), {"loss": 1, "lm_head": 1, "causal_lm": 1}),
        # alone it wraps the attention and MLP forwards (PEFT's LoRA arrives after patching); not a counted swap
        "lora_fusion": (dict(lora_fusion=True), {"attention": layers, "mlp": layers}),
    }
    if family == "qwen3":
        cases["qk_norm_rope"] = (dict(rope=True, qk_norm_rope=True), {"attention": layers, "qk_identity": 2 * layers})
        cases["qk+rms"] = (dict(rope=True, qk_norm_rope=True, rms_norm=True),
                           {"attention": layers, "qk_identity": 2 * layers, "rms_norm": 2 * layers + 1})
    for case, (switches, expected_kinds) in cases.items():
        model = build(family)
        report = swift_liger.apply(model, **{**ALL_OFF, **switches})
        kinds = patched_kinds(model, family)
        want = {k: expected_kinds.get(k, 0) for k in kinds}
        assert kinds == want, (case, kinds)
        counts = {k: v for k, v in report.patched.items() if v}
        exp_counts = {
            "rms_norm": {"rms_norm": want["rms_norm"]},
            "rope": {"rope": layers},
            "swiglu": {"swiglu": layers},
            "fused": {"cross_entropy": 1},
            "fused_linear": {"cross_entropy": 1},
            "qk_norm_rope": {"rope": layers, "qk_norm_rope": layers},
            "qk+rms": {"rope": layers, "qk_norm_rope": layers, "rms_norm": 2 * layers + 1},
            "lora_fusion": {},
        }[case]
        assert counts == exp_counts, (case, counts)
        assert not report.problems, report.problems
        json.dumps(report.to_dict())
    # everything off: nothing patched, nothing stored
    model = build(family)
    before = module_dict_keys(model)
    report = swift_liger.apply(model, **ALL_OFF)
    assert report.num_patched == 0 and module_dict_keys(model) == before


def test_default_report_and_summary(caplog):
    with caplog.at_level("INFO", logger="swift_liger"):
        report = swift_liger.apply(build("qwen3"))
    assert [r.getMessage() for r in caplog.records if r.name == "swift_liger"] == [str(report)]  # one line
    assert isinstance(report, PatchReport)
    assert report.patched == {"rms_norm": 5, "rope": 2, "qk_norm_rope": 2, "swiglu": 2, "tiled_mlp": 0,
                              "offload_checkpoints": 0, "save_attention": 0, "cross_entropy": 1, "rolling_cache": 0,
                              "fused_projections": 0,
                              "compile_layers": 0, "drop_pad_mask": 0, "cudnn_attention": 0,
                              "graph_layers": 2 if torch.cuda.is_available() else 0, "fp8_base": 0}
    assert report.activation == "swiglu" and report.model_type == "qwen3"
    text = str(report)
    assert "Qwen3ForCausalLM" in text and "cross_entropy=fused_linear" in text and "\n" not in text
    data = json.loads(report.to_json())
    assert data["patched"]["qk_norm_rope"] == 2 and data["config"] == LigerConfig().to_dict()
    llama = swift_liger.apply(build("llama"))
    cpu_only = [] if torch.cuda.is_available() else ["graph_layers"]   # without CUDA: "no CUDA device", said once
    assert [s["fusion"] for s in llama.skipped] == ["qk_norm_rope"] + cpu_only and not llama.problems


def test_config_forms():
    r1 = swift_liger.apply(build("llama"), {"swiglu": False})
    r2 = swift_liger.apply(build("llama"), LigerConfig(rope=False), cross_entropy="fused")
    assert r1.patched["swiglu"] == 0 and r1.cross_entropy_mode == "fused_linear"
    assert r2.patched["rope"] == 0 and r2.cross_entropy_mode == "fused"
    with pytest.raises(ValueError, match="unknown"):
        swift_liger.apply(build("llama"), no_such_switch=True)
    with pytest.raises(TypeError):
        swift_liger.apply(build("llama"), "yes")


def test_gelu_tanh_mlp_uses_geglu_and_other_acts_skip(torch_backend):
    ref, model = pair("llama", hidden_act="gelu_pytorch_tanh")
    report = swift_liger.apply(model)
    assert report.activation == "geglu" and report.patched["swiglu"] == 2
    ids, labels = batch()
    close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "geglu loss")
    report = swift_liger.apply(build("llama", hidden_act="relu"))
    assert report.patched["swiglu"] == 0 and not report.problems
    assert any("ReLU" in s["reason"] for s in report.skipped)


def test_idempotent_and_reconfigure():
    model = build("qwen3")
    first = swift_liger.apply(model)
    snapshot = {name: dict(m.__dict__) for name, m in model.named_modules()}
    second = swift_liger.apply(model)
    assert second.already_applied and second.patched == first.patched
    for name, m in model.named_modules():  # nothing re-wrapped
        assert all(m.__dict__[k] is v for k, v in snapshot[name].items() if k in ("forward", "_loss_function"))
    third = swift_liger.apply(model, swiglu=False, qk_norm_rope=False, lora_fusion=False)   # lora_fusion would wrap
    assert not third.already_applied and third.patched["swiglu"] == 0 and third.patched["qk_norm_rope"] == 0
    kinds = patched_kinds(model, "qwen3")
    assert kinds["mlp"] == 0 and kinds["qk_identity"] == 0 and kinds["rms_norm"] == 9
    assert get_report(model) is not None


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_revert_restores_exactly(torch_backend, family):
    ref, model = pair(family)
    keys_before = module_dict_keys(model)
    swift_liger.apply(model)
    ids, labels = batch()
    model.train()
    model(ids, labels=labels).loss.backward()  # run once patched: runtime flags must not linger either
    model.zero_grad(set_to_none=True)
    swift_liger.revert(model)
    assert module_dict_keys(model) == keys_before
    assert instance_forwards(model) == {} and get_report(model) is None
    for m in (model, ref):
        m.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)
    out.loss.backward(), expected.loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    swift_liger.revert(model)  # no-op when not patched


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_state_dict_untouched(family):
    model = build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    swift_liger.apply(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in after.items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert [n for n, _ in model.named_parameters()] == params
    assert [n for n, _ in model.named_buffers()] == buffers


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generate_matches(torch_backend, family):
    ref, model = pair(family)
    swift_liger.apply(model)
    ids, _ = batch()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref.eval(), model.eval()
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_forward_signature_kept():
    import inspect
    ref, model = pair("llama")
    swift_liger.apply(model)
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)  # Trainer drops columns by it


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_lora_after_apply(torch_backend, family):
    peft = pytest.importorskip("peft")
    ref, model = pair(family)
    swift_liger.apply(model)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"], init_lora_weights=False)
    ref, model = lora_pair(peft, ref, model, 7, **lora)
    ids, labels = batch()
    ref.train(), model.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None
    close(out.loss, expected.loss, "lora loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and "mlp" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)  # LoRA Linears inside patched MLP
    sd = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    ref_sd = peft.get_peft_model_state_dict(ref, save_embedding_layers=False)
    assert list(sd) == list(ref_sd) and all(sd[k].dtype == ref_sd[k].dtype for k in sd)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert swift_liger.apply(model).already_applied  # found through the PEFT wrapper
    swift_liger.revert(model)
    assert instance_forwards(model.get_base_model()) == {}


def test_peft_lora_on_lm_head_falls_back_to_logits(torch_backend):
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model)
    lora = dict(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    ids, labels = batch()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.logits, expected.logits, "logits")  # wrapped lm_head: no hidden-state shortcut
    close(out.loss, expected.loss, "loss")


def test_deepcopy_of_patched_model_is_independent(torch_backend):
    model = build("qwen3")
    swift_liger.apply(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for m in (clone,):
            m.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
            m.model.layers[0].self_attn.k_norm.weight.add_(0.5)
    expected = copy.deepcopy(clone)
    swift_liger.revert(expected)
    ids, labels = batch()
    for m in (clone, expected, model):
        m.eval()
    with torch.no_grad():
        close(clone(ids).logits, expected(ids).logits, "copy uses its own q_norm/k_norm")
        assert not torch.allclose(model(ids).logits, clone(ids).logits)
    attn = clone.model.layers[0].self_attn
    assert attn.forward.__self__ is attn and get_report(clone) is not None


def test_unsupported_model_warns_or_raises():
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))
    before = module_dict_keys(gpt2)
    with pytest.warns(UserWarning, match="gpt2"):
        report = swift_liger.apply(gpt2)
    assert not report.supported and report.num_patched == 0 and module_dict_keys(gpt2) == before
    assert "not supported" in str(report)
    with pytest.raises(ValueError, match="gpt2"):
        swift_liger.apply(gpt2, strict=True)
    with pytest.raises(TypeError):
        swift_liger.apply(object())


def test_unexpected_forward_structure_skips_with_warning(monkeypatch):
    broken = dataclasses.replace(FAMILIES["llama"], rope_function="no_such_rope_function")
    monkeypatch.setitem(FAMILIES, "llama", broken)
    model = build("llama")
    with pytest.warns(UserWarning, match="rope"):
        report = swift_liger.apply(model)
    assert report.patched["rope"] == 0 and report.patched["rms_norm"] == 5 and report.problems
    model = build("llama")
    before = module_dict_keys(model)
    with pytest.raises(ValueError, match="strict"):
        swift_liger.apply(model, strict=True)
    assert module_dict_keys(model) == before  # strict failure leaves the model untouched


def test_foreign_instance_forward_is_left_alone():
    model = build("llama")
    norm = model.model.norm
    norm.forward = lambda x: x  # someone else's per-instance patch
    with pytest.warns(UserWarning, match="another tool"):
        report = swift_liger.apply(model)
    assert report.patched["rms_norm"] == 4 and norm.forward(torch.ones(1)) is not None
    swift_liger.revert(model)
    assert "forward" in norm.__dict__  # theirs survives our revert


def test_accelerate_style_old_forward_is_patched():
    ref, model = pair("llama")
    norm = model.model.norm
    norm._old_forward = norm.forward  # what accelerate's add_hook_to_module leaves behind
    norm.forward = functools.update_wrapper(functools.partial(lambda m, x: m._old_forward(x), norm), type(norm).forward)
    report = swift_liger.apply(model, **{**ALL_OFF, "rms_norm": True})
    assert report.patched["rms_norm"] == 5 and norm._old_forward.__func__ is not type(norm).forward
    swift_liger.revert(model)
    assert norm._old_forward.__func__ is type(norm).forward


def test_globals_rebinding_keeps_module_and_decorators():
    namespace = {"__name__": "fake_modeling"}
    exec(  # a modeling-module-like namespace: forward calls a module global, wrapped by a decorator
        "import functools\n"
        "calls = []\n"
        "def helper(x):\n    return x + 1\n"
        "def deco(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def wrapper(*a, **k):\n        calls.append(1)\n        return fn(*a, **k)\n"
        "    return wrapper\n"
        "@deco\n"
        "def forward(x, *, k=2):\n    return helper(x) * k\n", namespace)
    fwd = namespace["forward"]
    new, reason = rebuild_with_globals(fwd, {"helper": lambda x: x + 100}, ("helper",))
    assert reason is None
    assert new(1) == 202 and fwd(1) == 4 and namespace["helper"](1) == 2  # original module untouched
    assert len(namespace["calls"]) == 2  # the decorator still runs around the rebuilt function
    _, reason = rebuild_with_globals(fwd, {}, ("not_referenced",))
    assert "not_referenced" in reason


def test_compile_patched_decoder_layer_no_graph_break(torch_backend):
    model = build("qwen3", layers=1)
    swift_liger.apply(model)
    layer = model.model.layers[0]
    x = torch.randn(BATCH, SEQ, 32)
    pos = torch.arange(SEQ)[None].expand(BATCH, -1)
    cos_sin = model.model.rotary_emb(x, pos)
    eager = layer(x, attention_mask=None, position_embeddings=cos_sin)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    close(compiled(x, attention_mask=None, position_embeddings=cos_sin), eager, "compiled layer")
    torch._dynamo.reset()


def test_compile_whole_model_fused_linear_training_no_graph_break(torch_backend):
    ref, model = pair("llama", layers=1)
    swift_liger.apply(model)
    ids, labels = batch()
    model.train(), ref.train()
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, labels=labels)
    expected = ref(ids, labels=labels)
    close(out.loss, expected.loss, "compiled loss")
    # torch 2.11's dynamo (the H200 image) does not see the lm_head flag flip inside a whole-model compile and
    # materialises logits: same loss and grads, no memory saving. torch 2.13 skips them. Per-layer compile
    # (the recommended setting) leaves the causal-LM forward eager and is unaffected.
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        assert out.logits is None
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    torch._dynamo.reset()


def test_compile_layers_with_lora_and_checkpointing(torch_backend):
    """compile_layers: every decoder layer runs through torch.compile (inductor on CPU here), after PEFT wraps its
    Linears and under gradient checkpointing, with the same loss and grads; deepcopy recompiles for the copy;
    revert removes it."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama", layers=1)
    report = swift_liger.apply(model, compile_layers=True)
    assert report.patched["compile_layers"] == 1 and "torch.compile on 1 decoder layers" in str(report)
    layer = model.model.layers[0]
    assert layer._compiled_call_impl is not None
    clone = copy.deepcopy(model)
    compiled_fn = clone.model.layers[0]._compiled_call_impl
    assert compiled_fn is not None and compiled_fn is not layer._compiled_call_impl
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                init_lora_weights=False)
    ref, model = lora_pair(peft, ref, model, 7, **lora)
    checkpointed_training((model, ref), use_reentrant=False)
    ids, labels = batch()
    if torch.cuda.is_available():   # inductor may start CUDA inside the first checkpointed forward, which checkpoint
        torch.cuda.init()           # refuses; a process that ran a CUDA test before never sees it
    torch._dynamo.reset()
    calls = torch._dynamo.utils.counters["stats"]["calls_captured"]
    out, expected = model(ids, labels=labels, use_cache=False), ref(ids, labels=labels, use_cache=False)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > calls, "the layer was not compiled"
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    swift_liger.revert(model)
    assert layer._compiled_call_impl is None
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["auto", "triton"], ids=["cpu_reference", "triton_interpreter"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_compile_layers_every_family_on_each_cpu_backend(monkeypatch, family, backend):
    """compile_layers (inductor) on the CPU reference backend users without CUDA run (SWIFT_LIGER_BACKEND unset:
    auto), and on the Triton interpreter: same training loss and gradients as the unpatched eager model. A graph
    break inside a rebuilt attention forward (our ops' one-time CPU notice was one) fails here with dynamo's
    NameError."""
    from swift_liger.ops import _common
    if backend == "triton" and not _common.INTERPRET:
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 (set for the CPU suite only)")
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", backend)
    _common._notice_cpu_fallback.cache_clear()   # as in a fresh process: the notice is still to come
    ref, model = pair(family, layers=2)   # two layers: dynamo reuses the first layer's code for the second
    swift_liger.apply(model, compile_layers=True)
    ids, labels = batch()
    model.train(), ref.train()
    torch._dynamo.reset()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    torch._dynamo.reset()


def lora_calls(model):
    """(through ops.lora_linear, through PEFT's forward) since the last reset, from the patch state's counters."""
    counts = call_counts(model)
    return counts["lora_fused"], counts["lora_peft"]


@pytest.fixture
def lora_linear_calls(monkeypatch):
    """A list that gets one entry per ops.lora_linear call."""
    from swift_liger.ops import lora_linear_op as LL
    calls = []
    original = LL.LoRALinearFunction.apply
    monkeypatch.setattr(LL.LoRALinearFunction, "apply", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("family,dropout", [("qwen2", 0.0), ("qwen2", 0.2), ("qwen3", 0.1)])
def test_lora_fusion_same_loss_and_grads(torch_backend, family, dropout, lora_linear_calls):
    """lora_fusion: the MLP's and the attention's PEFT LoRA projections run through ops.lora_linear (counted), with
    the same loss and gradients as PEFT's own forward, dropout included (same module, same RNG draws); qwen3 takes
    the fused qk-norm rope attention. Nothing stays installed on the LoRA modules after a forward."""
    peft = pytest.importorskip("peft")
    ref, model = pair(family)
    swift_liger.apply(model, lora_fusion=True)
    lora = dict(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    ids, labels = batch()
    ref.train(), model.train()
    torch.manual_seed(11)
    expected = ref(ids, labels=labels)
    torch.manual_seed(11)
    out = model(ids, labels=labels)
    assert len(lora_linear_calls) == 5 * 2   # q, v, gate, up, down in both layers
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__module__.startswith("peft.tuners"))
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    clone = copy.deepcopy(model)   # the rebuilt qk forward is rebuilt again for the copy, fusion included
    lora_linear_calls.clear()
    torch.manual_seed(11)
    close(clone(ids, labels=labels).loss, out.loss, "deep copy loss")
    assert len(lora_linear_calls) == 5 * 2


@pytest.mark.parametrize("off", [dict(rope=False), dict(swiglu=False), dict(ALL_OFF)], ids=["rope", "swiglu", "all"])
def test_lora_fusion_covers_modules_other_fusions_leave(torch_backend, lora_linear_calls, off):
    """lora_fusion does not depend on rope / swiglu: with either (or every other fusion) off, every attention and MLP
    LoRA projection still runs through ops.lora_linear, counted as such (none left to PEFT's forward uncounted), with
    PEFT's loss and gradients; revert leaves no instance forward."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model, **{**off, "lora_fusion": True})
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules="all-linear")
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    ids, labels = batch()
    call_counts(model, reset=True)
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert len(lora_linear_calls) == 7 * 2 and lora_calls(model) == (14, 0)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)
    swift_liger.revert(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_lora_calls_in_compile_ahead_pass_not_counted(torch_backend, lora_linear_calls, monkeypatch):
    """graph_layers' compile-ahead pass runs a layer through our ops with every launch turned into a compile: its
    LoRA calls go through ops.lora_linear but are not counted as calls; the same forward outside the pass is."""
    peft = pytest.importorskip("peft")
    from swift_liger.ops import _launch
    ref, model = pair("llama")
    swift_liger.apply(model, lora_fusion=True)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules="all-linear")
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    ids, labels = batch()
    call_counts(model, reset=True)
    outside = _launch.compiling_ahead
    assert not outside()
    monkeypatch.setattr(_launch, "compiling_ahead", lambda: True)   # inside the pass (never under the interpreter)
    model(ids, labels=labels)
    assert len(lora_linear_calls) == 7 * 2 and lora_calls(model) == (0, 0)
    monkeypatch.setattr(_launch, "compiling_ahead", outside)
    model(ids, labels=labels)
    assert len(lora_linear_calls) == 2 * 7 * 2 and lora_calls(model) == (14, 0)


def test_lora_fusion_dropout_under_reentrant_checkpointing(torch_backend, lora_linear_calls):
    """ms-swift's set-up: LoRA dropout, use_reentrant=True checkpointing. The recomputed forward draws the same
    dropout masks (checkpoint restores the RNG), so loss and gradients equal PEFT's; the call counter sees only
    fused calls."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model, lora_fusion=True)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.3, init_lora_weights=False, target_modules="all-linear")
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    checkpointed_training((ref, model), use_reentrant=True)
    ids, labels = batch()
    call_counts(model, reset=True)
    torch.manual_seed(4)
    expected = ref(ids, labels=labels, use_cache=False)
    expected.loss.backward()
    torch.manual_seed(4)
    out = model(ids, labels=labels, use_cache=False)
    out.loss.backward()
    # 7 projections x 2 layers, forward + recompute, all fused; the reentrant first pass runs without autograd
    # (ops.lora_linear's no-grad forward), so only the recompute records through LoRALinearFunction
    assert len(lora_linear_calls) == 7 * 2
    assert lora_calls(model) == (28, 0)
    close(out.loss, expected.loss, "loss")
    assert_grads_match(model, ref)


def test_lora_fusion_falls_back_outside_the_plain_setup(torch_backend, lora_linear_calls):
    """DoRA, merged or disabled adapters, several active adapters: PEFT's own forward runs."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model, lora_fusion=True)
    lora = dict(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False, use_dora=True)
    ref, model = lora_pair(peft, ref, model, 3, **lora)
    ids, labels = batch()
    close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "dora loss")
    with model.disable_adapter():
        model(ids, labels=labels)
    assert lora_linear_calls == []
    assert lora_calls(model)[1] > 0


def test_lora_fusion_under_bf16_autocast_with_fp32_adapters(torch_backend, lora_linear_calls):
    """PEFT's default set-up in ms-swift: bf16 weights, fp32 adapters, bf16 autocast."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model, lora_fusion=True)
    lora = dict(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    ref, model = lora_pair(peft, ref.to(torch.bfloat16), model.to(torch.bfloat16), 3, **lora)
    for m in (ref, model):
        assert m.base_model.model.model.layers[0].mlp.gate_proj.lora_A["default"].weight.dtype == torch.float32
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert len(lora_linear_calls) == 3 * 2
    assert_bf16_loss_and_fp32_adapter_grads_match(out, expected, model, ref)


def test_lora_fusion_fp32_adapters_without_autocast(torch_backend):
    """A plain PyTorch loop: bf16 weights, PEFT's fp32 adapters, no autocast, dropout. Every LoRA projection runs
    through the upcast op; loss and gradients as PEFT's (same dropout draws on CPU)."""
    peft = pytest.importorskip("peft")
    ref, model = pair("llama")
    swift_liger.apply(model)                                     # lora_fusion is on by default
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.1, init_lora_weights=False, target_modules="all-linear")
    ref, model = lora_pair(peft, ref.to(torch.bfloat16), model.to(torch.bfloat16), 3, **lora)
    ids, labels = batch()
    ref.train(), model.train()
    call_counts(model, reset=True)
    torch.manual_seed(8)
    out = model(ids, labels=labels)
    torch.manual_seed(8)
    expected = ref(ids, labels=labels)
    assert lora_calls(model) == (7 * 2, 0)
    assert_bf16_loss_and_fp32_adapter_grads_match(out, expected, model, ref)


@pytest.mark.parametrize("family", ["qwen3"])
def test_gradient_checkpointing(torch_backend, family):
    ref, model = pair(family)
    swift_liger.apply(model)
    ids, labels = batch()
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        m.train()
    out, expected = model(ids, labels=labels, use_cache=False), ref(ids, labels=labels, use_cache=False)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)


def test_apply_after_peft_wrap(torch_backend):
    peft = pytest.importorskip("peft")
    ref, model = pair("qwen2")
    lora = dict(r=4, target_modules=["q_proj", "gate_proj", "down_proj"], init_lora_weights=False)
    ref, model = lora_pair(peft, ref, model, 5, **lora)
    report = swift_liger.apply(model)
    assert report.model_class == "Qwen2ForCausalLM" and report.patched["swiglu"] == 2
    ids, labels = batch()
    ref.train(), model.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    assert_grads_match(model, ref)


def test_rolling_cache_installed_and_reverted(torch_backend):
    ref, model = pair("llama")
    report = swift_liger.apply(model, rolling_cache={"window": 32, "sinks": 2})
    assert report.patched["rolling_cache"] == 1 and "generate" in model.__dict__
    ids, _ = batch()
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref.eval(), model.eval()
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))  # window > length: same tokens
    swift_liger.revert(model)
    assert "generate" not in model.__dict__ and instance_forwards(model) == {}
    # bad settings are an error when the config is built, before anything is patched
    for bad, match in (({"window": 0}, "window must be an int >= 1"), ({"window": 8, "sinks": -1}, "sinks must be"),
                       ({"window": 8, "mode": "ring"}, "mode must be one of absolute, streaming"),
                       ({"sinks": 4}, "keys window, sinks")):
        with pytest.raises(ValueError, match=match):
            swift_liger.apply(build("llama"), rolling_cache=bad)


def test_triton_key_warmed_only_for_a_cuda_model(torch_backend, monkeypatch):
    """apply starts ops._launch.warm_cache_key (Triton's cache key, hashed beside the trainer's set-up) for a model on
    CUDA only."""
    from swift_liger.ops import _launch
    started = []
    monkeypatch.setattr(_launch, "warm_cache_key", lambda: started.append(1))
    swift_liger.apply(build("qwen2"))
    assert not started
    if torch.cuda.is_available():
        swift_liger.apply(build("qwen2").cuda())
        assert started == [1]
