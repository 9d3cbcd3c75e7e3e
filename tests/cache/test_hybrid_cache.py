"""RollingKVCache(window="model") on hybrid configs (sliding-window and full-attention layers), tiny random fp32
models: gemma2, gemma3 (text), qwen2 with layer_types. The sliding layers get a ring of the model's own window (no
sinks), the full-attention layers a growing full cache, so every output must equal transformers' default cache
(DynamicCache(config): DynamicSlidingWindowLayer / DynamicLayer) token for token, padded or not.
"""
import warnings

import pytest
import torch
from transformers import (AutoModelForCausalLM, DynamicCache, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          LogitsProcessor, MistralConfig, Qwen2Config)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from helpers import assert_close, left_padded
from swift_liger.cache import RollingKVCache, install_rolling_cache, uninstall_rolling_cache
from swift_liger.cache import decode, planner, support
from swift_liger.cache.ring import FullLayer, RollingLayer

W = 8          # the models' sliding window
PROMPT = 13    # longer than the window
NEW = 40
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=4096, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=None, tie_word_embeddings=False)
HYBRID = {
    # layer_types: sliding, full, sliding, full
    "gemma2": lambda: Gemma2Config(**TINY, num_hidden_layers=4, sliding_window=W),
    # sliding x2, full, sliding; local RoPE base on the sliding layers
    "gemma3": lambda: Gemma3TextConfig(**TINY, num_hidden_layers=4, sliding_window=W, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    # full, sliding, full, sliding
    "qwen2": lambda: Qwen2Config(**TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=W,
                                 layer_types=["full_attention", "sliding_attention"] * 2),
}


def hybrid_model(device, family, attn="sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(HYBRID[family](), attn_implementation=attn).to(device).eval()


def generate(model, cache, ids, mask, new_tokens=NEW, **kw):
    """(sequences, step logits [steps, B, V], the cache generate used)."""
    extra = {} if cache is None else {"past_key_values": cache}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         **({"do_sample": False} | extra | kw))
    return out.sequences, torch.stack(out.logits), out.past_key_values


def check_equal(model, ids, mask, name, **kw):
    """Greedy generation with RollingKVCache(window="model") equals transformers' default cache."""
    s_hf, l_hf, hf_cache = generate(model, None, ids, mask, **kw)
    kinds = [type(layer) for layer in hf_cache.layers]
    assert DynamicSlidingWindowLayer in kinds and DynamicLayer in kinds, f"default cache is not hybrid: {kinds}"
    cache = RollingKVCache(model, window="model")
    s_roll, l_roll, _ = generate(model, cache, ids, mask, **kw)
    assert torch.equal(s_roll, s_hf), f"{name}: generated tokens differ"
    assert_close(l_roll, l_hf.double(), torch.float32, slack=10, name=name)
    return cache


# ---------------------------------------------------------------------------------------------------------------
# transformers' semantics
# ---------------------------------------------------------------------------------------------------------------

def test_transformers_sliding_window_counts_the_current_token():
    """sliding_window=W: a query sees the last W tokens, itself included (keys j with q - W < j <= q), and
    DynamicSlidingWindowLayer keeps W - 1 past tokens between forwards. The ring's window means the same."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    cfg = Gemma2Config(**TINY, num_hidden_layers=2, sliding_window=W)
    cfg._attn_implementation = "eager"
    n = 2 * W + 3
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, n, 4), attention_mask=None,
                                             past_key_values=None, position_ids=torch.arange(n)[None])
    visible = mask[0, 0] == 0
    for q in range(n):
        assert visible[q].nonzero().flatten().tolist() == list(range(max(0, q - W + 1), q + 1))
    layer = DynamicSlidingWindowLayer(sliding_window=W)
    k = torch.zeros(1, 1, n, 2)
    keys, _ = layer.update(k, k)
    assert keys.shape[2] == n and layer.keys.shape[2] == W - 1
    keys, _ = layer.update(k[:, :, :1], k[:, :, :1])
    assert keys.shape[2] == W    # attention sees W keys: W - 1 kept + the new one


# ---------------------------------------------------------------------------------------------------------------
# Equal to transformers' default cache
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(HYBRID))
def test_generate_equals_default_cache(device, family):
    """Batch 1 and 2, unpadded: prefill longer than the window (a wrapping chunk), then the maskless decode fast
    path through 5 wraps of the ring."""
    model = hybrid_model(device, family)
    for batch in (1, 2):
        ids = torch.randint(2, 64, (batch, PROMPT), device=device)
        cache = check_equal(model, ids, None, f"{family} batch {batch}")
        assert cache.layer_kinds == tuple("ring" if t == "sliding_attention" else "full"
                                          for t in model.config.layer_types)


@pytest.mark.parametrize("family", list(HYBRID))
def test_left_padded_batch_equals_default_cache(device, family):
    """Left-padded prompts of different lengths (one shorter than the window): the masked path, every step."""
    model = hybrid_model(device, family)
    ids, mask = left_padded([PROMPT, 9, 3], device)
    check_equal(model, ids, mask, f"{family} padded")


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_eager_attention_equals_default_cache(device, family):
    """Eager attention (gemma2's applies attn_logit_softcapping): additive float masks on both paths."""
    model = hybrid_model(device, family, attn="eager")
    check_equal(model, torch.randint(2, 64, (2, PROMPT), device=device), None, f"{family} eager")
    ids, mask = left_padded([11, 4], device)
    check_equal(model, ids, mask, f"{family} eager padded", new_tokens=20)


def test_sampling_equals_default_cache(device):
    model = hybrid_model(device, "gemma3")
    ids, mask = left_padded([PROMPT, 6], device)
    torch.manual_seed(7)
    s_hf, l_hf, _ = generate(model, None, ids, mask, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(7)
    s_roll, l_roll, _ = generate(model, RollingKVCache(model, window="model"), ids, mask, do_sample=True, top_k=0,
                                 temperature=1.0)
    assert torch.equal(s_roll, s_hf)
    assert_close(l_roll, l_hf.double(), torch.float32, slack=10, name="sampling")


@pytest.mark.parametrize("padded", [False, True])
def test_chunked_forwards_equal_dynamic_cache(device, padded):
    """Forwards of mixed sizes (chunks longer than the window, chunks that wrap a full ring, single tokens) give
    the logits of DynamicCache(config) at every real position."""
    model = hybrid_model(device, "gemma2")
    chunks = [5, 1, 1, 11, 1, 3, 1, 9, 1, 1]
    ids = torch.randint(2, 64, (2, sum(chunks)), device=device)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    outs = []
    for cache in (DynamicCache(config=model.config), RollingKVCache(model, window="model")):
        logits, c0 = [], 0
        with torch.no_grad():
            for T in chunks:
                kw = {"attention_mask": mask[:, :c0 + T]} if padded else {}
                logits.append(model(input_ids=ids[:, c0:c0 + T], past_key_values=cache, use_cache=True,
                                    **kw).logits)
                c0 += T
        outs.append(torch.cat(logits, 1))
    sel = mask.bool()
    assert_close(outs[1][sel], outs[0][sel].double(), torch.float32, slack=10, name=f"chunks padded={padded}")


def test_continue_generation_and_beam_search(device):
    """A second generate call continues from the cache (chat turns); beam search reorders both layer kinds."""
    model = hybrid_model(device, "gemma2")
    ids = torch.randint(2, 64, (1, PROMPT), device=device)
    results = []
    for make in (lambda: DynamicCache(config=model.config), lambda: RollingKVCache(model, window="model")):
        cache = make()
        s1, _, _ = generate(model, cache, ids, None, 10)
        turn2 = torch.cat((s1, torch.randint(2, 64, (1, 5), generator=torch.Generator().manual_seed(3)).to(device)),
                          1)
        s2, l2, _ = generate(model, cache, turn2, torch.ones_like(turn2), 12)
        beams = model.generate(ids, past_key_values=make(), num_beams=3, max_new_tokens=16, min_new_tokens=16,
                               do_sample=False, pad_token_id=0)
        results.append((s2, l2, beams))
    assert torch.equal(results[1][0], results[0][0])
    assert_close(results[1][1], results[0][1].double(), torch.float32, slack=10, name="turn 2")
    assert torch.equal(results[1][2], results[0][2])


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_decode_kernel_equals_sdpa(device, family, monkeypatch):
    """Unpadded decode steps attend with the split-KV decode kernel on every layer, rings and full layers (forced
    on here; on CUDA the default); gemma2 with eager attention keeps its softcapping attention."""
    model = hybrid_model(device, family)
    ids = torch.randint(2, 64, (2, PROMPT), device=device)
    want, want_logits, _ = generate(model, None, ids, None, 12)
    monkeypatch.setattr(planner, "DECODE_KERNEL_DEVICES", ("cuda", "cpu"))
    attended, fused = [], []
    kernel, kernel_w = decode.decode_attention_unchecked, decode.decode_attention_write_unchecked
    monkeypatch.setattr(decode, "decode_attention_unchecked", lambda *a: attended.append(a[1].shape[2]) or kernel(*a))
    monkeypatch.setattr(decode, "decode_attention_write_unchecked",
                        lambda *a: fused.append(a[1].shape[2]) or kernel_w(*a))
    seqs, logits, _ = generate(model, RollingKVCache(model, window="model"), ids, None, 12)
    # 11 decode steps x 4 layers; ring layers attend over W slots (storing the token in the same launch), full ones
    # over the whole past
    assert len(attended) + len(fused) == 44
    assert set(fused) == {W} and set(attended) == set(range(PROMPT + 1, PROMPT + 12))
    assert torch.equal(seqs, want)
    assert_close(logits, want_logits.double(), torch.float32, slack=10, name="decode kernel")
    if family == "gemma2":
        eager = hybrid_model(device, family, attn="eager")
        attended.clear()
        fused.clear()
        check_equal(eager, ids, None, "gemma2 eager, decode kernel devices on", new_tokens=12)
        assert attended == [] and fused == []


# ---------------------------------------------------------------------------------------------------------------
# KV memory
# ---------------------------------------------------------------------------------------------------------------

class _Probe(LogitsProcessor):
    """Per decode step: (filled columns, storage address) of every layer's keys, and the cache's bytes."""

    def __init__(self, cache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores):
        self.steps.append(([(layer.keys.shape[2], layer.keys.data_ptr()) for layer in self.cache.layers],
                           self.cache.nbytes))
        return scores


def test_kv_memory(device):
    """Ring layers hold exactly W slots at one address from the first forward on; full layers hold every column
    seen (storage in blocks of 1024 columns)."""
    model = hybrid_model(device, "gemma2")
    B, steps = 2, 30
    cache = RollingKVCache(model, window="model")
    probe = _Probe(cache)
    model.generate(torch.randint(2, 64, (B, PROMPT), device=device), past_key_values=cache, max_new_tokens=steps,
                   min_new_tokens=steps, do_sample=False, pad_token_id=0, logits_processor=[probe])
    assert [type(layer) for layer in cache.layers] == [RollingLayer, FullLayer] * 2
    slot = B * 2 * 8 * 4      # K or V bytes per column: B x Hkv x head_dim x fp32
    for i, (layers, nbytes) in enumerate(probe.steps):
        seen = PROMPT + i
        assert [n for n, _ in layers] == [W, seen] * 2
        assert nbytes == 2 * 2 * W * slot + 2 * 2 * 1024 * slot
    assert len({tuple(p for _, p in layers[::2]) for layers, _ in probe.steps}) == 1, "ring storage moved"
    hf = DynamicCache(config=model.config)
    model.generate(torch.randint(2, 64, (B, PROMPT), device=device), past_key_values=hf, max_new_tokens=steps,
                   min_new_tokens=steps, do_sample=False, pad_token_id=0)
    # transformers keeps W - 1 tokens on its sliding layers between steps, the ring W (the slot of the next token)
    assert [layer.keys.shape[2] for layer in hf.layers] == [W - 1, PROMPT + steps - 1] * 2
    assert [layer.keys.shape[2] for layer in cache.layers] == [W, PROMPT + steps - 1] * 2
    cache.reset()
    assert cache.get_seq_length() == 0 and [layer.keys.shape[2] for layer in cache.layers[1::2]] == [0, 0]


def test_reset_and_reuse(device):
    model = hybrid_model(device, "gemma3")
    ids, mask = left_padded([PROMPT, 5], device)
    cache = RollingKVCache(model, window="model")
    s1, l1, _ = generate(model, cache, ids, mask, 16)
    cache.reset()
    s2, l2, _ = generate(model, cache, ids, mask, 16)
    assert torch.equal(s1, s2) and torch.equal(l1, l2)
    cache.reset()
    generate(model, cache, ids[:1], mask[:1], 3)       # another batch size after reset reallocates
    assert all(layer.keys.shape[0] == 1 for layer in cache.layers)


# ---------------------------------------------------------------------------------------------------------------
# Models without full layers, explicit windows, install, flags, errors
# ---------------------------------------------------------------------------------------------------------------

def test_all_sliding_model_is_every_layer_a_ring(device):
    """window="model" on a Mistral with sliding_window (every layer sliding): rings only, no full layers, the same
    outputs as DynamicCache(config) and as the explicit RollingKVCache(window=W, sinks=0)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**TINY, num_hidden_layers=2, sliding_window=W),
                                             attn_implementation="sdpa").to(device).eval()
    ids = torch.randint(2, 64, (2, PROMPT), device=device)
    s_hf, l_hf, _ = generate(model, DynamicCache(config=model.config), ids, None, 20)
    cache = RollingKVCache(model, window="model")
    assert cache.layer_kinds == ("ring", "ring") and (cache.window, cache.sinks) == (W, 0)
    s_own, l_own, _ = generate(model, cache, ids, None, 20)
    s_exp, l_exp, _ = generate(model, RollingKVCache(model, window=W, sinks=0), ids, None, 20)
    assert torch.equal(s_own, s_hf) and torch.equal(s_exp, s_hf)
    assert torch.equal(l_own, l_exp)
    assert_close(l_own, l_hf.double(), torch.float32, slack=10, name="mistral model window")


def test_non_hybrid_model_unchanged(device):
    """Llama (no sliding layers): an explicit window keeps every layer a ring of sinks + window (sinks default 4),
    not marked sliding; window="model" is refused."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, num_hidden_layers=2),
                                             attn_implementation="sdpa").to(device).eval()
    cache = RollingKVCache(model, window=6)
    assert cache.sinks == 4 and cache.capacity == 10 and cache.layer_kinds == ("ring", "ring")
    assert cache.is_sliding == [False, False] and cache._full_idx is None
    ids = torch.randint(2, 64, (1, 5), device=device)
    s_dyn, l_dyn, _ = generate(model, DynamicCache(), ids, None, 5)   # 5 + 4 fed < capacity: DynamicCache's
    s_roll, l_roll, _ = generate(model, cache, ids, None, 5)
    # CUDA decodes through the split-KV kernel (another summation order than SDPA): equal to rounding there
    assert torch.equal(s_roll, s_dyn)
    assert_close(l_roll, l_dyn.double(), torch.float32, slack=10, name="llama, explicit window")
    assert all(layer.keys.shape[2] == 10 for layer in cache.layers)
    with pytest.raises(ValueError, match="needs sliding-window layers; this llama config has none"):
        RollingKVCache(model, window="model")


def test_explicit_window_on_hybrid_models(device):
    """gemma2/gemma3: explicit window,sinks is refused (full layers would lose context); qwen2 with mixed
    layer_types keeps its existing meaning (every layer a ring) with a warning that names the full layers."""
    for family in ("gemma2", "gemma3"):
        with pytest.raises(ValueError, match="with window='model' only"):
            RollingKVCache(hybrid_model(device, family), window=64, sinks=4)
    qwen = hybrid_model(device, "qwen2")
    with pytest.warns(UserWarning, match=r"the 2 full-attention layers \(\[0, 2\]\) lose all context"):
        cache = RollingKVCache(qwen, window=16, sinks=2)
    assert cache.layer_kinds == ("ring",) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RollingKVCache(qwen, window="model")


def test_bad_settings(device):
    model = hybrid_model(device, "gemma2")
    for kwargs, match in [({"window": "auto"}, "window must be an int >= 1, 'model'"),
                          ({"window": "model", "sinks": 4}, "without sinks; got sinks=4"),
                          ({"window": "model", "mode": "streaming"}, "needs mode 'absolute'"),
                          ({"window": "model", "cuda_graph": True}, "without a CUDA graph"),
                          ({"window": 0}, "window must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match=match):
            RollingKVCache(model, **kwargs)
    model.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="causal attention"):
        RollingKVCache(model, window="model")


def test_install_and_apply(device):
    """install_rolling_cache(model, "model") and swift_liger.apply(rolling_cache={"window": "model"}) on gemma2."""
    import swift_liger
    model = hybrid_model(device, "gemma2")
    ids, mask = left_padded([PROMPT, 7], device)
    want, _, _ = generate(model, None, ids, mask, 10)
    assert install_rolling_cache(model, "model") is model
    got, _, cache = generate(model, None, ids, mask, 10)
    assert isinstance(cache, RollingKVCache) and cache.own_window and torch.equal(got, want)
    uninstall_rolling_cache(model)
    _, _, cache = generate(model, None, ids, mask, 2)
    assert not isinstance(cache, RollingKVCache)
    report = swift_liger.apply(hybrid_model(device, "gemma2"), rolling_cache={"window": "model"})
    assert report.patched["rolling_cache"] == 1
    # an explicit window,sinks on gemma2 is refused (README), not warned and skipped; nothing stays patched
    refused = hybrid_model(device, "gemma2")
    with pytest.raises(ValueError, match="gemma2 with window='model' only"):
        swift_liger.apply(refused, rolling_cache={"window": 64, "sinks": 4})
    assert "generate" not in refused.__dict__ and not any("forward" in m.__dict__ for m in refused.modules())


@pytest.mark.parametrize("family", sorted(HYBRID) + ["llama"])
@pytest.mark.parametrize("api", ["one_dict", "absent"])
def test_layer_types_without_per_layer_kwargs(family, api, monkeypatch):
    """transformers 5.17's get_layer_types_and_kwargs returns one kwargs dict for all layers, older releases lack
    it: the layer types and the window then come from the config, the same answer as 5.19's per-layer kwargs."""
    from transformers import cache_utils
    config = HYBRID[family]() if family in HYBRID else LlamaConfig(**TINY, num_hidden_layers=3)
    expected = support.layer_types(config)
    real = cache_utils.get_layer_types_and_kwargs
    if api == "one_dict":
        monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs",
                            lambda c: (real(c)[0], {"sliding_window": c.sliding_window} if getattr(
                                c, "sliding_window", None) else {}))
    else:
        monkeypatch.delattr(cache_utils, "get_layer_types_and_kwargs")
    assert support.layer_types(config) == expected
    assert len(expected[0]) == len(expected[1]) == config.num_hidden_layers
    assert expected[1] == [W if t == "sliding_attention" else None for t in expected[0]]
