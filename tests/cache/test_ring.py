"""RollingKVCache on tiny random models (fp32): the cache's semantics end to end (swift_liger/cache/ring.py with the
planner and decode runner it mixes in).

* Until sinks + window tokens have been seen it must reproduce DynamicCache (bit for bit without padding).
* After that it must equal a from-scratch float64 recompute with the same semantics (`reference_logits` in
  ring_helpers.py): a hand-written attention that, for every query, gathers the visible keys (sinks + last
  `window`) and rotates them at that mode's positions (true positions, or 0..L-1 by order within the cache for
  "streaming"). It shares nothing with the cache's ring, masks or sink re-rotation.
"""
import pytest
import torch
from transformers import DynamicCache, LogitsProcessor

from helpers import assert_close, left_padded
from ring_helpers import (GPU, SINKS, WINDOW, check_chunks, check_generate_against_reference, generate,
                          reference_logits, run_chunks, tiny_model)
from swift_liger.cache import RollingKVCache


# ---------------------------------------------------------------------------------------------------------------
# Before the window fills: DynamicCache
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_equals_dynamic_cache_until_full(device, mode):
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 5), device=device)
    # 5 prompt + 3 fed-back tokens = sinks + window: every forward runs before anything is evicted.
    s_dyn, l_dyn = generate(model, DynamicCache(), ids, None, 4)
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode)
    s_roll, l_roll = generate(model, cache, ids, None, 4)
    assert torch.equal(s_roll, s_dyn)
    if GPU:   # kernel selection may differ with the strided storage view
        assert_close(l_roll, l_dyn.double(), torch.float32, name="logits")
    else:
        assert torch.equal(l_roll, l_dyn)
    assert cache.get_seq_length() == 8


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_equals_dynamic_cache_until_full_left_padded(device, mode):
    model = tiny_model(device)
    ids, mask = left_padded([5, 3, 1], device)
    s_dyn, l_dyn = generate(model, DynamicCache(), ids, mask, 4)
    s_roll, l_roll = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask, 4)
    assert torch.equal(s_roll, s_dyn)
    assert_close(l_roll, l_dyn.double(), torch.float32, name="logits")


# ---------------------------------------------------------------------------------------------------------------
# After the window wraps: from-scratch reference
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_generate_matches_reference_after_wrap(device, mode):
    """Left-padded prompts of different lengths, the longest longer than sinks + window; greedy decoding
    through several wraps."""
    model = tiny_model(device)
    ids, mask = left_padded([11, 6, 2], device)
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask, 14)
    check_generate_against_reference(model, ids, mask, seqs, logits, mode)


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_sampling_matches_reference(device, mode):
    model = tiny_model(device)
    ids, mask = left_padded([9, 4], device)
    torch.manual_seed(7)
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask, 12,
                            do_sample=True, top_k=0, temperature=1.0)
    check_generate_against_reference(model, ids, mask, seqs, logits, mode)


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_chunked_forwards_match_reference(device, mode):
    """Multi-token chunks at every fill level (first chunk padded, chunks longer than the window, chunks that
    wrap a full ring), every query position checked."""
    model = tiny_model(device)
    chunks = [7, 1, 1, 9, 1, 3, 1, 13, 1, 1]
    ids, _ = left_padded([sum(chunks)] * 3, device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode)
    got = run_chunks(model, cache, ids, mask, chunks)
    ref = reference_logits(model, ids, mask, chunks, WINDOW, SINKS, mode)
    check_chunks(got, ref, mask, f"{mode} chunks")


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_unpadded_chunks_match_reference(device, mode):
    """No padding: the maskless fast path (prefix view, full ring) mixed with wrapping chunks."""
    model = tiny_model(device)
    chunks = [3, 4, 1, 1, 5, 1, 1, 1, 10, 1]
    ids = torch.randint(2, 64, (2, sum(chunks)), device=device)
    got = run_chunks(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, None, chunks)
    check_chunks(got, reference_logits(model, ids, None, chunks, WINDOW, SINKS, mode), None, f"{mode} fast path")


@pytest.mark.parametrize("family,mode,attn", [("qwen3", "streaming", "sdpa"), ("mistral", "absolute", "eager"),
                                              ("llama", "streaming", "eager")])
def test_other_families_and_eager(device, family, mode, attn):
    model = tiny_model(device, family, attn)
    ids, mask = left_padded([8, 3], device)
    seqs, logits = generate(model, RollingKVCache(model, window=5, sinks=1, mode=mode), ids, mask, 9)
    check_generate_against_reference(model, ids, mask, seqs, logits, mode, window=5, sinks=1)


def test_no_sinks_equals_hf_sliding_window(device):
    """absolute mode with sinks=0 is Mistral's sliding window: same logits as DynamicCache(config) with
    DynamicSlidingWindowLayer, well past the window."""
    model = tiny_model(device, "mistral", sliding_window=WINDOW)
    ids = torch.randint(2, 64, (2, 9), device=device)
    s_hf, l_hf = generate(model, DynamicCache(config=model.config), ids, None, 12)
    s_roll, l_roll = generate(model, RollingKVCache(model, window=WINDOW, sinks=0), ids, None, 12)
    assert torch.equal(s_roll, s_hf)
    assert_close(l_roll, l_hf.double(), torch.float32, slack=10, name="sliding window")


