"""fp8_base: after PEFT wraps a patched model, quantize_lora_bases stores each plain LoRA base in FP8; training
runs through the FP8 GEMMs (fused LoRA path and PEFT's own forward with adapters disabled), the adapters and their
gradients keep their 16-bit maths, saved adapters hold the same keys, and revert restores the exact weights."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import close_scaled as close

import swift_liger
from swift_liger import call_counts
from swift_liger.ops import _launch
from swift_liger.ops.fp8_linear_op import Fp8Weight, fp8_device_problem
from swift_liger.patching import fp8 as fp8_patch
from swift_liger.patching.fp8 import EMULATE_ENV

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LAYERS = 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEVICE = "cuda" if torch.cuda.is_available() and fp8_device_problem("cuda") is None else "cpu"


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The tiny models' weights are far below the size where FP8 pays on a GPU (MIN_SIZE): take them all here."""
    monkeypatch.setattr(fp8_patch, "MIN_SIZE", 0)


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")            # FP8 bases on CPU through torch's reference FP8 GEMM
    if DEVICE == "cpu":
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")


def tiny(model_type="qwen2", seed=0):
    cfg = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                         attn_implementation="eager").to(DEVICE)


def lora(model, use_dora=False):
    torch.manual_seed(3)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_dora=use_dora,
                                                      target_modules=list(PROJECTIONS)))


