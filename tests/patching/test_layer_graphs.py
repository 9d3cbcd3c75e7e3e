"""graph_layers (patching/layer_graphs.py): decoder layers replayed from captured graphs under reentrant checkpointing.

On CPU a stand-in backend re-runs each captured function at replay (same static buffers, same order of copies and
replays, same padding), so everything but the CUDA graph itself is checked here against the same model run eagerly:
losses and every adapter gradient over steps of different lengths (padded to shared buckets), with a padding mask,
with LoRA dropout, and the passes that must run eagerly. `SWIFT_LIGER_TEST_GPU=1` runs the same tests with real CUDA
graphs.
"""
import contextlib
import copy

import pytest
import torch

import swift_liger
from swift_liger.patching import layer_graphs
from helpers import tiny_causal_lm

GPU = torch.cuda.is_available() and __import__("conftest").GPU


class RerunBackend:
    """CPU stand-in for CUDA graphs: capture runs the function, replay runs it again in the captured mode. No timer:
    every replayable key replays (tests of the measured choice set one)."""
    keep_capture_outputs = True
    timer = None

    @staticmethod
    def release():
        pass

    def __init__(self, device):
        self.device = device

    def side(self):
        return contextlib.nullcontext()

    def begin(self):
        pass

    def end(self):
        pass

    def capture(self, fn):
        dt, en = torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")
        fn()

        class Replay:
            @staticmethod
            def replay():
                with torch.enable_grad(), torch.autocast("cpu", dtype=dt, enabled=en, cache_enabled=False):
                    fn()
        return Replay()

    @staticmethod
    def rng_state(device):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device):
        torch.set_rng_state(state)


@pytest.fixture
def backend(monkeypatch, device):
    if device.type == "cpu":   # the plumbing under test, with the reference ops (the kernels have their own tests)
        monkeypatch.setattr(layer_graphs.LayerGraphs, "backend_for", RerunBackend)
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    return device


def models(device, dropout=0.0, family="qwen2", layers=3, dtype=torch.float32, pad_masks=False, **lora):
    """The same tiny model eager and under graph_layers, LoRA r4 on every linear (or as `lora` says); both with
    drop_pad_mask where pad_masks."""
    from peft import LoraConfig, get_peft_model
    lora = {"target_modules": "all-linear", **lora}
    base = tiny_causal_lm(family, layers=layers, attn="sdpa").to(device, dtype)
    out = []
    for graphs in (False, True):
        m = copy.deepcopy(base)
        swift_liger.apply(m, graph_layers=graphs, drop_pad_mask=pad_masks)
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.enable_input_require_grads()
        torch.manual_seed(5)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, **lora))
        m.train()
        out.append(m)
    return out


def step(model, ids, mask=None, seed=0):
    torch.manual_seed(seed)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(a, b, atol=2e-5, rtol=1e-4):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(lb, la, atol=atol, rtol=rtol)
    assert ga.keys() == gb.keys() and ga
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], atol=atol, rtol=rtol, msg=k)


