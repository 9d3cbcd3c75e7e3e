"""tiled_mlp: each MLP over token tiles under its own checkpoint gives the untiled losses and gradients (fp32, CPU),
with the swiglu fusion or HF's MLP inside, LoRA (dropout included) inside, packed gate_up MLPs, and layer-level
gradient checkpointing (reentrant or not) around it; no MLP projection ever sees more than `tile` rows."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import close_scaled as close

import swift_liger
from swift_liger.config import LigerConfig
from swift_liger.fusions.tiled_mlp import DEFAULT_TILE, parse_flag

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

VOCAB, TILE = 128, 8


def build(model_type="llama", seed=0, **extra):
    options = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=128, hidden_act="silu",
                   pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg = AutoConfig.for_model(model_type, **{**options, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def batch(seq=21, seed=0):   # 2 x 21 = 42 tokens: 6 tiles of 8, the last one short
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels



def rows_seen(model, names=("gate_proj", "up_proj", "down_proj", "gate_up_proj")):
    """Largest number of rows any MLP projection got, forward and recompute alike."""
    seen = [0]
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(
                0, max(seen[0], args[0].reshape(-1, args[0].shape[-1]).shape[0])))
    return seen


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("checkpointing", [None, True, False], ids=["no_gc", "reentrant", "non_reentrant"])
def test_same_loss_and_grads(torch_backend, family, swiglu, checkpointing):
    ref = build(family)
    model = copy.deepcopy(ref)
    report = swift_liger.apply(model, tiled_mlp=TILE, swiglu=swiglu)
    assert report.patched["tiled_mlp"] == 2 and not report.problems
    for m in (ref, model):
        if checkpointing is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
            m.enable_input_require_grads()
        m.train()
    seen = rows_seen(model)
    ids, labels = batch()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad, name)
    assert 0 < seen[0] <= TILE


def lora_models(peft, dropout, checkpointing, tiles=(TILE, TILE)):
    base = build("qwen3")
    lora = dict(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    models = []
    for tile in tiles:
        m = copy.deepcopy(base)
        if tile:
            swift_liger.apply(m, tiled_mlp=tile)
        torch.manual_seed(5)
        m = peft.get_peft_model(m, peft.LoraConfig(**lora))
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        m.enable_input_require_grads()
        m.train()
        models.append(m)
    return models


def loss_and_grads(model, seed=11):
    ids, labels = batch()
    torch.manual_seed(seed)
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["reentrant", "non_reentrant"])
def test_lora_inside_the_tiles(torch_backend, checkpointing):
    """LoRA (lora_fusion's op) inside tiled MLPs, without dropout: PEFT's untiled loss and gradients."""
    peft = pytest.importorskip("peft")
    ref, model = lora_models(peft, 0.0, checkpointing, tiles=(0, TILE))
    (a, ga), (b, gb) = loss_and_grads(model), loss_and_grads(ref)
    close(a, b, "loss")
    assert ga.keys() == gb.keys()
    for name in ga:
        close(ga[name], gb[name], name)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["reentrant", "non_reentrant"])
def test_lora_dropout_recompute_draws_the_forward_masks(torch_backend, checkpointing, monkeypatch):
    """With dropout the masks are drawn per tile; the tiles' recompute must draw the same ones: gradients equal those
    of the same tiled forward run without tile checkpoints (which keeps every tile's activations)."""
    peft = pytest.importorskip("peft")
    from swift_liger.fusions import tiled_mlp
    model, plain = lora_models(peft, 0.2, checkpointing)
    a, ga = loss_and_grads(model)
    monkeypatch.setattr(tiled_mlp, "_checkpoint", lambda forward, part: forward(part))
    b, gb = loss_and_grads(plain)
    close(a, b, "loss")
    for name in ga:
        close(ga[name], gb[name], name)


def test_kernels_inside_tiles(device):
    """The real kernels (Triton interpreter on CPU) in the tiles."""
    ref = build("llama").to(device)
    model = copy.deepcopy(ref)
    swift_liger.apply(model, tiled_mlp=TILE)
    ids, labels = (t.to(device) for t in batch())
    model.train(), ref.train()
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, expected.loss, "loss")
    out.loss.backward(), expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad, name)


def test_short_sequences_run_untiled_and_eval_and_revert(torch_backend):
    ref = build()
    model = copy.deepcopy(ref)
    swift_liger.apply(model, tiled_mlp=64)
    seen = rows_seen(model)
    ids, labels = batch()
    model.train(), ref.train()
    close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "untiled")
    assert seen[0] == ids.numel()   # 42 <= 64: one call with every row
    swift_liger.apply(model, tiled_mlp=TILE)   # a different config re-patches
    model.eval(), ref.eval()
    with torch.no_grad():
        close(model(ids).logits, ref(ids).logits, "eval logits (tiles without checkpoints)")
    clone = copy.deepcopy(model)
    seen_clone = rows_seen(clone)
    with torch.no_grad():
        close(clone(ids).logits, ref(ids).logits, "deep copy")
    assert 0 < seen_clone[0] <= TILE
    swift_liger.revert(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_config_flag_and_preset_values():
    assert LigerConfig().tiled_mlp == 0
    assert LigerConfig(tiled_mlp=True).tiled_mlp == DEFAULT_TILE
    assert LigerConfig(tiled_mlp=4096).tiled_mlp == 4096
    for bad in (-1, 1.5, "8k"):
        with pytest.raises(ValueError, match="tiled_mlp"):
            LigerConfig(tiled_mlp=bad)
    assert [parse_flag(v) for v in ("8192", "true", "off", "0", None)] == [8192, DEFAULT_TILE, 0, 0, None]
    with pytest.raises(ValueError, match="liger_tiled_mlp"):
        parse_flag("lots")
    from swift_liger.integration.arguments import find_preset
    assert LigerConfig.from_yaml(find_preset("long_context")).tiled_mlp == DEFAULT_TILE