def test_sinks_are_rotated_only_in_streaming_mode(device):
    """After a wrap the two modes differ (sink positions), before it they agree."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (1, 20), device=device)
    chunks = [1] * 20
    a = run_chunks(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="absolute"), ids, None, chunks)
    s = run_chunks(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming"), ids, None, chunks)
    C = WINDOW + SINKS
    assert torch.equal(a[:, :C], s[:, :C])
    # From token C on, streaming places the sinks right before the window (1, 2 instead of 0, 1 for token C).
    assert ((a[0, C:] - s[0, C:]).abs().amax(-1) > 1e-4).all()


# ---------------------------------------------------------------------------------------------------------------
# Lifecycle: reset, reuse, constant memory, beams
# ---------------------------------------------------------------------------------------------------------------

def test_reset_and_reuse(device):
    model = tiny_model(device)
    ids, mask = left_padded([7, 4], device)
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming")
    s1, l1 = generate(model, cache, ids, mask, 10)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    cache.reset()
    assert cache.get_seq_length() == 0
    s2, l2 = generate(model, cache, ids, mask, 10)
    assert torch.equal(s1, s2) and torch.equal(l1, l2)
    assert ptrs == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    # A fresh cache gives the same answer as the reused one, and a new batch size after reset reallocates.
    s3, _ = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming"), ids, mask, 10)
    assert torch.equal(s1, s3)
    cache.reset()
    generate(model, cache, ids[:1], mask[:1], 3)
    assert cache.layers[0].keys.shape[0] == 1


def test_continue_generation_with_same_cache(device):
    """A second generate call with the full history continues from the cache (chat turns)."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (1, 5), device=device)
    cache = RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="absolute")
    s1, _ = generate(model, cache, ids, None, 6)
    turn2 = torch.cat((s1, torch.randint(2, 64, (1, 4), device=device)), 1)
    # An explicit mask: turn 1 may have generated the pad id, which generate would otherwise take for padding.
    s2, l2 = generate(model, cache, turn2, torch.ones_like(turn2), 5)
    assert torch.equal(s2[:, :turn2.shape[1]], turn2)
    n1 = s1.shape[1] - 1   # the last token of turn 1 was never fed
    chunks = [5] + [1] * 5 + [turn2.shape[1] - n1] + [1] * 4
    ref = reference_logits(model, s2[:, :-1], None, chunks, WINDOW, SINKS, "absolute")
    assert_close(l2, ref[:, turn2.shape[1] - 1:].transpose(0, 1), torch.float32, slack=10, name="turn 2")


class _Probe(LogitsProcessor):
    """Records the cache's bytes and storage addresses at every decode step."""

    def __init__(self, cache):
        self.cache, self.seen = cache, set()

    def __call__(self, input_ids, scores):
        layers = self.cache.layers
        self.seen.add((self.cache.nbytes, tuple((l.keys.data_ptr(), l.values.data_ptr(), tuple(l.keys.shape))
                                                for l in layers)))
        return scores


def _long_generation(device, steps, mode):
    model = tiny_model(device, num_hidden_layers=1)
    cache = RollingKVCache(model, window=32, sinks=4, mode=mode)
    probe = _Probe(cache)
    ids = torch.randint(2, 64, (1, 8), device=device)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=True,
                         top_k=0, pad_token_id=0, logits_processor=[probe], output_logits=True,
                         return_dict_in_generate=True)
    assert out.sequences.shape[1] == 8 + steps
    assert len(probe.seen) == 1, "cache storage changed size or address during generation"
    sink_bytes = 2 * 4 * 8 * 4 if mode == "streaming" else 0          # pristine sink keys [1, 2, 4, 8]
    assert next(iter(probe.seen))[0] == 2 * 2 * 36 * 8 * 4 + sink_bytes   # K, V [1, 2, 36, 8] fp32
    assert torch.isfinite(torch.stack(out.logits)).all()
    assert cache.get_seq_length() == 8 + steps - 1


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_constant_memory_generation(device, mode):
    """~20 wraps of the ring with the real kernels (interpreter on CPU)."""
    _long_generation(device, 600, mode)


def test_constant_memory_10k_tokens(device, monkeypatch):
    # The kernels are covered above; on CPU this run takes the PyTorch path so it stays in seconds.
    if not GPU:
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    _long_generation(device, 10_000, "streaming")


def test_beam_search_runs(device):
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 4), device=device)
    out = model.generate(ids, past_key_values=RollingKVCache(model, window=WINDOW, sinks=SINKS), num_beams=2,
                         max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)


def test_beam_search_on_a_padded_batch_equals_each_prompt_alone(device):
    """Left-padded prompts past the wrap, 2 beams each: the beams' rows are reordered every step (reorder_cache),
    the decode steps take the per-row path, and each prompt's beams equal the same prompt searched alone."""
    model = tiny_model(device)
    lengths = [11, 6]
    ids, mask = left_padded(lengths, device)
    kw = dict(num_beams=2, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, past_key_values=RollingKVCache(model, window=WINDOW, sinks=SINKS),
                         **kw)
    for row, n in enumerate(lengths):
        alone = model.generate(ids[row:row + 1, -n:], past_key_values=RollingKVCache(model, window=WINDOW,
                                                                                     sinks=SINKS), **kw)
        assert torch.equal(out[row, -(n + 10):], alone[0]), row


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

def test_bad_configuration(device):
    model = tiny_model(device)
    for window, sinks, match in [(0, 0, "window"), (-3, 0, "window"), (4, 4, "sinks must be < window"),
                                 (4, 9, "sinks must be < window"), (4, -1, "sinks"), (2.5, 0, "window")]:
        with pytest.raises(ValueError, match=match):
            RollingKVCache(model, window=window, sinks=sinks)
    with pytest.raises(ValueError, match="mode"):
        RollingKVCache(model, window=4, sinks=1, mode="relative")