def pair(model_type="qwen2", **apply_kw):
    ref = lora(tiny(model_type))
    m = tiny(model_type)
    swift_liger.apply(m, fp8_base=True, **apply_kw)
    m = lora(m)
    return ref, m


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 96, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def bases(model):
    return [m.get_base_layer() for m in model.modules() if type(m).__name__ == "Linear"
            and type(m).__module__.startswith("peft.tuners.lora")]


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_bases_become_fp8_and_train_close_to_16bit(emulate, model_type, monkeypatch):
    ref, model = pair(model_type)
    originals = [b.weight.detach().clone() for b in bases(model)]
    params = [b.weight for b in bases(model)]
    record = swift_liger.quantize_lora_bases(model)
    n = len(PROJECTIONS) * LAYERS
    assert record["fp8_weights"] == n and record["kept_16bit"] == {}
    assert record["bytes_fp8"] < 0.6 * record["bytes_16bit"]
    assert all(isinstance(b.weight, Fp8Weight) for b in bases(model))
    assert swift_liger.quantize_lora_bases(model)["fp8_weights"] == n        # idempotent
    ids, labels = batch()
    call_counts(model, reset=True)
    losses = []
    for m in (ref, model):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = m(ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    counts = call_counts(model)
    assert counts["lora_fused"] == n and counts["lora_peft"] == 0 and counts["fp8_weights"] == n
    close(losses[1], losses[0], "loss", atol=2e-2, rtol=2e-2)        # FP8 rounding of every base GEMM
    got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(got) == 2 * n
    for k in got:
        rel = (got[k].double() - want[k].double()).norm() / want[k].double().norm()
        assert rel < 0.3, (k, rel.item())   # FP8 rounding: ~10% on this random 2-layer model; a lost scale gives ~1
    assert all(b.weight.grad is None for b in bases(model))
    # adapters disabled (a DPO/GRPO reference pass): PEFT's forward, base GEMMs in FP8
    call_counts(model, reset=True)
    with torch.no_grad(), model.disable_adapter(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        base_loss = model(ids, labels=labels).loss
    assert call_counts(model)["fp8_base_calls"] == n
    call_counts(model, reset=True)   # graph_layers' compile-ahead pass is not a training call: not counted
    outside = _launch.compiling_ahead
    monkeypatch.setattr(_launch, "compiling_ahead", lambda: True)
    with torch.no_grad(), model.disable_adapter(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        model(ids, labels=labels)
    monkeypatch.setattr(_launch, "compiling_ahead", outside)
    assert call_counts(model)["fp8_base_calls"] == 0
    swift_liger.revert(model)
    for b, p, w in zip(bases(model), params, originals):
        assert b.weight is p and type(p) is torch.nn.Parameter and torch.equal(p, w) and p.device == w.device
    with torch.no_grad(), model.disable_adapter(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        close(model(ids, labels=labels).loss, base_loss, "base loss", atol=2e-2, rtol=2e-2)


def test_projections_reading_one_input_quantize_it_once(emulate, monkeypatch):
    """q/k/v and gate/up over FP8 bases share one InputGroup per module (o and down none), so a layer's forward
    quantizes 4 inputs instead of 7; the loss and the adapter gradients are the ungrouped model's, bit for bit."""
    from swift_liger.ops import fp8_linear_op
    _, model = pair()
    swift_liger.quantize_lora_bases(model)
    layer = model.base_model.model.model.layers[0]
    weight = {n: getattr(mod, n).get_base_layer().weight for mod in (layer.self_attn, layer.mlp)
              for n in PROJECTIONS if hasattr(mod, n)}
    assert weight["q_proj"].input_group is weight["k_proj"].input_group is weight["v_proj"].input_group
    assert weight["q_proj"].input_group.size == 3 and weight["gate_proj"].input_group.size == 2
    assert weight["gate_proj"].input_group is weight["up_proj"].input_group is not weight["q_proj"].input_group
    assert weight["o_proj"].input_group is None and weight["down_proj"].input_group is None
    calls = []
    real = fp8_linear_op.quantize_rows
    monkeypatch.setattr(fp8_linear_op, "quantize_rows", lambda x2, fold=None: calls.append(fold) or real(x2, fold))
    ids, labels = batch()
    results = []
    for grouped in (True, False):
        if not grouped:
            for b in bases(model):
                b.weight.input_group = None
        calls.clear()
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(ids, labels=labels).loss
        forward = len(calls)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        results.append((forward, loss, grads))
    (n1, loss1, g1), (n0, loss0, g0) = results
    assert (n1, n0) == (4 * LAYERS, 7 * LAYERS)
    assert torch.equal(loss1, loss0) and all(torch.equal(a, b) for a, b in zip(g1, g0))


def test_saved_adapter_has_the_16bit_runs_keys(emulate, tmp_path):
    ref, model = pair()
    swift_liger.quantize_lora_bases(model)
    ids, labels = batch()
    for i, m in enumerate((ref, model)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            m(ids, labels=labels).loss.backward()
        opt.step()
        m.save_pretrained(tmp_path / str(i))
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / str(i) / "adapter_model.safetensors") for i in (0, 1))
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        close(b[k], a[k], k, atol=5e-3, rtol=5e-3)    # one AdamW step: ~lr-sized moves from near-equal grads


def test_kept_16bit_where_fp8_cannot_apply(monkeypatch):
    """Without an FP8 GPU (and without the test emulation) every base stays 16-bit, each counted with its reason;
    DoRA layers stay 16-bit too."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    if DEVICE == "cpu":
        _, model = pair()
        record = swift_liger.quantize_lora_bases(model)
        assert record["fp8_weights"] == 0
        (reason, n), = record["kept_16bit"].items()
        assert n == len(PROJECTIONS) * LAYERS and "CPU" in reason and EMULATE_ENV in reason
        assert "fp8_base" in swift_liger.get_report(model).summary()
    monkeypatch.setenv(EMULATE_ENV, "1")
    m = tiny()
    swift_liger.apply(m, fp8_base=True)
    m = lora(m, use_dora=True)
    record = swift_liger.quantize_lora_bases(m)
    assert record["fp8_weights"] == 0 and any("DoRA" in r for r in record["kept_16bit"])


def test_needs_a_model_patched_with_fp8_base():
    m = lora(tiny())
    with pytest.raises(ValueError, match="fp8_base=True"):
        swift_liger.quantize_lora_bases(m)
    m = tiny()
    swift_liger.apply(m)
    with pytest.raises(ValueError, match="fp8_base=True"):
        swift_liger.quantize_lora_bases(lora(m))


def test_ddp_wraps_a_model_with_fp8_bases(emulate, monkeypatch):
    """DistributedDataParallel broadcasts every parameter when it wraps a model: the FP8 bases (frozen, the same on
    every rank) are left out of that sync by name, so wrapping and a step work; revert drops the names again."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    try:
        _, model = pair()
        swift_liger.quantize_lora_bases(model)
        names = set(model._ddp_params_and_buffers_to_ignore)
        assert len(names) == len(PROJECTIONS) * LAYERS and all(n.endswith("base_layer.weight") for n in names)
        assert all(isinstance(p, Fp8Weight) for n, p in model.named_parameters() if n in names)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ids, labels = batch()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            ddp(ids, labels=labels).loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        swift_liger.revert(model)
        assert "_ddp_params_and_buffers_to_ignore" not in model.__dict__
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_and_tiled_mlp_give_the_same_step(emulate, reentrant):
    """Gradient checkpointing (ms-swift's reentrant default, and non-reentrant) and tiled MLP recompute the FP8
    forward: the same loss and adapter gradients as the FP8 model without them."""
    results = []
    for variant in ("plain", "checkpointed"):
        m = tiny()
        swift_liger.apply(m, fp8_base=True, **({"tiled_mlp": 8} if variant == "checkpointed" else {}))
        m = lora(m)
        swift_liger.quantize_lora_bases(m)
        if variant == "checkpointed":
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            m.enable_input_require_grads()
        m.train()
        ids, labels = batch()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = m(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.requires_grad}))
    (l0, g0), (l1, g1) = results
    close(l1, l0, "loss", atol=1e-6, rtol=1e-6)
    assert g0.keys() == g1.keys()
    for k in g0:   # tiles sum the MLP's weight gradients in another order: rounding only
        close(g1[k], g0[k], k, atol=1e-3, rtol=1e-3)


def test_tied_lm_head_stays_16bit(emulate):
    """LoRA on a tied lm_head (Qwen2.5-0.5B/1.5B tie it to the embedding): its base stays 16-bit, counted with the
    reason; the embedding keeps its weight on the device."""
    cfg = transformers.AutoConfig.for_model(
        "qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, tie_word_embeddings=True)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(DEVICE)
    swift_liger.apply(m, fp8_base=True)
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    record = swift_liger.quantize_lora_bases(m)
    assert record["fp8_weights"] == 1 and list(record["kept_16bit"].values()) == [1]
    assert "tied" in next(iter(record["kept_16bit"]))
    emb = m.get_input_embeddings().weight
    assert type(emb) is torch.nn.Parameter and emb.device.type == DEVICE.split(":")[0]
    assert emb is m.get_output_embeddings().get_base_layer().weight


def test_generation_over_fp8_bases(emulate):
    """GRPO / GKD rollouts generate with the policy: no-grad decode steps through the fused LoRA path over FP8 bases
    (with transformers' cache and with our RollingKVCache sized to the call), logits within FP8 rounding of the
    16-bit model's."""
    from swift_liger.cache import install_rolling_cache, uninstall_rolling_cache
    ref, model = pair()
    swift_liger.quantize_lora_bases(model)
    ids, _ = batch()
    model.eval()
    ref.eval()
    call_counts(model, reset=True)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits, want = model(ids).logits, ref(ids).logits
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        install_rolling_cache(model, window="exact")
        try:
            ring = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        finally:
            uninstall_rolling_cache(model)
    assert call_counts(model)["lora_fused"] >= 3 * len(PROJECTIONS) * LAYERS
    rel = (logits.double() - want.double()).norm() / want.double().norm()
    assert rel < 0.1, rel.item()
    assert out.shape == ring.shape == (2, 28) and torch.equal(out, ring)


def test_all_stores_every_frozen_linear_of_attention_and_mlp(emulate):
    """fp8_base="all" with LoRA on q_proj / v_proj only: their bases and the other five frozen projections of each
    layer become FP8 (lm_head and the embedding stay as they are); the loss stays within FP8 rounding; revert
    restores every weight exactly."""
    ref = tiny()
    torch.manual_seed(3)
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                   target_modules=["q_proj", "v_proj"]))
    m = tiny()
    swift_liger.apply(m, fp8_base="all")
    torch.manual_seed(3)
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                               target_modules=["q_proj", "v_proj"]))
    linears = [mod for mod in m.modules() if type(mod) is torch.nn.Linear]
    before = {id(mod): mod.weight.detach().clone() for mod in linears}
    record = swift_liger.quantize_lora_bases(m)
    assert record["fp8_weights"] == len(PROJECTIONS) * LAYERS and record["kept_16bit"] == {}
    head = m.get_output_embeddings()
    assert type(head.weight) is torch.nn.Parameter and not isinstance(head.weight, Fp8Weight)
    ids, labels = batch()
    call_counts(m, reset=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        losses = [mod(ids, labels=labels).loss for mod in (ref, m)]
    close(losses[1], losses[0], "loss", atol=2e-2, rtol=2e-2)
    counts = call_counts(m)
    assert counts["fp8_base_calls"] == 5 * LAYERS and counts["lora_fused"] == 2 * LAYERS
    swift_liger.revert(m)
    for mod in linears:
        assert type(mod.weight) is torch.nn.Parameter and torch.equal(mod.weight, before[id(mod)])


def test_all_on_a_frozen_side_model(emulate):
    """A reference / teacher model (no LoRA, frozen whole): "all" stores its attention and MLP linears in FP8; its
    logits stay within FP8 rounding; with fp8_base=True it has no LoRA base to store."""
    want = tiny()
    side = tiny()
    swift_liger.apply(side, fp8_base="all", cross_entropy="off")
    side.requires_grad_(False).eval()
    record = swift_liger.quantize_lora_bases(side)
    assert record["fp8_weights"] == len(PROJECTIONS) * LAYERS
    ids, _ = batch()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, ref = side(ids).logits.double(), want(ids).logits.double()
    assert (got - ref).norm() / ref.norm() < 0.1
    lora_only = tiny()
    swift_liger.apply(lora_only, fp8_base=True)
    lora_only.requires_grad_(False)
    assert swift_liger.quantize_lora_bases(lora_only)["fp8_weights"] == 0


def test_fp8_base_values():
    from swift_liger.config import LigerConfig
    assert LigerConfig(fp8_base="all").fp8_base == "all"
    assert LigerConfig(fp8_base="lora").fp8_base is True and LigerConfig(fp8_base="false").fp8_base is False
    with pytest.raises(ValueError, match="fp8_base must be true .* false, or all"):
        LigerConfig(fp8_base="everything")


def test_size_rule():
    """On a GPU a weight [out, in] becomes FP8 only where in*out/(in+out) reaches MIN_SIZE (measured: smaller ones ran
    slower than bf16); emulated FP8 on the CPU takes every size; min_size=0 takes every size anywhere."""
    from swift_liger.patching.fp8 import MIN_SIZE, size_problem
    assert MIN_SIZE == 0   # this module's fixture; the default is restored after each test
    assert size_problem(3584, 3584, "cuda", 1280) is None and size_problem(18944, 3584, "cuda", 1280) is None
    assert size_problem(8960, 1536, "cuda", 1280) is None          # 1311: Qwen2.5-1.5B's MLP
    for out, in_ in ((512, 3584), (1536, 1536), (256, 1536)):      # k/v projections, 1.5B's q/o
        assert "too small for FP8 to pay" in size_problem(out, in_, "cuda", 1280)
    assert size_problem(16, 32, "cpu", 1280) is None and size_problem(16, 32, "cuda", 0) is None


def test_small_weights_stay_16bit_on_a_gpu(emulate, monkeypatch):
    """quantize_lora_bases applies the size rule (a GPU pretended here) and min_size=0 lifts it."""
    monkeypatch.setattr(fp8_patch, "MIN_SIZE", 1280)
    rule = fp8_patch.size_problem
    monkeypatch.setattr(fp8_patch, "size_problem", lambda o, i, device, m=None: rule(o, i, "cuda", m))
    _, m = pair()
    record = swift_liger.quantize_lora_bases(m)
    assert record["fp8_weights"] == 0, record
    assert record["kept_16bit"] == {"too small for FP8 to pay (in*out/(in+out) < 1280)": LAYERS * 7}, record
    _, m = pair()
    assert swift_liger.quantize_lora_bases(m, min_size=0)["fp8_weights"] == LAYERS * 7
