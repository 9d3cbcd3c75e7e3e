"""RollingKVCache on tiny random models (fp32).

* Until sinks + window tokens have been seen it must reproduce DynamicCache (bit for bit without padding).
* After that it must equal a from-scratch float64 recompute with the same semantics (`reference_logits`): a
  hand-written attention that, for every query, gathers the visible keys (sinks + last `window`) and rotates them
  at that mode's positions (true positions, or 0..L-1 by order within the cache for "streaming"). It shares
  nothing with the cache's ring, masks or sink re-rotation.
"""
import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LogitsProcessor, MistralConfig, Qwen3Config

from helpers import assert_close, left_padded
from swift_liger.cache import RollingKVCache, decode, install_rolling_cache, planner, ring, uninstall_rolling_cache

GPU = os.environ.get("SWIFT_LIGER_TEST_GPU", "0") == "1"
WINDOW, SINKS = 6, 2
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=1 << 16, rope_theta=10000.0,
            initializer_range=0.2,   # peaky attention, so wrong masks or positions show in the logits
            pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen3": Qwen3Config}


def tiny_model(device, family="llama", attn="sdpa", **overrides):
    torch.manual_seed(0)
    cfg = CONFIGS[family](**{**TINY, **overrides})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(device).eval()


# ---------------------------------------------------------------------------------------------------------------
# Float64 reference
# ---------------------------------------------------------------------------------------------------------------

def _rope(x, positions, inv_freq, scaling):
    """HF rotate-half RoPE of x [H, n, D] at positions [n], float64."""
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    half = x.shape[-1] // 2
    return x * emb.cos() * scaling + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * emb.sin() * scaling


