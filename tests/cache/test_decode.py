"""The decode runner (swift_liger/cache/decode.py): single-token steps with the split-KV decode kernel, eager and
as CUDA-graph steps (run eagerly on CPU), equal to the SDPA path."""
import pytest
import torch

from helpers import assert_close, left_padded
from ring_helpers import GPU, SINKS, WINDOW, count_layouts, generate, tiny_model
from swift_liger.cache import RollingKVCache, decode, planner, ring, uninstall_rolling_cache


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_eager_decode_kernel_matches_sdpa(device, mode, monkeypatch):
    """Unpadded single-token steps (before and after the wrap) attending with the split-KV decode kernel give the
    tokens and logits of the SDPA path (on CPU forced on; on CUDA it is the default)."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 3), device=device)
    monkeypatch.setattr(planner, "DECODE_KERNEL_DEVICES", ())
    want, want_logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, None, 12)
    monkeypatch.setattr(planner, "DECODE_KERNEL_DEVICES", ("cuda", "cpu"))
    attended, fused, ring_writes = [], [], []
    kernel, kernel_w = decode.decode_attention_unchecked, decode.decode_attention_write_unchecked
    ring_write = ring.kv_ring_write_unchecked
    monkeypatch.setattr(decode, "decode_attention_unchecked", lambda *a: attended.append(a[1].shape[2]) or kernel(*a))
    monkeypatch.setattr(decode, "decode_attention_write_unchecked",
                        lambda *a: fused.append(a[1].shape[2]) or kernel_w(*a))
    monkeypatch.setattr(ring, "kv_ring_write_unchecked", lambda *a: ring_writes.append(a[2].shape[2]) or
                        ring_write(*a))
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, None, 12)
    # 11 decode steps x 2 layers; key lengths grow 4..8 (prefix views of the ring), then stay at sinks + window.
    # Every decode token lands at stream index >= sinks, so each layer's attention launch also stores its token
    # (the write is fused; streaming mode's sink rotation is one launch for all layers): no separate ring write.
    assert attended == [] and len(fused) == 22
    assert sorted(set(fused)) == list(range(4, WINDOW + SINKS + 1))
    assert ring_writes == [3, 3]                     # the prompt's chunk, per layer
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, name="decode kernel logits")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_graph_decode_matches_eager(device, mode, monkeypatch):
    """cuda_graph=True: every decode step, before the wrap and after it, reads its position, slot, sink angle and
    visible length from a device counter (what the captured graph replays). On CPU the same body runs eagerly
    (forced here); on the GPU it is captured once and replayed. Either way the tokens and logits equal the eager
    fast path's."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 5), device=device)
    want, want_logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, None, 16)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self._joint_ready and
                            not torch.is_grad_enabled())
    runs, attended = [], []
    original = RollingKVCache._graph_run
    monkeypatch.setattr(RollingKVCache, "_graph_run", lambda self, *a: runs.append(1) or original(self, *a))
    kernel, kernel_w = decode.decode_attention_unchecked, decode.decode_attention_write_unchecked
    monkeypatch.setattr(decode, "decode_attention_unchecked", lambda *a: attended.append(1) or kernel(*a))
    monkeypatch.setattr(decode, "decode_attention_write_unchecked", lambda *a: attended.append(1) or kernel_w(*a))
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode, cuda_graph=True)
    seqs, logits = generate(model, cache, ids, torch.ones_like(ids), 16)
    # 16 new tokens: the prompt's forward, then 15 decode steps, each through the graph (3 of them before the
    # ring of sinks + window = 8 slots is full)
    assert len(runs) == 15
    # Calls per layer: on CPU each of the 15 graph steps runs eagerly; on the GPU the first graph step runs it
    # twice (warm-up, capture), replays run no Python.
    assert len(attended) == (2 * 15 if not GPU else 2 * 2)
    # Graph steps attend with the split-KV decode kernel instead of SDPA: equal up to fp32 summation order.
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, name="graph logits")
    if GPU:
        assert cache._graph is not None, "no graph was captured"
    assert model.config._attn_implementation == "sdpa"
    uninstall_rolling_cache(model)
    assert "forward" not in model.model.__dict__


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_padded_and_sampled_graph_decode_matches_eager(device, mode, sample, monkeypatch):
    """cuda_graph=True on left-padded batches and with sampling: every decode step (rows of 11, 6 and 2 real
    tokens: before and after each row's ring is full) reads its per-row positions, slots, sink angles and visible
    lengths from a device buffer (captured once on the GPU, run eagerly on CPU); tokens equal the eager path's,
    logits up to the decode kernel's summation order."""
    model = tiny_model(device)
    ids, mask = left_padded([11, 6, 2], device)
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sample else {}
    torch.manual_seed(3)
    want, want_logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask,
                                 14, **kw)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self._joint_ready and
                            not torch.is_grad_enabled())
    seen = count_layouts(monkeypatch)
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode, cuda_graph=True)
    torch.manual_seed(3)
    seqs, logits = generate(model, cache, ids, mask, 14, **kw)
    assert seen.count(("rows", True)) == 13, seen   # 14 new tokens: the prompt's forward, then 13 graph steps
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, name="padded graph logits")
    if GPU:
        assert cache._graph is not None and cache._graph["key"][0] == "rows", "no graph was captured"
    if sample:   # and unpadded: the uniform graph path samples the same tokens as the eager one
        ids = ids[:1]
        torch.manual_seed(5)
        want, _ = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, None, 14, **kw)
        torch.manual_seed(5)
        got, _ = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode, cuda_graph=True),
                          ids, None, 14, **kw)
        assert torch.equal(got, want) and ("full", True) in seen


