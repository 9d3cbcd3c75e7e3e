"""cudnn_attention (patching/sdpa_choice.py): a decoder layer's SDPA runs cuDNN-first where cuDNN timed faster.

On CPU the choice runs with a fake timer (device type "cpu", fp32 allowed): which calls get the order (the reentrant
first pass and its recompute), which keep torch's (masks, caches, short rows, other attention implementations, a
slower or refusing cuDNN), one timing per key, the order restored after every call (also when the layer raises),
revert, and the forward shared with graph_layers. `SWIFT_LIGER_TEST_GPU=1` adds the real timer and a bf16 training
step against torch's own order on CUDA.
"""
from __future__ import annotations

import copy

import pytest
import torch

from torch.nn.attention import SDPBackend

import swift_liger
from swift_liger.patching import layer_forward, sdpa_choice
from helpers import tiny_causal_lm

transformers = pytest.importorskip("transformers")
GPU = torch.cuda.is_available() and __import__("conftest").GPU
VOCAB, LAYERS = 128, 3


def build(attn="sdpa", **kw):
    kw.setdefault("cudnn_attention", True)
    m = tiny_causal_lm("llama", layers=LAYERS, vocab=VOCAB, attn=attn)
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.enable_input_require_grads()
    report = swift_liger.apply(m, **kw)
    return m, report


def on_cpu(model, cudnn_ms=1.0, flash_ms=2.0):
    """Make the model's choice run on CPU with a fake timer; returns (choice, timer calls)."""
    choice = model.model.layers[0].__dict__["_liger_sdpa"]
    choice.dtypes, choice.min_tokens = (torch.float32,), 4
    calls = []

    def timer(backend, rows, heads, kv, tokens, dim, dtype, grad, dev):
        calls.append((backend, rows, tokens, grad))
        ms = cudnn_ms if backend == sdpa_choice._CUDNN else flash_ms
        return None if ms is None else (ms, 10 * ms)
    choice.timer = timer
    return choice, calls


def orders_seen(model):
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args: seen.append((torch.is_grad_enabled(), list(torch._C._get_sdp_priority_order()))))
    return seen


def step(model, rows=2, t=12, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, t), generator=gen)
    out = model(ids, labels=ids, use_cache=False, **kw)
    out.loss.backward()
    return out.loss.detach()


def first(backend, order):
    return [int(backend)] + [int(b) for b in order if int(b) != int(backend)]


FLASH_FIRST = first(SDPBackend.FLASH_ATTENTION, torch._C._get_sdp_priority_order())


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """Torch's CPU build orders SDPA FlashAttention-2 first; its CUDA builds may start with cuDNN (torch 2.11 on the
    H200 does). The tests pin the flash-first order (restored after) unless they set another."""
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    monkeypatch.setattr(sdpa_choice.SdpaChoice, "device_type", "cpu")   # patch (and choose) as on CUDA
    saved = list(torch._C._get_sdp_priority_order())
    torch._C._set_sdp_priority_order(FLASH_FIRST)
    yield
    torch._C._set_sdp_priority_order(saved)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_no_cuda_device_installs_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(sdpa_choice.SdpaChoice, "device_type", "cuda")
    model, report = build()
    assert report.patched["cudnn_attention"] == 0 and not report.problems
    assert {"fusion": "cudnn_attention", "reason": "no CUDA device (cuDNN attention runs on one only)", "count": 1,
            "problem": False} in report.skipped
    assert all("_liger_sdpa" not in layer.__dict__ and "forward" not in layer.__dict__ for layer in model.model.layers)