@torch.no_grad()
def reference_logits(model, ids, mask, chunks, window, sinks, mode):
    """Logits [B, N, V] (float64, CPU) of every real column of `ids` [B, N], processed as forwards of `chunks`
    columns each, under the cache's semantics. Rows of padding columns are left at zero."""
    m = copy.deepcopy(model).cpu().to(torch.float64)
    dec, cfg = m.model, m.config
    ids, mask = ids.cpu(), (torch.ones_like(ids) if mask is None else mask.cpu())
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.head_dim
    inv_freq = dec.rotary_emb.inv_freq.to(torch.float64)
    rscale = dec.rotary_emb.attention_scaling
    B, N = ids.shape
    out = torch.zeros(B, N, cfg.vocab_size, dtype=torch.float64)
    bounds = torch.tensor(chunks).cumsum(0).tolist()
    assert bounds[-1] == N
    for b in range(B):
        cols = mask[b].nonzero().flatten().tolist()
        n = len(cols)
        if n == 0:
            continue
        # Stream length before / after the chunk that holds each real token.
        n0, n1 = [], []
        for c in cols:
            hi = next(x for x in bounds if x > c)
            lo = max([0] + [x for x in bounds if x <= c])
            n0.append(int(mask[b, :lo].sum()))
            n1.append(int(mask[b, :hi].sum()))
        h = dec.embed_tokens(ids[b, cols])
        for layer in dec.layers:
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(n, hq, hd)
            k = a.k_proj(x).view(n, hk, hd)
            v = a.v_proj(x).view(n, hk, hd)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            att = torch.zeros(hq, n, hd, dtype=torch.float64)
            for j in range(n):
                # Keys the chunk of j can see, in cache order (sinks, then chronological).
                order = [i for i in range(n1[j]) if i < sinks or i >= n0[j] - window + 1]
                vis = [i for i in order if i <= j and (i < sinks or i > j - window)]
                if mode == "absolute":
                    kpos, qpos = vis, j
                else:
                    rank = {i: r for r, i in enumerate(order)}
                    kpos, qpos = [rank[i] for i in vis], rank[j]
                qj = _rope(q[:, j:j + 1], [qpos], inv_freq, rscale)
                kj = _rope(k[:, vis], kpos, inv_freq, rscale).repeat_interleave(hq // hk, 0)
                vj = v[:, vis].repeat_interleave(hq // hk, 0)
                w = torch.softmax(qj @ kj.transpose(1, 2) * a.scaling, dim=-1)
                att[:, j] = (w @ vj)[:, 0]
            h = h + a.o_proj(att.transpose(0, 1).reshape(n, hq * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out[b, cols] = m.lm_head(dec.norm(h))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Drivers
# ---------------------------------------------------------------------------------------------------------------

def generate(model, cache, ids, mask, new_tokens, **kw):
    """(sequences, step logits [steps, B, V]) of model.generate with `cache`."""
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, **({"do_sample": False} | kw))
    return out.sequences, torch.stack(out.logits)


def check_generate_against_reference(model, ids, mask, seqs, logits, mode, window=WINDOW, sinks=SINKS):
    P, steps = ids.shape[1], logits.shape[0]
    full_mask = torch.cat((mask, torch.ones(mask.shape[0], steps, dtype=mask.dtype, device=mask.device)), 1)
    ref = reference_logits(model, seqs[:, :P + steps - 1], full_mask[:, :P + steps - 1], [P] + [1] * (steps - 1),
                           window, sinks, mode)
    assert_close(logits, ref[:, P - 1:].transpose(0, 1), torch.float32, slack=10, name=f"{mode} generate")


def run_chunks(model, cache, ids, mask, chunks):
    """Logits [B, N, V] of forwarding `ids` in chunks (no position_ids: the cache supplies them)."""
    logits, c0 = [], 0
    with torch.no_grad():
        for T in chunks:
            kw = {} if mask is None else {"attention_mask": mask[:, :c0 + T]}
            logits.append(model(input_ids=ids[:, c0:c0 + T], past_key_values=cache, use_cache=True, **kw).logits)
            c0 += T
    return torch.cat(logits, 1)


def check_chunks(actual, ref, mask, name):
    sel = (torch.ones(ref.shape[:2], dtype=torch.bool) if mask is None else mask.bool().cpu())
    assert_close(actual.cpu()[sel], ref[sel], torch.float32, slack=10, name=name)


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
# Lifecycle: reset, reuse, constant memory, beams, install
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


def test_all_ones_mask_keeps_the_fast_path(device, monkeypatch):
    """generate passes an all-ones 2D mask every step: it means no padding, so decode must not take the general
    (mask-building) path, and the answer is the same as with no mask."""
    model = tiny_model(device)
    ids = torch.randint(2, 64, (2, 7), device=device)
    want, want_logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming"), ids,
                                 None, 12)
    general = []
    original = RollingKVCache._general_plan
    monkeypatch.setattr(RollingKVCache, "_general_plan", lambda self, *a: general.append(a[1]) or original(self, *a))
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming"), ids,
                            torch.ones_like(ids), 12)
    assert general == [], f"all-ones mask took the general path for chunks of {general}"
    assert torch.equal(seqs, want) and torch.equal(logits, want_logits)


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


def _count_layouts(monkeypatch):
    """Record each forward's plan layout (and whether it was a graph step)."""
    seen = []
    original = RollingKVCache._begin_forward

    def begin(self, *a, **kw):
        out = original(self, *a, **kw)
        seen.append((self._plan.layout, self._plan.graph))
        return out
    monkeypatch.setattr(RollingKVCache, "_begin_forward", begin)
    return seen


@pytest.mark.parametrize("mode", ["absolute", "streaming"])
def test_padded_decode_after_every_ring_is_full_is_maskless_and_matches_reference(device, mode, monkeypatch):
    """Left-padded rows of different lengths: once every row has filled its ring, each decode token takes the
    per-row fast path (no mask, slots and positions from the row lengths); before that, the masked general path.
    Greedy tokens and logits equal the float64 reference either way."""
    model = tiny_model(device)
    ids, mask = left_padded([11, 6, 2], device)
    seen = _count_layouts(monkeypatch)
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask, 14)
    check_generate_against_reference(model, ids, mask, seqs, logits, mode)
    # prefill, then the shortest row (2 tokens) reaches sinks + window = 8 after 6 decode steps: 7 maskless steps
    assert [layout for layout, _ in seen] == ["concat"] + ["slots"] * 6 + ["rows"] * 7, seen


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
    seen = _count_layouts(monkeypatch)
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


