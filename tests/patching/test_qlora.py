"""QLoRA: PEFT LoRA over bitsandbytes 4-bit (NF4, double quant) base layers runs through ops.lora_linear with the
base weight dequantized per matmul. Loaded as ms-swift loads it (transformers' BitsAndBytesConfig), on CPU."""
from __future__ import annotations

import pytest
import torch

from helpers import close_scaled as close

import swift_liger
from swift_liger import call_counts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

LAYERS = 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random Llama / Qwen2 saved in bf16 (hidden 64: a whole NF4 block of 64 per row)."""
    paths = {}
    for model_type in ("llama", "qwen2"):
        cfg = transformers.AutoConfig.for_model(
            model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64, pad_token_id=0,
            eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        path = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(path)
        paths[model_type] = path
    return paths


def load_4bit(path, device, compute_dtype=torch.bfloat16):
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype,
                                        bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16,
                                                              device_map=device.type, attn_implementation="eager")
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    return model


def qlora_pair(path, device, patch: bool, dropout: float, **kw):
    models = []
    for patched in (False, True):
        m = load_4bit(path, device, **kw)
        if patched and patch:
            swift_liger.apply(m, lora_fusion=True)
        torch.manual_seed(3)
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                                                   target_modules=list(PROJECTIONS)))
        m.train()
        models.append(m)
    return models


def batch(device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 96, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids.to(device), labels.to(device)


@pytest.fixture
def cpu_reference_ops(monkeypatch, device):
    """CPU: our ops' torch reference backend (the interpreter adds nothing here); CUDA: the compiled kernels."""
    if device.type == "cpu":
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def lora_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type,dropout", [("llama", 0.0), ("llama", 0.1), ("qwen2", 0.05)])
def test_qlora_projections_fused_same_loss_and_grads(saved_model, device, cpu_reference_ops, model_type, dropout):
    """ms-swift's QLoRA set-up (bf16 autocast, fp32 adapters, NF4 double-quant base, LoRA dropout): every projection
    goes through ops.lora_linear (counted, none through PEFT), same loss and adapter gradients as PEFT over
    bitsandbytes; qwen2's q/k/v biases included. The 4-bit weights are untouched."""
    ref, model = qlora_pair(saved_model[model_type], device, True, dropout)
    packed_before = [m.weight.data.clone() for m in model.modules() if type(m).__name__ == "Linear4bit"
                     and type(m).__module__.startswith("bitsandbytes")]
    ids, labels = batch(device)
    call_counts(model, reset=True)
    losses = []
    for m in (ref, model):
        torch.manual_seed(5)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = m(ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    counts = call_counts(model)
    assert (counts["lora_fused"], counts["lora_peft"]) == (len(PROJECTIONS) * LAYERS, 0)
    close(losses[1], losses[0], "loss", atol=2e-3, rtol=2e-3)
    expected, got = lora_grads(ref), lora_grads(model)
    assert got.keys() == expected.keys() and len(got) == 2 * len(PROJECTIONS) * LAYERS
    for name, g in got.items():
        assert g is not None and g.dtype == torch.float32, name
        close(g, expected[name], name, atol=3e-2, rtol=3e-2)
    packed_after = [m.weight.data for m in model.modules() if type(m).__name__ == "Linear4bit"
                    and type(m).__module__.startswith("bitsandbytes")]
    assert len(packed_after) == len(PROJECTIONS) * LAYERS
    assert all(torch.equal(a, b) for a, b in zip(packed_before, packed_after))


def test_qlora_compute_dtype_other_than_the_input_falls_back_to_peft(saved_model, device, cpu_reference_ops):
    """A 4-bit base whose compute dtype is not the input's (fp32 compute on bf16 hidden states): bitsandbytes would
    upcast the input, so the call goes to PEFT's forward, counted as such, with PEFT's loss."""
    ref, model = qlora_pair(saved_model["llama"], device, True, 0.0, compute_dtype=torch.float32)
    ids, labels = batch(device)
    call_counts(model, reset=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        expected, out = ref(ids, labels=labels), model(ids, labels=labels)
    counts = call_counts(model)
    assert counts["lora_fused"] == 0 and counts["lora_peft"] == len(PROJECTIONS) * LAYERS
    close(out.loss, expected.loss, "loss", atol=2e-3, rtol=2e-3)


def test_qlora_saves_the_same_adapter(saved_model, device, cpu_reference_ops, tmp_path):
    """One AdamW step patched and unpatched: the saved adapters hold the same tensors (bf16 tolerance) and the
    same keys; no 4-bit or dequantized weight is written into them."""
    ref, model = qlora_pair(saved_model["llama"], device, True, 0.0)
    ids, labels = batch(device)
    for i, m in enumerate((ref, model)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            m(ids, labels=labels).loss.backward()
        opt.step()
        m.save_pretrained(tmp_path / str(i))
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / str(i) / "adapter_model.safetensors") for i in (0, 1))
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    for k in a:
        close(b[k], a[k], k, atol=2e-3, rtol=2e-3)


def test_8bit_lora_runs_peft_forward_and_is_counted(saved_model, device, cpu_reference_ops):
    """LoRA over bitsandbytes 8-bit layers: PEFT's own forward (an int8 matmul, not a dequantize-then-matmul), every
    projection counted as a PEFT call, the same loss as the unpatched model."""
    q = transformers.BitsAndBytesConfig(load_in_8bit=True)
    models = []
    for patched in (False, True):
        m = transformers.AutoModelForCausalLM.from_pretrained(saved_model["llama"], quantization_config=q,
                                                              dtype=torch.float32, device_map=device.type,
                                                              attn_implementation="eager")
        if patched:
            swift_liger.apply(m, lora_fusion=True)
        torch.manual_seed(3)
        models.append(peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                             target_modules=list(PROJECTIONS))))
    ref, model = models
    ids, labels = batch(device)
    call_counts(model, reset=True)
    expected, out = ref(ids, labels=labels), model(ids, labels=labels)
    counts = call_counts(model)
    assert (counts["lora_fused"], counts["lora_peft"]) == (0, len(PROJECTIONS) * LAYERS)
    close(out.loss, expected.loss, "loss", atol=1e-4, rtol=1e-4)