def test_first_pass_and_recompute_run_cudnn_first_and_order_is_restored():
    ref, _ = build(cudnn_attention=False)
    model, report = build()
    assert report.patched["cudnn_attention"] == LAYERS and not report.problems
    assert all(isinstance(l.__dict__["forward"].__func__, type(layer_forward.forward)) and
               l.__dict__["forward"].__func__ is layer_forward.forward for l in model.model.layers)
    choice, calls = on_cpu(model)
    before = list(torch._C._get_sdp_priority_order())
    seen = orders_seen(model)
    assert torch.equal(step(model), step(ref))
    cudnn_first = sdpa_choice.cudnn_first(before)
    assert cudnn_first[0] == int(sdpa_choice._CUDNN) and sorted(cudnn_first) == sorted(before)
    assert seen == [(False, cudnn_first)] * LAYERS + [(True, cudnn_first)] * LAYERS   # first pass, then recomputes
    assert list(torch._C._get_sdp_priority_order()) == before
    assert len(calls) == 2 and {c[0] for c in calls} == {sdpa_choice._FLASH, sdpa_choice._CUDNN}
    assert all(c[3] for c in calls)          # a training layer times forward + backward
    counts = swift_liger.call_counts(model)["sdpa"]
    assert counts["cudnn_calls"] == 2 * LAYERS and counts["torch_calls"] == 0
    assert counts["measured"] == [{"rows": 2, "tokens": 12, "grad": True, "flash_ms": 2.0, "cudnn_ms": 1.0,
                                   "cudnn_first_ms": 10.0, "chose": "cudnn"}]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))


def test_one_timing_per_key_and_lengths_share_a_power_of_two_bucket():
    model, _ = build()
    choice, calls = on_cpu(model)
    step(model, t=12)
    step(model, t=15)          # same bucket (16): no new timing
    assert len(calls) == 2
    step(model, t=17)          # bucket 32
    step(model, rows=3, t=12)  # other rows
    assert len(calls) == 6 and len(choice.stats["measured"]) == 3


@pytest.mark.parametrize("cudnn_ms, flash_ms", [(1.0, 1.0), (0.98, 1.0), (None, 1.0)])
def test_cudnn_not_faster_or_refused_keeps_torch_order(cudnn_ms, flash_ms):
    model, _ = build()
    choice, calls = on_cpu(model, cudnn_ms=cudnn_ms, flash_ms=flash_ms)
    before = list(torch._C._get_sdp_priority_order())
    seen = orders_seen(model)
    step(model)
    assert all(order == before for _, order in seen) and len(seen) == 2 * LAYERS
    assert choice.stats["torch_calls"] == 2 * LAYERS and choice.stats["cudnn_calls"] == 0
    assert choice.stats["measured"][0]["chose"] == "torch"


def test_flash_refused_and_cudnn_supported_chooses_cudnn():
    model, _ = build()
    choice, _ = on_cpu(model, cudnn_ms=5.0, flash_ms=None)
    step(model)
    assert choice.stats["cudnn_calls"] == 2 * LAYERS


