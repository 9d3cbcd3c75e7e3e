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
    """cuda_graph=True: after the wrap each decode step reads its position, slot and sink angle from a device
    counter (what the captured graph replays). On CPU the same body runs eagerly (forced here); on the GPU it is
    captured once and replayed. Either way the tokens and logits equal the eager fast path's."""
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
    # 5 + 16 - 1 tokens fed; steps at stream index >= sinks + window (8) go through the graph: 20 - 8 = 12
    assert len(runs) == 12
    # Calls per layer: on CPU each of the 12 graph steps runs eagerly; on the GPU the 3 decode steps before the
    # wrap use the kernel eagerly, the first graph step runs it twice (warm-up, capture), replays run no Python.
    assert len(attended) == (2 * 12 if not GPU else 2 * (3 + 2))
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
    """cuda_graph=True on left-padded batches and with sampling: after every row's ring is full, each step reads
    its per-row positions, slots and sink angles from a device buffer (captured once on the GPU, run eagerly on
    CPU); tokens equal the eager path's, logits up to the decode kernel's summation order."""
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
    assert seen.count(("rows", True)) == 7, seen
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
