"""patching/lora.lora_parts reuses plain_lora_parts' decision per layer: after every change of what that decision reads,
the reused answer is the one the full check gives (never a stale fused call after PEFT disables, merges or swaps an
adapter, or a hook, mode, dtype or grad flag changes)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from swift_liger.patching import lora as L

peft = pytest.importorskip("peft")


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 24, bias=True)


def _layer(dropout=0.1):
    model = peft.get_peft_model(_Attn(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                         target_modules=["q_proj"]))
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, lora_dropout=0.0, target_modules=["q_proj"]))
    model.train()
    return model, model.base_model.model.q_proj


def _same(layer, x):
    got, want = L.lora_parts(layer, x), L.plain_lora_parts(layer, x)
    if want is None:
        assert got is None
    else:
        assert got is not None and len(got) == len(want)
        assert all(g is w for g, w in zip(got, want)), (got, want)
    return got


def test_reused_decision_follows_every_change():
    model, layer = _layer()
    x = torch.randn(3, 16)
    first = _same(layer, x)
    assert first is not None and first[6] == pytest.approx(0.1)       # dropout drawn inside the op
    assert L.lora_parts(layer, x) is first                            # a hit: the cached tuple itself
    steps = []

    @contextlib.contextmanager
    def step(name):
        steps.append(name)
        yield
        _same(layer, x)

    with step("adapters disabled"):
        layer.enable_adapters(False)
        assert L.lora_parts(layer, x) is None
    layer.enable_adapters(True)
    _same(layer, x)
    with step("other adapter active"):
        model.set_adapter("second")
        assert L.lora_parts(layer, x)[4] == pytest.approx(1.0)       # its own scaling
    model.set_adapter("default")
    with step("eval mode"):
        model.eval()
        assert L.lora_parts(layer, x)[6] == 0.0
    model.train()
    with step("hook"):
        h = layer.lora_A["default"].register_forward_hook(lambda *a: None)
        assert L.lora_parts(layer, x) is None
    h.remove()
    with step("base weight trainable"):
        layer.base_layer.weight.requires_grad_(True)
        assert L.lora_parts(layer, x) is None
    layer.base_layer.weight.requires_grad_(False)
    with step("merged"):
        layer.merge()
        assert L.lora_parts(layer, x) is None
    layer.unmerge()
    with step("lora_A swapped"):
        layer.lora_A["default"] = torch.nn.Linear(16, 4, bias=True)
        assert L.lora_parts(layer, x) is None
    with step("x in another dtype"):
        layer.lora_A["default"] = torch.nn.Linear(16, 4, bias=False)
        assert L.lora_parts(layer, x.double()) is None
    with step("non-contiguous x"):
        xt = torch.randn(16, 3).t()
        parts = L.lora_parts(layer, xt)
        assert parts[6] == 0.0 and parts[7] is True                   # the module's own dropout first
    with step("autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert L.lora_parts(layer, x) is None                         # fp32 x under bf16 autocast: PEFT's forward
    with step("weights cast in place"):
        model.to(torch.float64)
        assert L.lora_parts(layer, x) is None and L.lora_parts(layer, x.double()) is not None
    assert len(steps) == 11


def test_deep_copy_and_collection():
    import copy
    import gc
    model, layer = _layer(dropout=0.0)
    x = torch.randn(2, 16)
    assert L.lora_parts(layer, x) is not None and layer in L._PARTS
    twin = copy.deepcopy(model).base_model.model.q_proj
    assert twin not in L._PARTS
    assert L.lora_parts(twin, x)[0] is twin.base_layer.weight
    import weakref
    gone = weakref.ref(layer)
    del model, layer
    gc.collect()
    assert gone() is None   # the cache did not keep the layer alive