def stats(model):
    return swift_liger.call_counts(model)["graph_layers"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_no_cuda_device_installs_nothing_and_says_so():
    model = tiny_causal_lm("qwen2", layers=2)
    report = swift_liger.apply(model)
    assert report.patched["graph_layers"] == 0 and not report.problems
    assert {"fusion": "graph_layers", "reason": "no CUDA device (CUDA graphs replay on one only)", "count": 1,
            "problem": False} in report.skipped
    assert all("_liger_graphs" not in layer.__dict__ for layer in model.model.layers)
    assert "CUDA graphs of" not in str(report)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_replayed_layers_match_eager_over_lengths(backend, dropout):
    device = backend
    eager, graphed = models(device, dropout)
    g = torch.Generator().manual_seed(0)
    # buckets 16, 16, 32, 16: captures for two keys, reused. With dropout, lengths that need no padding: a padded
    # row draws its dropout mask over more elements (other draws, as valid, not the eager ones)
    for i, n in enumerate([13, 16, 20, 13] if dropout == 0 else [16, 16, 32, 16]):
        ids = torch.randint(2, 128, (2, n), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    s = stats(graphed)
    assert s["captures"] == 2 * 3 and s["replays"] == 4 * 3 * 2, s   # 2 keys x 3 layers; 2 replays per layer call
    assert not s["eager"], s


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compile_ahead_pass_changes_nothing(backend, monkeypatch, dropout):
    """SWIFT_LIGER_COMPILE_AHEAD=1: before each new key's first call, one pass of the layer (autograd off, then on,
    and its backward) inside ops._launch.compile_ahead; losses, every adapter gradient and the dropout draws stay
    the eager run's (the RNG state is restored, no gradient lands on a parameter). On the GPU our kernels only
    compile there; on CPU the pass runs the reference ops."""
    monkeypatch.setenv("SWIFT_LIGER_COMPILE_AHEAD", "1")
    entered = []
    real = layer_graphs._launch.compile_ahead

    @contextlib.contextmanager
    def spy(*args, **kwargs):
        with real(*args, **kwargs) as ahead:
            entered.append(ahead)
            yield ahead
    monkeypatch.setattr(layer_graphs._launch, "compile_ahead", spy)
    eager, graphed = models(backend, dropout)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate([16, 16, 32, 16]):
        ids = torch.randint(2, 128, (2, n), generator=g).to(backend)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    s = stats(graphed)
    assert len(entered) == 2 and s["capture_parts_s"]["compile_ahead"] > 0, s   # once per key: 16 and 32 tokens
    assert s["compile_ahead_error"] is None and s["compile_ahead_failed"] == 0, s
    if GPU:
        assert all(a is not None for a in entered)


def test_padding_mask_rows_match_eager(backend):
    device = backend
    eager, graphed = models(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (3, 11), generator=g).to(device)
    mask = torch.ones(3, 11, dtype=torch.long, device=device)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    assert_same(step(eager, ids, mask), step(graphed, ids, mask))
    s = stats(graphed)
    assert s["captures"] == 3 and not s["eager"], s


def test_eager_passes_counted_by_reason(backend, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_GRAPH_NO_GRAD", "0")   # autograd-off passes eager, counted with their reason
    device = backend
    eager, graphed = models(device)
    ids = torch.randint(2, 128, (2, 9)).to(device)
    with torch.no_grad():   # evaluation / reference pass: input without grad
        graphed.eval()
        out_eval = graphed(input_ids=ids).logits
        graphed.train()
        eager.eval()
        torch.testing.assert_close(out_eval, eager(input_ids=ids).logits)
        eager.train()
    graphed.base_model.model.gradient_checkpointing_disable()   # no checkpointing: autograd on outside a recompute
    eager.base_model.model.gradient_checkpointing_disable()
    assert_same(step(eager, ids), step(graphed, ids))
    s = stats(graphed)
    assert s["captures"] == 0 and s["replays"] == 0, s
    assert s["eager"] == {"autograd on outside a reentrant checkpoint's recompute": 3}, s


def test_inference_mode_runs_eagerly(backend):
    """A train-mode model called under torch.inference_mode (a generate call in a trainer): the input-require-grads
    hook still marks the embeddings' output, so the first layer looked like a reentrant first pass and loading its
    inference tensors into the static buffers raised. Every layer runs eagerly there, counted; training goes on."""
    device = backend
    eager, graphed = models(device)
    ids = torch.randint(2, 128, (2, 13)).to(device)
    assert_same(step(eager, ids), step(graphed, ids))
    with torch.inference_mode():
        torch.testing.assert_close(graphed(input_ids=ids).logits, eager(input_ids=ids).logits)
    assert_same(step(eager, ids, seed=1), step(graphed, ids, seed=1))
    s = stats(graphed)
    assert s["eager"] == {layer_graphs.INFERENCE_MODE: 3} and s["captures"] == 3, s


def test_autograd_off_passes_replay_their_forward(backend, monkeypatch):
    """By default (SWIFT_LIGER_GRAPH_NO_GRAD unset or 1) a reference pass (adapters disabled) between the policy's
    forward and its backward, as DPO runs it, and an evaluation pass replay their forward from graphs under keys of
    their own; the policy's recompute and backward then reload the static buffers the reference pass overwrote.
    Inference mode runs eagerly. Everything matches the eager model."""
    monkeypatch.delenv("SWIFT_LIGER_GRAPH_NO_GRAD", raising=False)
    device = backend
    eager, graphed = models(device)

    def dpo_like(model, ids, seed):
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=ids).loss
        with torch.no_grad(), model.disable_adapter():
            ref = model(input_ids=ids).logits
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            evaluated = model(input_ids=ids).logits
        model.train()
        return loss.detach(), grads, ref, evaluated

    g = torch.Generator().manual_seed(11)
    for i, n in enumerate([13, 20, 13]):   # buckets 16, 32, 16
        ids = torch.randint(2, 128, (2, n), generator=g).to(device)
        a, b = dpo_like(eager, ids, i), dpo_like(graphed, ids, i)
        assert_same(a[:2], b[:2])
        torch.testing.assert_close(b[2], a[2], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b[3], a[3], atol=2e-5, rtol=1e-4)
    s = stats(graphed)
    # The reference pass's first layer looks like a reentrant first pass (the input-require-grads hook marks the
    # embeddings' output under no_grad too): it replays a training key of its own, its recompute never comes. The
    # other layers and every layer in eval mode replay forward-only keys. Per bucket (2): training keys 3 layers,
    # reference 1 + 2, evaluation 3.
    assert s["captures"] == 2 * (3 + 1 + 2 + 3) and not s["eager"], s
    assert s["no_grad_replays"] == 3 * (2 + 3) and s["replays"] == 3 * (3 * 2 + 1) + s["no_grad_replays"], s
    members = graphed.base_model.model._swift_liger_state.parts["graph_layers"].members
    assert [m.pending for m in members] == [3, 0, 0]
    with torch.inference_mode():
        out = graphed(input_ids=ids).logits
    torch.testing.assert_close(out, eager(input_ids=ids).logits, atol=2e-5, rtol=1e-4)
    assert stats(graphed)["eager"] == {layer_graphs.INFERENCE_MODE: 3}
    from swift_liger.integration.runtime import describe   # lazy: the runtime's log lines
    line = describe({"policy": {"graph_layers": s, "cross_entropy_mode": "off"}})[0]
    assert "36 decoder-layer passes replayed from CUDA graphs (15 of them forwards of autograd-off passes)" in line


def padded_steps(eager, graphed, device, cuts):
    """A step of both models per (cut1, cut2): 3 rows of 11 tokens, rows 1 and 2 right-padded from those positions;
    losses and gradients equal."""
    g = torch.Generator().manual_seed(3)
    for i, cut in enumerate(cuts):
        ids = torch.randint(2, 128, (3, 11), generator=g).to(device)
        mask = torch.ones(3, 11, dtype=torch.long, device=device)
        mask[1, cut[0]:] = 0
        mask[2, cut[1]:] = 0
        assert_same(step(eager, ids, mask, seed=i), step(graphed, ids, mask, seed=i))


def test_masks_change_between_steps_and_gradients_accumulate(backend):
    """Steps of one key with other padding masks (the static mask is reloaded when the mask changes, not per layer),
    and two micro-batches accumulated before the gradients are read (.grad must not alias the static gradient
    buffers the next replay rewrites)."""
    device = backend
    eager, graphed = models(device)
    padded_steps(eager, graphed, device, [(7, 4), (9, 2), (11, 11)])
    for model in (eager, graphed):
        torch.manual_seed(0)
        for n in (13, 15):   # one bucket: the same static gradient buffers twice
            ids = torch.randint(2, 128, (2, n), generator=torch.Generator().manual_seed(n)).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (eager, graphed)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=2e-5, rtol=1e-4, msg=k)
    s = stats(graphed)
    assert s["captures"] == 3 * 3 and not s["eager"], s   # keys: [3, 16] with a mask, [3, 16] without, [2, 16]


def test_right_padded_batches_replay_the_unpadded_key_under_drop_pad_mask(backend):
    """With drop_pad_mask a right-padded batch reaches the layers without a mask: it replays the key of an unpadded
    batch of its length (no key with a mask, no capture of its own); loss and gradients as the eager model's."""
    eager, graphed = models(backend, pad_masks=True)
    padded_steps(eager, graphed, backend, [(11, 11), (7, 4), (9, 2)])
    s = stats(graphed)
    assert s["captures"] == 3 and s["replays"] > 0 and not s["eager"], s   # one key, [3, 16] without a mask
    assert swift_liger.call_counts(graphed)["pad_masks"] == {"dropped": 2, "kept": 0}


def test_seeded_lora_dropout_replays_like_eager(backend, monkeypatch):
    """A bf16 model with LoRA dropout: the dropout is drawn inside the rank-r products from a seed the captured
    graph draws from torch's generator (ops/lora_dropout_kernel.py), so replays (first pass and recompute) draw
    what the eager layers draw after the same seed, step after step."""
    from swift_liger.ops import lora_dropout_kernel
    device = backend
    if device.type == "cpu":   # the Triton kernels in the interpreter: the seeded path needs them
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "triton")
    eager, graphed = models(device, 0.1, layers=2, dtype=torch.bfloat16)
    calls = []
    real = lora_dropout_kernel.lora_down
    monkeypatch.setattr(lora_dropout_kernel, "lora_down", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    for i in range(3):   # under bf16 autocast, as ms-swift trains (fp32 adapters, bf16 products)
        ids = torch.randint(2, 128, (2, 16), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i), atol=2e-2, rtol=2e-2)
    assert calls   # the seeded path ran (eagerly, and in the captures)
    s = stats(graphed)
    assert s["captures"] == 2 and s["replays"] == 3 * 2 * 2 and not s["eager"], s