def test_install_rolling_cache(device):
    model = tiny_model(device)
    ids, mask = left_padded([9, 5], device)
    want, _ = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode="streaming"), ids, mask, 8)
    assert install_rolling_cache(model, WINDOW, SINKS, "streaming") is model
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, RollingKVCache)
    assert torch.equal(out.sequences, want)
    # An explicit cache still wins.
    dyn = DynamicCache()
    model.generate(ids, attention_mask=mask, past_key_values=dyn, max_new_tokens=2, pad_token_id=0)
    assert dyn.get_seq_length() > 0
    uninstall_rolling_cache(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, return_dict_in_generate=True)
    assert not isinstance(out.past_key_values, RollingKVCache)
    with pytest.raises(ValueError, match="sinks must be < window"):
        install_rolling_cache(model, 4, 4)


def test_deepcopy_of_model_with_cache_machinery(device):
    """The decoder wrapper and the generate wrapper are per instance: a deep copy must run (and build caches for)
    its own modules, not the original's."""
    model = tiny_model(device)
    install_rolling_cache(model, WINDOW, SINKS, "streaming")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.embed_tokens.weight.mul_(-1.0)
    ids = torch.randint(2, 64, (1, 9), device=device)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    out_model, out_clone = model.generate(ids, **kw), clone.generate(ids, **kw)
    assert out_clone.past_key_values._decoder is clone.model
    assert out_model.past_key_values._decoder is model.model
    fresh = copy.deepcopy(clone)
    uninstall_rolling_cache(fresh)
    want = generate(fresh, RollingKVCache(fresh, window=WINDOW, sinks=SINKS, mode="streaming"), ids, None, 4)[1]
    assert torch.equal(torch.stack(out_clone.logits), want)
    assert not torch.equal(torch.stack(out_model.logits), want)
    uninstall_rolling_cache(model), uninstall_rolling_cache(clone)
    for m in (model, clone):
        assert "forward" not in m.model.__dict__ and "generate" not in m.__dict__


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


def test_unsupported_models(device):
    from transformers import GPT2Config
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
                                                                eos_token_id=None))
    with pytest.raises(ValueError, match="model types"):
        RollingKVCache(gpt2, window=4, sinks=1)
    dyn = tiny_model(device, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    RollingKVCache(dyn, window=4, sinks=1, mode="absolute")
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        RollingKVCache(dyn, window=4, sinks=1, mode="streaming")


def test_attention_that_cannot_take_the_mask(device):
    model = tiny_model(device)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation"):
        RollingKVCache(model, window=4, sinks=1)
    model.config._attn_implementation = "sdpa"
    cache = RollingKVCache(model, window=4, sinks=1)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long, device=device), past_key_values=cache)


def test_misuse_errors(device):
    model = tiny_model(device)
    other = tiny_model(device)
    ids = torch.randint(2, 64, (2, 3), device=device)
    cache = RollingKVCache(model, window=4, sinks=1)
    with pytest.raises(RuntimeError, match="pre-forward hook"):   # `other` has no hook yet
        other(input_ids=ids, past_key_values=cache)
    RollingKVCache(other, window=4, sinks=1)
    with pytest.raises(ValueError, match="different model"):
        other(input_ids=ids, past_key_values=cache)
    with pytest.raises(RuntimeError, match="pre-forward hook"):
        cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)
    with pytest.raises(ValueError, match="2D padding mask"):
        model(input_ids=ids, past_key_values=cache, attention_mask=torch.ones(2, 1, 3, 3, dtype=torch.bool,
                                                                              device=device))
    model(input_ids=ids, past_key_values=RollingKVCache(model, window=4, sinks=1))
    cache = RollingKVCache(model, window=4, sinks=1)
    model(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="batch of 2"):
        model(input_ids=ids[:1], past_key_values=cache)
    with pytest.raises(NotImplementedError):
        cache.crop(-1)


def test_window_that_cannot_fit_the_device_is_refused_at_install(device):
    """A window whose KV ring could never be allocated on the model's device (issue 32: 99999999999 tried 25 TB at
    the first prompt and hung) is an error at install, naming the window, the bytes and the largest that fits."""
    model = tiny_model(device)
    with pytest.raises(ValueError, match=r"window 99999999999 \+ 4 sinks needs .* per sequence.*largest window"):
        install_rolling_cache(model, window=99999999999, sinks=4)
    assert "generate" not in model.__dict__                                 # nothing installed
    install_rolling_cache(model, window=64, sinks=4)
    uninstall_rolling_cache(model)