def test_calls_that_keep_torch_order_are_not_timed():
    model, _ = build()
    choice, calls = on_cpu(model)
    before = list(torch._C._get_sdp_priority_order())
    seen = orders_seen(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                   # left padding: a mask tensor reaches the layers
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    choice.min_tokens = 64
    step(model, t=12)                                 # rows shorter than min_tokens
    choice.min_tokens = 4
    model.eval()
    with torch.no_grad():
        model(ids[:, :8], use_cache=True)             # a KV cache
    model.train()
    model.config._attn_implementation = "eager"       # not SDPA
    step(model)
    assert calls == [] and all(order == before for _, order in seen) and seen
    assert choice.stats == {"cudnn_calls": 0, "torch_calls": 0, "cudnn_already": 0, "measured": []}


def test_order_restored_when_the_layer_raises():
    model, _ = build()
    on_cpu(model)
    before = list(torch._C._get_sdp_priority_order())

    def boom(mod, args):
        raise RuntimeError("boom")
    model.model.layers[1].self_attn.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        step(model)
    assert list(torch._C._get_sdp_priority_order()) == before


def test_shares_the_layer_forward_with_graph_layers_and_reverts(monkeypatch):
    from swift_liger.patching import layer_graphs
    monkeypatch.setattr(layer_graphs.LayerGraphs, "backend_for", lambda device: None)   # patch as if on CUDA
    model, report = build(graph_layers=True)
    assert report.patched["cudnn_attention"] == LAYERS and report.patched["graph_layers"] == LAYERS
    for layer in model.model.layers:
        assert layer.__dict__["forward"].__func__ is layer_forward.forward
        assert "_liger_sdpa" in layer.__dict__ and "_liger_graphs" in layer.__dict__
    swift_liger.revert(model)
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__ and "_liger_sdpa" not in layer.__dict__
        assert "_liger_graphs" not in layer.__dict__


def test_off_installs_nothing_and_deep_copy_keeps_its_own_choice():
    model, report = build(cudnn_attention=False, graph_layers=False)
    assert report.patched["cudnn_attention"] == 0
    assert all("forward" not in l.__dict__ for l in model.model.layers)
    model2, _ = build()
    twin = copy.deepcopy(model2)
    assert twin.model.layers[0].__dict__["_liger_sdpa"] is not model2.model.layers[0].__dict__["_liger_sdpa"]
    choice, calls = on_cpu(twin)
    step(twin)
    assert calls and choice.stats["cudnn_calls"] == 2 * LAYERS


def test_flag_and_preset_values():
    from swift_liger.config import LigerConfig
    from swift_liger.integration.arguments import find_preset
    assert LigerConfig().cudnn_attention is False     # opt-in until measured end to end on a GPU
    for preset, value in (("default", False), ("off", False), ("minimal", False), ("long_context", False)):
        assert LigerConfig.from_yaml(find_preset(preset)).cudnn_attention is value, preset
    with pytest.raises(TypeError, match="cudnn_attention"):
        LigerConfig(cudnn_attention="maybe")


@pytest.mark.skipif(not GPU, reason="GPU test (SWIFT_LIGER_TEST_GPU=1)")
def test_gpu_real_timer_and_a_bf16_step_matches_torch_order(monkeypatch):
    monkeypatch.setattr(sdpa_choice.SdpaChoice, "device_type", "cuda")
    for backend in (sdpa_choice._FLASH, sdpa_choice._CUDNN):
        state = torch.cuda.get_rng_state()
        got = sdpa_choice.time_backend(backend, 2, 4, 2, 1024, 64, torch.bfloat16, True, torch.device("cuda"))
        assert got is None or (got[0] > 0 and got[1] > 0)
        assert torch.equal(torch.cuda.get_rng_state(), state)
    torch.manual_seed(0)
    base = tiny_causal_lm("llama", layers=LAYERS, vocab=VOCAB, attn="sdpa").to("cuda", torch.bfloat16)
    runs = []
    for on in (False, True):
        m = copy.deepcopy(base)
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.enable_input_require_grads()
        swift_liger.apply(m, cudnn_attention=on, graph_layers=False)
        if on:
            choice = m.model.layers[0].__dict__["_liger_sdpa"]
            choice.min_tokens = 256
        ids = torch.randint(2, VOCAB, (2, 1000), generator=torch.Generator().manual_seed(1)).cuda()
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        runs.append((loss.float().item(), [p.grad.float() for p in m.parameters() if p.grad is not None]))
        if on:   # timed only where torch's own order does not start with cuDNN (torch 2.11 on Hopper does)
            torch_first = torch._C._get_sdp_priority_order()[0] == int(sdpa_choice._CUDNN)
            assert bool(choice.stats["measured"]) != torch_first, choice.stats
            assert choice.stats["cudnn_calls"] + choice.stats["torch_calls"] == 2 * LAYERS
    (l0, g0), (l1, g1) = runs
    assert abs(l0 - l1) <= 1e-2 * abs(l0)
    for a, b in zip(g0, g1):
        assert torch.isfinite(b).all() and (a - b).norm() <= 5e-2 * a.norm() + 1e-6


def test_timing_inputs_leave_the_global_rng_alone():
    """The timer's random tensors come from their own generator: a reentrant recompute replays the first pass's
    dropout draws from the global RNG, which a timing inside the first pass must not move."""
    state = torch.get_rng_state()
    q, k, v, do = sdpa_choice.inputs(2, 4, 2, 16, 8, torch.float32, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert q.shape == do.shape == (2, 4, 16, 8) and k.shape == v.shape == (2, 2, 16, 8)
    assert not torch.equal(k, v) and torch.equal(q, sdpa_choice.inputs(2, 4, 2, 16, 8, torch.float32, "cpu")[0])


def test_first_step_log_line():
    from swift_liger.integration.runtime import describe   # imports no ms-swift module at import time
    sdpa = {"cudnn_calls": 56, "torch_calls": 0,
            "measured": [{"rows": 1, "tokens": 8128, "grad": True, "flash_ms": 5.9, "cudnn_ms": 3.4,
                          "cudnn_first_ms": 61.0, "chose": "cudnn"},
                         {"rows": 1, "tokens": 700, "grad": True, "flash_ms": 0.2, "cudnn_ms": None,
                          "cudnn_first_ms": None, "chose": "torch"}]}
    assert describe({"policy": {"sdpa": sdpa, "cross_entropy_mode": "off"}}) == [
        "cudnn_attention in the first step: 56 decoder-layer calls ran SDPA cuDNN-first, 0 in torch's own order; "
        "timed per batch shape, attention ms FlashAttention-2 vs cuDNN: 1 x 8128 tokens "
        "5.90 vs 3.40 (cuDNN's first call 61.00) -> cudnn; 1 x 700 tokens 0.20 vs refused -> torch"]
    already = {"cudnn_calls": 0, "torch_calls": 56, "cudnn_already": 56, "measured": []}
    assert describe({"policy": {"sdpa": already, "cross_entropy_mode": "off"}}) == [
        "cudnn_attention in the first step: 0 decoder-layer calls ran SDPA cuDNN-first, 56 in torch's own order "
        "(torch's order starts with cuDNN here: nothing timed)"]
    idle = {"cudnn_calls": 0, "torch_calls": 0, "measured": []}   # CPU: no call qualifies, nothing said
    assert describe({"policy": {"sdpa": idle, "cross_entropy_mode": "off"}}) == []


def test_layers_replayed_from_graphs_keep_torch_order():
    """A pass graph_layers replays (its capture included) runs before any order is set; a pass it leaves eager gets
    the cuDNN-first order."""
    model, _ = build(graph_layers=True)
    choice, calls = on_cpu(model)
    before = list(torch._C._get_sdp_priority_order())
    seen = []

    class FakeGraphs:   # replays the first layer's passes (returns the eager result), leaves the rest eager
        def __init__(self, replay):
            self.replay = replay

        def forward(self, layer, call, hidden_states, **kwargs):
            seen.append((self.replay, list(torch._C._get_sdp_priority_order())))
            return call(layer, hidden_states, **kwargs) if self.replay else None
    for i, layer in enumerate(model.model.layers):
        layer.__dict__["_liger_graphs"] = FakeGraphs(i == 0)
    inner = orders_seen(model)
    step(model)
    assert seen and all(order == before for _, order in seen)
    n_eager = sum(1 for replay, _ in seen if not replay)
    assert choice.stats["cudnn_calls"] == n_eager == 2 * (LAYERS - 1)
    assert sum(order != before for _, order in inner) == n_eager


def test_torch_order_already_cudnn_first_times_nothing():
    """Where torch's SDPA order already starts with cuDNN (torch 2.11's CUDA build on the H200), every call keeps it:
    nothing is timed, nothing reordered, the step equals the unpatched model's."""
    ref, _ = build(cudnn_attention=False)
    model, _ = build()
    choice, calls = on_cpu(model)
    mine = sdpa_choice.cudnn_first(FLASH_FIRST)
    torch._C._set_sdp_priority_order(mine)
    seen = orders_seen(model)
    assert torch.equal(step(model), step(ref))
    assert not calls and choice.stats == {"cudnn_calls": 0, "torch_calls": 2 * LAYERS,
                                             "cudnn_already": 2 * LAYERS, "measured": []}
    assert all(order == mine for _, order in seen) and list(torch._C._get_sdp_priority_order()) == mine