def test_measured_choice_runs_slower_graphs_eagerly(backend, monkeypatch):
    """A key whose replay is not faster than the eager layer (timed once, in the first layer) runs eagerly in every
    layer from then on; its graphs and static buffers are dropped; a faster key keeps replaying."""
    device = backend
    eager, graphed = models(device)
    timings = []

    def timer(fn, host_hint=None):   # (host, GPU) s of 3 calls: replays 0.1 / 3 ms, eager 2.3 / 2.4 ms at 32 tokens,
        # 6 / 2.4 ms else
        t = (0.1e-3, 3e-3) if fn.__name__ == "replay" else (2.3e-3 if calls["tokens"] == 32 else 6e-3, 2.4e-3)
        timings.append((fn.__name__, t))
        fn()
        return t
    calls = {}
    real = layer_graphs.LayerGraphs._graphs_faster

    def spy(self, be, layer, call, e, slot, n, *a, **k):
        calls["tokens"] = slot.inputs[0].shape[1]
        return real(self, be, layer, call, e, slot, n, *a, **k)
    monkeypatch.setattr(layer_graphs.LayerGraphs, "_graphs_faster", spy)
    real_bound = layer_graphs.LayerGraphs._gpu_bound

    def spy_bound(self, be, layer, call, padded, *a, **k):
        calls["tokens"] = padded
        return real_bound(self, be, layer, call, padded, *a, **k)
    monkeypatch.setattr(layer_graphs.LayerGraphs, "_gpu_bound", spy_bound)
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    g = torch.Generator().manual_seed(4)
    for i, n in enumerate([20, 13, 30, 16]):   # buckets 32, 16, 32, 16
        ids = torch.randint(2, 128, (2, n), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    s = stats(graphed)
    # per key, first layer only: one eager round before the capture, then the interleaved rounds
    assert len(timings) == 2 * (1 + 2 * layer_graphs.MEASURE_REPS), timings
    assert [(m["tokens"], m["graphs"]) for m in s["measured"]] == [(32, False), (16, True)], s
    # the 32-token key: 3 layers' first passes in 2 steps (their recomputes follow the eager first pass, uncounted)
    assert s["eager"] == {"measured faster eagerly at this batch shape": 3 * 2}, s
    assert s["captures"] == 1 + 3 and s["replays"] == 2 * 3 * 2, s
    parts = s["capture_parts_s"]   # compile_ahead as well on CUDA, where it is the default
    assert set(parts) - {"compile_ahead"} == set(layer_graphs.PARTS) and all(v > 0 for v in parts.values()), parts
    assert abs(sum(s["capture_parts_s"].values()) - s["capture_s"]) < 0.01, s   # the parts add up (rounded)
    shared = graphed.base_model.model._swift_liger_state.parts["graph_layers"]
    assert [k[0][1] for k in shared.slots] == [16], list(shared.slots)


def test_gpu_bound_key_is_never_captured(backend, monkeypatch):
    """A new key whose eager forward the host issues in under GPU_BOUND of its GPU time is not captured: one untimed
    and one timed eager round in the first layer, then every layer runs it eagerly; the log says why."""
    device = backend
    eager, graphed = models(device)
    timings = []

    def timer(fn, host_hint=None):   # (host, GPU) s of 3 calls: the host at 0.3x the GPU
        timings.append(fn.__name__)
        fn()
        return (0.9e-3, 3e-3)
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    g = torch.Generator().manual_seed(5)
    for i in range(2):
        ids = torch.randint(2, 128, (2, 14), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    s = stats(graphed)
    assert timings == ["eager"], timings
    assert s["captures"] == 0 and s["replays"] == 0, s
    parts = s["capture_parts_s"]
    assert parts["eager_timing"] > 0, parts
    assert not any(v for k, v in parts.items() if k not in ("eager_timing", "compile_ahead")), parts
    assert s["eager"] == {"measured faster eagerly at this batch shape": 2 * 3}, s
    assert s["measured"] == [{"rows": 2, "tokens": 16, "eager_ms": 1.0, "graph_ms": None, "eager_host_ms": 0.3,
                              "eager_gpu_ms": 1.0, "graph_host_ms": None, "graph_gpu_ms": None, "graphs": False,
                              "when": "before capture"}], s
    shared = graphed.base_model.model._swift_liger_state.parts["graph_layers"]
    assert not shared.slots
    from swift_liger.integration.runtime import describe   # lazy: the runtime's log lines, as in the test below
    line = describe({"policy": {"graph_layers": s, "cross_entropy_mode": "off"}})[0]
    assert "1.00 eager (host 0.30, GPU 1.00: GPU-bound, not captured) -> eager" in line, line


def test_gpu_bound_check_times_again_near_the_line(backend, monkeypatch):
    """A first timed round with the host between GPU_BOUND and RETIME_BELOW of the GPU time is timed once more and
    the lower host time decides: here 0.85x, then 0.3x: not captured. Far from the line (0.3x, or the host above
    RETIME_BELOW) one round decides (test_gpu_bound_key_is_never_captured, the measured-choice tests)."""
    device = backend
    eager, graphed = models(device)
    answers = iter([(2.55e-3, 3e-3), (0.9e-3, 3e-3)])
    timings = []

    def timer(fn, host_hint=None):
        timings.append(fn.__name__)
        fn()
        return next(answers)
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    ids = torch.randint(2, 128, (2, 14), generator=torch.Generator().manual_seed(5)).to(device)
    assert_same(step(eager, ids), step(graphed, ids))
    s = stats(graphed)
    assert timings == ["eager", "eager"], timings
    assert s["captures"] == 0 and s["measured"][0]["eager_host_ms"] == 0.3, s


def run_recheck(device, monkeypatch, recheck: dict, steps: int, seed: int):
    """Trains `steps` steps of the graphed model beside the eager one (outputs and gradients equal) under a fake
    timer: the capture's rounds favour the replay clearly, later rounds (the recheck's) answer `recheck`
    ({"eager" | "replay": (host, GPU) seconds per call}). Returns the graphed model."""
    eager, graphed = models(device)
    capture = {"replay": (0.1e-3, 1e-3), "eager": (6e-3, 1e-3)}
    rounds = []

    def timer(fn, host_hint=None):
        times = capture if len(rounds) < 2 * layer_graphs.MEASURE_REPS else recheck
        rounds.append(fn.__name__)
        fn()
        return tuple(x * layer_graphs.MEASURE_CALLS for x in times[fn.__name__])
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        ids = torch.randint(2, 128, (2, 14), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    return graphed


def test_recheck_turns_a_key_eager_in_every_layer(backend, monkeypatch):
    """A key kept for graphs at its capture is timed again at its timing layer's RECHECK_AT-th first pass; when eager
    wins then, every layer drops its graphs for the key and runs it eagerly from that call on."""
    steps = layer_graphs.RECHECK_AT + 1
    graphed = run_recheck(backend, monkeypatch, {"replay": (0.1e-3, 3e-3), "eager": (1e-3, 2e-3)}, steps, seed=6)
    s = stats(graphed)
    assert [(m["graphs"], m["when"]) for m in s["measured"]] == [
        (True, "capture"), (False, f"first pass {layer_graphs.RECHECK_AT}")], s
    replayed_steps = layer_graphs.RECHECK_AT - 1
    assert s["replays"] == replayed_steps * 3 * 2 and s["captures"] == 3, s
    assert s["eager"] == {"measured faster eagerly at this batch shape": (steps - replayed_steps) * 3}, s
    shared = graphed.base_model.model._swift_liger_state.parts["graph_layers"]
    assert not shared.slots and all(not any(isinstance(v, layer_graphs._Entry) for v in m.entries.values())
                                    for m in shared.members), shared.members


def test_recheck_keeps_graphs_that_are_faster_by_less_than_the_margin(backend, monkeypatch):
    """The capture asks MARGIN of the replay; the recheck only that it be faster (RECHECK_MARGIN): times 4.7% apart
    (1.5B, 1 x 8k on the H200: 2.186 vs 2.083 ms) keep a kept key's graphs at the recheck, and the steps after it
    replay. At the capture the same times would have left the key eager (2.083 is not MARGIN under 2.186)."""
    assert layer_graphs.RECHECK_MARGIN < 1 - 2.083 / 2.186 < layer_graphs.MARGIN
    steps = layer_graphs.RECHECK_AT + 2
    graphed = run_recheck(backend, monkeypatch, {"replay": (0.1e-3, 2.083e-3), "eager": (2.186e-3, 2.07e-3)}, steps,
                          seed=9)
    s = stats(graphed)
    assert [(m["graphs"], m["when"]) for m in s["measured"]] == [
        (True, "capture"), (True, f"first pass {layer_graphs.RECHECK_AT}")], s
    assert s["measured"][1]["graph_ms"] == 2.083 and s["measured"][1]["eager_ms"] == 2.186, s
    assert s["replays"] == steps * 3 * 2 and s["captures"] == 3 and not s["eager"], s


def test_timer_spins_from_the_last_rounds_host_time(backend, monkeypatch):
    """The timer's spin: a full one where no host time of the same calls is known (the capture's first round), else
    from the host time of the key's last round (the capture's later rounds, the recheck's every round) or, before a
    capture, from the untimed first call's."""
    device = backend
    eager, graphed = models(device)
    hints = []

    def timer(fn, host_hint=None):   # graphs win at the capture and at the recheck
        hints.append((fn.__name__, host_hint))
        fn()
        return (0.1e-3, 1e-3) if fn.__name__ == "replay" else (6e-3, 1e-3)
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    g = torch.Generator().manual_seed(8)
    for i in range(layer_graphs.RECHECK_AT + 1):
        ids = torch.randint(2, 128, (2, 14), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    assert [m["when"] for m in stats(graphed)["measured"]] == ["capture", f"first pass {layer_graphs.RECHECK_AT}"]
    reps = layer_graphs.MEASURE_REPS
    assert hints[0][0] == "eager" and hints[0][1] > 0, hints   # before the capture: the untimed call's
    assert hints[1:3] == [("eager", None), ("replay", None)], hints
    assert hints[3:] == [("eager", 6e-3), ("replay", 0.1e-3)] * (2 * reps - 1), hints


def test_spin_cycles():
    full = layer_graphs.SPIN_CYCLES
    assert layer_graphs.spin_cycles(None) == full
    assert layer_graphs.spin_cycles(1.0) == full   # at most the full spin
    assert abs(layer_graphs.spin_cycles(0.0) - full * layer_graphs.SPIN_FLOOR_S / layer_graphs.SPIN_S) <= 1
    assert abs(layer_graphs.spin_cycles(0.005) - full * 0.01 / layer_graphs.SPIN_S) <= 1   # 2x the host time


def test_layers_without_adapters_replay(backend):
    """Adapters on one layer only (layers_to_transform): the other layers' graphs have no parameter gradients."""
    device = backend
    eager, graphed = models(device, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1])
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(7)).to(device)
    assert_same(step(eager, ids), step(graphed, ids))
    s = stats(graphed)
    assert s["captures"] == 3 and s["replays"] == 3 * 2 and not s["eager"], s


def test_full_fine_tuning_runs_eagerly(backend):
    device = backend
    base = tiny_causal_lm("qwen2", layers=2, attn="sdpa").to(device)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    swift_liger.apply(model)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.train()
    ids = torch.randint(2, 128, (2, 12)).to(device)
    assert_same(step(ref, ids), step(model, ids), atol=1e-4, rtol=1e-3)
    s = stats(model)
    assert s["captures"] == 0 and s["eager"] == {"trainable parameters beyond adapters (full fine-tuning)": 2}, s


def test_fp8_bases_replay(backend, monkeypatch):
    """LoRA over FP8 bases (fp8_base): their FP8 rows and scales stay put, so the layers replay, and match eager."""
    device = backend
    monkeypatch.setenv("SWIFT_LIGER_FP8_EMULATE", "1")   # CPU: torch's reference FP8 GEMM
    monkeypatch.setattr("swift_liger.patching.fp8.MIN_SIZE", 0)   # the tiny weights are converted on a GPU too
    from peft import LoraConfig, get_peft_model
    base = tiny_causal_lm("qwen2", layers=2, attn="sdpa").to(device, torch.bfloat16)
    out = []
    for graphs in (False, True):
        m = copy.deepcopy(base)
        swift_liger.apply(m, graph_layers=graphs, fp8_base=True)
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.enable_input_require_grads()
        torch.manual_seed(5)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear"))
        assert swift_liger.quantize_lora_bases(m)["fp8_weights"] == 14
        m.train()
        out.append(m)
    eager, graphed = out
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(7)).to(device)
    for _ in range(2):
        assert_same(step(eager, ids), step(graphed, ids), atol=2e-2, rtol=2e-2)
    s = stats(graphed)
    assert s["captures"] == 2 and s["replays"] == 2 * 2 * 2 and not s["eager"], s


def test_varying_lengths_capture_each_key_once_in_one_store(backend):
    """Batches of many lengths and row counts, revisited in shuffled order (as a dataset of varying lengths brings
    them): each key is captured once (no least-recently-used churn below MAX_KEYS), every step matches eager, and the
    static buffers stay within twice the largest key's (views of one store), the parameters' gradient buffers one
    set per layer whatever the number of keys."""
    device = backend
    eager, graphed = models(device)
    g = torch.Generator().manual_seed(8)
    shapes = [(2, 13), (1, 40), (3, 21), (2, 70), (1, 9), (2, 33)]
    order = shapes + [shapes[i] for i in (2, 0, 5, 1, 3, 4, 0, 3)]
    for i, (rows, n) in enumerate(order):
        ids = torch.randint(2, 128, (rows, n), generator=g).to(device)
        mask = torch.ones(rows, n, dtype=torch.long, device=device)
        mask[-1, n // 2:] = 0 if rows > 1 else 1   # padded rows where there are several (the 4-D mask's keys)
        assert_same(step(eager, ids, mask, seed=i), step(graphed, ids, mask, seed=i))
    s = stats(graphed)
    assert s["captures"] == len(shapes) * 3 and s["replays"] == len(order) * 3 * 2 and not s["eager"], s
    assert s["keys_replayed"] == len(shapes) and s["static_mib"] > 0, s
    shared = graphed.base_model.model._swift_liger_state.parts["graph_layers"]
    hidden = graphed.config.hidden_size
    largest = max(r * layer_graphs.bucket(n) for r, n in shapes)
    need = 4 * largest * hidden * 4 + max(r * layer_graphs.bucket(n) ** 2 for r, n in shapes)   # fp32 x 4, mask
    assert need < shared.store.nbytes() - sum(t.numel() * t.element_size() for (role, *_), t in
                                               shared.store.flat.items() if role in ("cos", "sin", "pos")) <= 2 * need
    layer = shared.members[0]
    assert len(layer.gbufs) == sum(p.requires_grad for p in graphed.base_model.model.model.layers[0].parameters())


def test_keys_beyond_max_keys_are_dropped_and_captured_again(backend, monkeypatch):
    """More shapes than MAX_KEYS in turn: the least recently used key's graphs and views go, a returning shape is
    captured again over the same store, and every step still matches eager."""
    monkeypatch.setattr(layer_graphs, "MAX_KEYS", 1)   # 2 keys kept: twice MAX_KEYS with autograd-off graphs on
    device = backend
    eager, graphed = models(device)
    g = torch.Generator().manual_seed(10)
    lengths = [13, 30, 45, 13, 30]   # buckets 16, 32, 48, 16, 32: the last two were dropped before they return
    for i, n in enumerate(lengths):
        ids = torch.randint(2, 128, (2, n), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
    s = stats(graphed)
    assert s["captures"] == len(lengths) * 3 and s["replays"] == len(lengths) * 3 * 2 and not s["eager"], s
    shared = graphed.base_model.model._swift_liger_state.parts["graph_layers"]
    assert [k[0][1] for k in shared.slots] == [16, 32] and all(len(m.entries) == 2 for m in shared.members)


def test_moved_parameters_drop_the_graphs_then_run_eagerly(backend):
    """Graphs read the weights where the capture found them. A model moved off the device and back between calls
    (GKD's offload_teacher_model, GRPO's offload_model: every parameter in new memory) has its graphs dropped and
    captured again; moved a second time, its layers run eagerly from then on. Every step matches eager."""
    device = backend
    eager, graphed = models(device)
    ids = torch.randint(2, 128, (2, 13), generator=torch.Generator().manual_seed(3)).to(device)

    def move(model):   # what .to("cpu") then .to(device) does to each parameter: same values, new storage
        for p in model.parameters():
            p.data = p.data.clone()

    assert_same(step(eager, ids), step(graphed, ids))
    move(graphed)
    assert_same(step(eager, ids, seed=1), step(graphed, ids, seed=1))
    s = stats(graphed)
    assert s["captures"] == 2 * 3 and s["replays"] == 2 * 3 * 2 and not s["eager"], s
    move(graphed)
    assert_same(step(eager, ids, seed=2), step(graphed, ids, seed=2))
    s = stats(graphed)
    assert s["captures"] == 2 * 3 and s["replays"] == 2 * 3 * 2, s
    assert s["eager"] == {layer_graphs.MOVED: 3}, s   # each layer's first pass (its recompute follows it uncounted)


def test_store_reloads_what_another_key_overwrote():
    """Two keys' static buffers share the store's memory: loading one key after the other rewrites its inputs and
    padding even when the caller's tensors are the very ones loaded before (unchanged, same version)."""
    shared = layer_graphs.Shared()
    h = torch.arange(2 * 5 * 4, dtype=torch.float32).view(2, 5, 4) + 1
    cos, sin = torch.rand(2, 5, 3), torch.rand(2, 5, 3)
    pos = torch.arange(5).expand(2, 5)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril_()
    b = layer_graphs._new_slot(shared, 32, h, cos, sin, mask, pos)   # the larger first: the smaller fits its store
    a = layer_graphs._new_slot(shared, 16, h, cos, sin, mask, pos)
    assert a.inputs[0].data_ptr() == b.inputs[0].data_ptr() and a.out.data_ptr() == b.out.data_ptr()
    with torch.no_grad():
        layer_graphs._load(a, 5, h, cos, sin, mask, pos)
        h2, cos2 = h + 100, cos + 7
        mask2 = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
        layer_graphs._load(b, 5, h2, cos2, sin, mask2, pos)
        layer_graphs._load(a, 5, h, cos, sin, mask, pos)   # the same tensors as a's first load
    torch.testing.assert_close(a.inputs[0][:, :5], h)
    assert not a.inputs[0][:, 5:].any()
    torch.testing.assert_close(a.inputs[1][:, :5], cos)
    torch.testing.assert_close(a.inputs[3], layer_graphs._pad_mask(mask, 5, 16))
    torch.testing.assert_close(a.inputs[4][:, :5], pos)
    assert shared.last[0] is a


def test_measured_shape_decides_smaller_and_larger_ones(backend, monkeypatch):
    """A key timed faster replayed makes smaller shapes of its family replay untimed; one timed faster eagerly makes
    larger shapes run eagerly untimed; a shape neither decides is timed. All match eager."""
    device = backend
    timings = []
    verdict = {}

    def timer(fn, host_hint=None):   # replays 0.1 / 1 ms; eager 6 / 1 ms (host-bound) or 0.3 / 3 ms (GPU-bound),
        # as verdict says
        timings.append(fn.__name__)
        fn()
        if fn.__name__ == "replay":
            return (0.1e-3, 1e-3)
        return (6e-3, 1e-3) if verdict["host_bound"] else (0.9e-3, 9e-3)
    if device.type == "cpu":
        monkeypatch.setattr(RerunBackend, "timer", staticmethod(timer), raising=False)
    else:
        monkeypatch.setattr(layer_graphs._Backend, "timer", staticmethod(timer))
    g = torch.Generator().manual_seed(9)
    for host_bound, lengths in ((True, [30, 13, 20, 40]), (False, [13, 30, 16, 9])):
        verdict["host_bound"] = host_bound
        timings.clear()
        eager, graphed = models(device)
        for i, n in enumerate(lengths):
            ids = torch.randint(2, 128, (2, n), generator=g).to(device)
            assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i))
        s = stats(graphed)
        if host_bound:   # 32 timed (graphs); 16 and 32 inferred; 48 (larger) timed
            assert [(m["tokens"], m["graphs"]) for m in s["measured"]] == [(32, True), (48, True)], s
            assert s["inferred"] == 1 and s["captures"] == 3 * 3 and not s["eager"], s
            assert timings.count("eager") == 2 * (1 + layer_graphs.MEASURE_REPS), timings
        else:            # 16 timed (GPU-bound: eager); 32 inferred eager; 16 again; 16 (9 tokens) again
            assert [(m["tokens"], m["graphs"]) for m in s["measured"]] == [(16, False)], s
            assert s["inferred"] == 1 and s["captures"] == 0 and timings == ["eager"], (s, timings)
            assert s["eager"] == {layer_graphs.EAGER_MEASURED: 3 * 3, layer_graphs.EAGER_INFERRED: 3}, s
        from swift_liger.integration.runtime import describe   # lazy: the runtime's log lines
        line = describe({"policy": {"graph_layers": s, "cross_entropy_mode": "off"}}, when="in total")[0]
        assert "batch shapes decided by a measured one, untimed: 1" in line, line


def test_bucket_lengths():
    assert [layer_graphs.bucket(n) for n in (1, 16, 17, 100, 448, 449, 2011, 2048, 4097)] == \
        [16, 16, 32, 112, 448, 480, 2048, 2048, 4608]
    for n in range(1, 5000):
        b = layer_graphs.bucket(n)
        assert n <= b <= max(-(-n // 16) * 16, n + n // 8) and b % 16 == 0, n


def test_deepcopy_and_revert(backend):
    device = backend
    eager, graphed = models(device)
    ids = torch.randint(2, 128, (2, 10)).to(device)
    step(graphed, ids)
    clone = copy.deepcopy(graphed)   # the copy captures its own graphs, into its own counters
    assert_same(step(graphed, ids, seed=3), step(clone, ids, seed=3))
    assert stats(clone)["captures"] == 3 and stats(graphed)["captures"] == 3
    swift_liger.revert(graphed.base_model.model)
    layer = graphed.base_model.model.model.layers[0]
    assert "_liger_graphs" not in layer.__dict__ and "forward" not in layer.__dict__


def test_first_step_log_lines():
    from swift_liger.integration.runtime import describe   # imports no ms-swift module at import time
    graphs = {"captures": 24, "capture_s": 3.9, "replays": 48, "eager": {"a KV cache": 2},
              "capture_parts_s": {"eager_timing": 0.1, "warm_up": 1.6, "capture_forward": 0.8,
                                  "capture_backward": 1.4, "release_and_timing": 0.0},
              "measured": [{"rows": 8, "tokens": 448, "eager_ms": 1.904, "graph_ms": 0.213, "eager_host_ms": 1.904,
                            "eager_gpu_ms": 0.2, "graph_host_ms": 0.05, "graph_gpu_ms": 0.213, "graphs": True}]}
    lines = describe({"policy": {"graph_layers": graphs, "cross_entropy_mode": "off"},
                      "lora_fusion": {"ops.lora_linear": 175, "peft": 0}})
    assert lines == [
        "graph_layers in the first step: 48 decoder-layer passes replayed from CUDA graphs, 24 captured (3.9 s: a "
        "layer's first call per batch shape; eager timing 0.10; warm up 1.60; capture forward 0.80; capture "
        "backward 1.40); run eagerly: 2 x a KV cache; timed per batch shape, a layer's forward "
        "eager vs replayed, max(host, GPU) ms per call: 8 x 448 tokens 1.90 vs 0.21 (host 1.90 / 0.05, GPU 0.20 / "
        "0.21) -> graphs",
        "lora_fusion in the first step: 175 LoRA projection calls through ops.lora_linear, 0 through PEFT's forward "
        "(counted in Python: replayed layer passes run none, captures one)"]
    idle = {"captures": 0, "capture_s": 0.0, "replays": 0, "eager": {}}   # CPU: nothing replayed, nothing said
    assert describe({"policy": {"graph_layers": idle, "cross_entropy_mode": "off"}}) == []


def test_end_of_run_log_line():
    from swift_liger.integration.runtime import describe_run   # lazy: the runtime's log lines
    total = {"policy": {"graph_layers": {
        "captures": 528, "capture_s": 9.607, "replays": 1920, "eager": {layer_graphs.EAGER_INFERRED: 48},
        "measured": [{"rows": 1, "tokens": 384}] * 3, "inferred": 19, "keys_replayed": 22, "static_mib": 20.0,
        "device_outside_torch_mib": 1155}}}
    assert describe_run(total, 40) == [
        "graph_layers over 40 optimizer steps: 1920 decoder-layer passes replayed from CUDA graphs, 528 captured "
        "(9.6 s); batch shapes: 22 kept for graphs, 3 timings, 19 decided by a timed one; run eagerly: 48 x "
        f"{layer_graphs.EAGER_INFERRED}; static buffers 20 MiB; GPU memory outside torch's allocator 1155 MiB "
        "(the CUDA context, cuBLAS workspaces, the captured graphs: not in memory(GiB))"]
    idle = {"policy": {"graph_layers": {"captures": 0, "capture_s": 0.0, "replays": 0, "eager": {}}}}
    assert describe_run(idle, 3) == [] and describe_run({}, 3) == []   # CPU, or graph_layers off: nothing said
    off_cuda = {"policy": {"graph_layers": {"captures": 3, "capture_s": 0.1, "replays": 6, "eager": {},
                                            "static_mib": 0.1, "device_outside_torch_mib": None}}}
    assert describe_run(off_cuda, 2)[0].endswith("0 decided by a timed one; static buffers 0 MiB")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma3_text", "phi3", "glm4", "qwen3_moe",
                                    "qwen2_5_vl"])
def test_each_family_matches_eager(backend, family):
    """Every family's decoder layer under graph_layers (SDPA attention), against the same model run eagerly: lengths
    padded to a bucket, sliding-window layers (gemma3_text), fused projections (phi3, glm4), the VL text stack. MoE
    layers (qwen3_moe) take router arguments: eager, counted (their routing syncs with the host anyway)."""
    from peft import LoraConfig, get_peft_model
    from test_families import DEFAULT_TARGETS, TARGETS, build
    device = backend
    base = build(family, layers=2).to(device)
    out = []
    for graphs in (False, True):
        m = copy.deepcopy(base)
        m.config._attn_implementation = "sdpa"
        swift_liger.apply(m, graph_layers=graphs)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.enable_input_require_grads()
        torch.manual_seed(5)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                         target_modules=TARGETS.get(family, DEFAULT_TARGETS)))
        m.train()
        out.append(m)
    eager, graphed = out
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate([13, 16]):
        ids = torch.randint(2, 64, (2, n), generator=g).to(device)
        assert_same(step(eager, ids, seed=i), step(graphed, ids, seed=i), atol=5e-5, rtol=5e-4)
    s = stats(graphed)
    if family == "qwen3_moe":
        assert s["captures"] == 0 and set(s["eager"]) == {
            "arguments other than hidden states, mask, positions and position embeddings"}, s
    else:
        assert s["captures"] == 2 and s["replays"] == 8 and not s["eager"], s