@pytest.mark.parametrize("padded", [False, True], ids=["uniform", "left-padded"])
def test_graph_decode_with_a_window_that_never_evicts_equals_the_default_cache(device, padded, monkeypatch):
    """A ring at least as long as prompt + new tokens never evicts, so graph decode is exact attention from the
    first step (how GRPO rollouts through ms-swift's pt engine use it): the sampled tokens equal transformers'
    default cache's, logits up to the decode kernel's summation order; every decode step is a graph step, none of
    them with the ring full."""
    model = tiny_model(device)
    ids, mask = left_padded([9, 4, 7], device) if padded else (torch.randint(2, 64, (2, 7), device=device), None)
    new = 12
    kw = dict(do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(11)
    want, want_logits = generate(model, None, ids, mask, new, **kw)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self._joint_ready and
                            not torch.is_grad_enabled())
    seen = count_layouts(monkeypatch)
    cache = RollingKVCache(model, window=ids.shape[1] + new, sinks=0, cuda_graph=True)
    torch.manual_seed(11)
    seqs, logits = generate(model, cache, ids, mask, new, **kw)
    assert seen[1:] == [("rows" if padded else "full", True)] * (new - 1), seen
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, name="never-evicting graph logits")
    if GPU:
        assert cache._graph is not None, "no graph was captured"


def test_graph_steps_asking_for_attentions_stay_eager_before_the_wrap(device, monkeypatch):
    """A step that asks for attention weights keeps the model's own attention (our decode attention returns none),
    so before the ring is full it must not be planned as a graph step over the whole storage."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (1, 3), device=device)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self._joint_ready and
                            not torch.is_grad_enabled())
    seen = count_layouts(monkeypatch)
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, cuda_graph=True)
    want, want_logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS), ids, None, 4)
    del seen[:]
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, output_logits=True,
                         output_attentions=True, return_dict_in_generate=True, pad_token_id=0, do_sample=False)
    assert all(not graph for _, graph in seen), seen
    assert torch.equal(out.sequences, want)
    assert_close(torch.stack(out.logits), want_logits.double(), torch.float32, name="output_attentions logits")


def test_a_decode_step_that_cannot_be_captured_decodes_on_eagerly(device, monkeypatch):
    """If capturing the decode step fails, that step returns its eager warm-up output (the cache advanced once),
    later steps of the call plan eagerly, and install_rolling_cache drops the graph for later calls and counts the
    error: the tokens equal the default cache's throughout. (On CPU the capture path is reached with stand-ins for
    torch.cuda's streams and a graph that refuses.)"""
    import contextlib
    import types as pytypes

    from swift_liger.cache import install, install_rolling_cache
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 5), device=device)
    want, want_logits = generate(model, None, ids, None, 8)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self.cuda_graph and self._joint_ready and
                            not torch.is_grad_enabled())
        monkeypatch.setattr(decode, "_capturable", lambda x: True)
        stream = pytypes.SimpleNamespace(wait_stream=lambda other: None)
        fake = pytypes.SimpleNamespace(current_stream=lambda dev=None: stream, Stream=lambda device=None: stream,
                                       stream=lambda s: contextlib.nullcontext(), CUDAGraph=object)
        monkeypatch.setattr(decode.torch, "cuda", pytypes.SimpleNamespace(**vars(fake), graph=None))

    def refuse(*a, **k):
        raise RuntimeError("capture refused for the test")
    monkeypatch.setattr(decode.torch.cuda, "graph", refuse)
    install_rolling_cache(model, "exact", cuda_graph=True)
    seen = count_layouts(monkeypatch)
    with pytest.warns(RuntimeWarning, match="capture refused for the test"):
        seqs, logits = generate(model, None, ids, None, 8)
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, name="logits after a failed capture")
    assert seen[1] == ("full", True) and all(not g for _, g in seen[2:]), seen   # one attempt, then eager
    counts = install.generate_counts(model)
    # the refused step ran eagerly and is counted so: no graph step at all
    assert counts["graph_steps"] == 0 and counts["forwards"] == 8
    assert counts["graph_error"] == "RuntimeError: capture refused for the test"
    del seen[:]
    seqs, _ = generate(model, None, ids, None, 8)   # the next call decodes without graphs from the start
    assert torch.equal(seqs, want) and all(not g for _, g in seen), seen
    uninstall_rolling_cache(model)
