"""attn_implementation="swift_liger" (fusions/varlen_attention.py) on tiny Llama, Qwen2 (with sliding-window layers),
Qwen3 and Gemma-2 (sliding window + attention logit softcap) models: a packed row equals per-document forwards of
transformers' own attention (SDPA; eager for Gemma-2, whose softcap SDPA ignores) in logits, loss and every
parameter gradient; a padded batch equals it on the real tokens; greedy generation with a KV cache gives the same
tokens (prefill through the kernel, decode steps through SDPA / eager); the document bounds are computed once per
forward, also under gradient checkpointing, and not kept alive; the mask function's choices; dropout refused."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_match, close_scaled

from swift_liger.fusions import varlen_attention as va
from swift_liger.ops import varlen_attention_kernel as vk

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function  # noqa: E402

VOCAB, LAYERS = 128, 2
# name -> (model_type, config extras, transformers' reference attention)
MODELS = {
    "llama": ("llama", {}, "sdpa"),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "sdpa"),
    "qwen3": ("qwen3", {}, "sdpa"),
    "gemma2": ("gemma2", dict(sliding_window=4, attn_logit_softcapping=1.0, query_pre_attn_scalar=8,
                              final_logit_softcapping=None), "eager"),
}
DOCS = [5, 11, 1, 7]   # odd lengths, a one-token document, longer than the sliding window of 4


@pytest.fixture(autouse=True)
def _registered():
    va.register()
    va.reset_counts()
    va.CACHE.clear()
    yield
    va.CACHE.clear()


def build(name, attn, seed=0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, extra, _ = MODELS[name]
    # initializer_range 0.3: attention scores large enough for the softcap and the window to change the outputs
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                               max_position_embeddings=128, hidden_act="silu", pad_token_id=0, eos_token_id=1,
                               bos_token_id=None, initializer_range=0.3, **{**extra, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)


def pair(name, **overrides):
    ours = build(name, "swift_liger", **overrides)
    ref = build(name, MODELS[name][2], **overrides)
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "swift_liger"
    return ours, ref


def packed_row(docs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, sum(docs)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    labels = ids.clone()
    starts = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)[:-1]))
    labels[0, starts] = -100   # no loss term predicts a document's first token from the previous document
    return ids, pos, labels


def train_step_matches(ours, ref, seed):
    """One packed row through both models, loss and backward: equal losses and every gradient."""
    ids, pos, labels = packed_row(DOCS, seed=seed)
    out = ours(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    out.loss.backward()
    expected = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    expected.loss.backward()
    close_scaled(out.loss, expected.loss, "loss")
    assert_grads_match(ours, ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_row_equals_per_document_forwards(name):
    ours, ref = pair(name)
    ids, pos, labels = packed_row(DOCS)
    out = ours(input_ids=ids, position_ids=pos, labels=labels)
    out.loss.backward()
    assert va.COUNTS["varlen"] == LAYERS and va.COUNTS["bounds"] == 1, va.COUNTS
    assert va.COUNTS["sdpa"] == va.COUNTS["eager"] == 0, va.COUNTS

    bounds = torch.tensor([0] + list(torch.tensor(DOCS).cumsum(0)))
    logits = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in zip(bounds[:-1], bounds[1:])], dim=1)
    loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    loss.backward()
    close_scaled(out.logits, logits, "logits")
    close_scaled(out.loss, loss, "loss")
    assert_grads_match(ours, ref)


def test_compile_ahead_pass_calls_not_counted(monkeypatch):
    """graph_layers' compile-ahead pass runs a layer's attention without launching our kernels: those calls are not
    counted; the same forward outside the pass is."""
    from swift_liger.ops import _launch
    ours, _ = pair(next(iter(MODELS)))
    ids, pos, labels = packed_row(DOCS)
    outside = _launch.compiling_ahead
    monkeypatch.setattr(_launch, "compiling_ahead", lambda: True)   # inside the pass (never under the interpreter)
    with torch.no_grad():
        ours(input_ids=ids, position_ids=pos, labels=labels)
    assert va.COUNTS["varlen"] == va.COUNTS["sdpa"] == va.COUNTS["eager"] == 0, va.COUNTS
    monkeypatch.setattr(_launch, "compiling_ahead", outside)
    with torch.no_grad():
        ours(input_ids=ids, position_ids=pos, labels=labels)
    assert va.COUNTS["varlen"] == LAYERS, va.COUNTS


def test_the_softcap_and_the_window_change_the_reference():
    """The Gemma-2 / Qwen2 cases above only prove something if their softcap and window bite at these sizes."""
    ids, pos, _ = packed_row(DOCS)
    for name, change in (("gemma2", dict(attn_logit_softcapping=None)), ("gemma2", dict(sliding_window=64)),
                         ("qwen2_sliding", dict(use_sliding_window=False))):
        a = build(name, MODELS[name][2])(input_ids=ids[:, 5:16]).logits
        b = build(name, MODELS[name][2], **change)(input_ids=ids[:, 5:16]).logits
        assert (a - b).abs().max() > 1e-3, (name, change)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "qwen2_sliding", "gemma2"])
def test_padded_batch_equals_reference_on_real_tokens(name, side):
    ours, ref = pair(name)
    lengths = [9, 14, 5]
    n = max(lengths)
    gen = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, length in enumerate(lengths):
        cols = slice(0, length) if side == "right" else slice(n - length, n)
        ids[b, cols] = torch.randint(2, VOCAB, (length,), generator=gen)
        mask[b, cols] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if side == "left":   # the loss term of a row's first token is read from a padding position's logits
        labels[torch.arange(len(lengths)), n - torch.tensor(lengths)] = -100
    out = ours(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert va.COUNTS["varlen"] == LAYERS and va.COUNTS["sdpa"] == va.COUNTS["eager"] == 0, va.COUNTS
    # one padding mask object per layer type reaches the layers: once per forward, twice for hybrid models
    assert va.COUNTS["bounds"] == len(set(getattr(ours.config, "layer_types", None) or ["full_attention"])), va.COUNTS
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    real = mask.bool()
    close_scaled(out.logits[real], expected.logits[real], "logits")
    close_scaled(out.loss, expected.loss, "loss")
    assert_grads_match(ours, ref)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_generate_with_a_kv_cache_matches_reference(name):
    ours, ref = pair(name)
    ours.eval()
    ref.eval()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, VOCAB, (2, 7), generator=gen)
    mask = torch.ones_like(prompt)
    prompt[0, :3], mask[0, :3] = 0, 0      # left-padded first row
    new = 9
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    tokens = ours.generate(input_ids=prompt, **kw)
    assert torch.equal(tokens, ref.generate(input_ids=prompt, **kw))
    # the prompt's prefill (empty cache) runs the kernel; each decode step hands its layers to SDPA / eager
    fallback = "eager" if name == "gemma2" else "sdpa"
    assert va.COUNTS["varlen"] == LAYERS and va.COUNTS[fallback] == LAYERS * (new - 1), va.COUNTS


def test_bounds_are_computed_once_per_forward_and_follow_the_tensors():
    ours, _ = pair("llama")
    ours.eval()
    ids, pos, _ = packed_row(DOCS)
    with torch.no_grad():
        first = ours(input_ids=ids, position_ids=pos).logits
        assert va.COUNTS["bounds"] == 1 and va.COUNTS["varlen"] == LAYERS
        again = ours(input_ids=ids, position_ids=pos).logits      # the same unchanged tensor: a hit
        assert va.COUNTS["bounds"] == 1
        torch.testing.assert_close(first, again, atol=0, rtol=0)
        pos[0, 8] = 0                                             # changed in place: a new document starts at 8
        changed = ours(input_ids=ids, position_ids=pos).logits
        assert va.COUNTS["bounds"] == 2
        fresh = build("llama", "swift_liger")
        expected = fresh(input_ids=ids, position_ids=pos.clone()).logits
        torch.testing.assert_close(changed, expected, atol=1e-6, rtol=1e-6)
        assert (changed[0, 8:16] - first[0, 8:16]).abs().max() > 1e-4
    # one entry: the in-place change replaced pos's old one, and the clone's went with the clone
    assert len(va.CACHE) == 1
    del pos
    gc.collect()
    assert len(va.CACHE) == 0          # entries do not keep their tensors alive, nor outlive them


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recompute_reuses_the_bounds(reentrant):
    ours, ref = pair("qwen3")
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ours.train()
    ref.train()
    ids, pos, labels = packed_row(DOCS, seed=1)
    emb = ours.get_input_embeddings()(ids).detach().requires_grad_(True)   # reentrant needs an input with grad
    out = ours(inputs_embeds=emb, position_ids=pos, labels=labels, use_cache=False)
    out.loss.backward()
    assert va.COUNTS["varlen"] == 2 * LAYERS, va.COUNTS     # forward + recompute
    assert va.COUNTS["bounds"] == 1, va.COUNTS
    # transformers' SDPA builds a block-diagonal mask from packed position ids, but only without a cache: a model
    # called with use_cache on (the config's default) attends across the documents of a packed row
    expected = ref(inputs_embeds=emb.detach(), position_ids=pos, labels=labels, use_cache=False)
    expected.loss.backward()
    close_scaled(out.loss, expected.loss, "loss")
    assert_grads_match(ours, ref)


def test_sliding_window_convention_is_transformers():
    """Query i sees key j iff 0 <= i - j < window: masking_utils.sliding_window_overlay (kv_idx > q_idx - window)."""
    T, W = 13, 4
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, T, 8, generator=gen) for _ in range(3))
    mask = sdpa_mask(batch_size=1, q_length=T, kv_length=T, mask_function=sliding_window_causal_mask_function(W),
                     allow_is_causal_skip=False)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    got = vk.varlen_attention(q, k, v, torch.zeros(1, T, dtype=torch.int32), scale=8 ** -0.5, window=W)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_mask_function_mirrors_flash_and_hands_the_rest_to_sdpa():
    none = va.mask_interface(2, 6, 6, attention_mask=None)
    full = va.mask_interface(2, 6, 6, attention_mask=torch.ones(2, 6, dtype=torch.bool))
    assert none is None and full is None and va.COUNTS["dense_masks"] == 0
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(va.mask_interface(2, 6, 6, attention_mask=right), right)
    left = right.flip(1)
    assert torch.equal(va.mask_interface(2, 6, 6, attention_mask=left), left)
    both = torch.tensor([[0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(va.mask_interface(1, 6, 6, attention_mask=both), both)
    assert va.COUNTS["dense_masks"] == 0
    cases = [  # (kwargs, why the varlen path cannot take it)
        (dict(batch_size=1, q_length=6, kv_length=6, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]]).bool()),
         "padding inside a row"),
        (dict(batch_size=2, q_length=1, kv_length=6, q_offset=5, attention_mask=left), "a decode step"),
        (dict(batch_size=2, q_length=3, kv_length=9, q_offset=6, attention_mask=None), "a chunk after a cache"),
        (dict(batch_size=2, q_length=6, kv_length=6, attention_mask=right, use_vmap=True), "a custom overlay"),
        (dict(batch_size=2, q_length=6, kv_length=6, attention_mask=None, allow_is_bidirectional_skip=False),
         "a bidirectional mask"),
    ]
    for kwargs, why in cases:
        got = va.mask_interface(**kwargs)
        expected = sdpa_mask(**kwargs)
        assert (got is None) == (expected is None), why
        if expected is not None:
            assert got.ndim == 4 and torch.equal(got, expected), why
    assert va.COUNTS["dense_masks"] == len(cases)


def test_documents_from_positions_masks_and_cu_seqlens():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    ids = va.documents(pos, None, None, 2, 8, "cpu")                     # [1, T] positions for a batch of 2
    assert ids.shape == (2, 8) and ids[0].tolist() == ids[1].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)                    # ms-swift's cu_seq_lens_q, no positions
    assert va.documents(None, None, cu, 1, 8, "cpu").tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    lo, _ = vk.doc_bounds(va.documents(None, mask, None, 1, 8, "cpu"))
    assert lo.tolist() == [[0, 0, 0, 0, 0, 5, 5, 5]]
    assert va.documents(torch.zeros(3, 1, 8), None, None, 1, 8, "cpu").tolist() == [[0] * 8]   # 3D mrope: one doc


def test_a_4d_mask_goes_to_sdpa():
    ours, ref = pair("llama")
    ids = torch.randint(2, VOCAB, (2, 6))
    keep = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    keep[2:, 0] = False                      # a custom pattern: nobody past row 2 sees token 0
    mask4d = keep[None, None].expand(2, 1, 6, 6)
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask4d).logits,
                               ref(input_ids=ids, attention_mask=mask4d).logits, atol=1e-6, rtol=1e-5)
    assert va.COUNTS["sdpa"] == LAYERS and va.COUNTS["varlen"] == 0


def test_attention_dropout_is_refused_in_training():
    ours = build("llama", "swift_liger", attention_dropout=0.1)
    ids, pos, labels = packed_row(DOCS)
    ours.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        ours(input_ids=ids, position_ids=pos, labels=labels)
    ours.eval()                              # no dropout in eval: fine
    with torch.no_grad():
        assert torch.isfinite(ours(input_ids=ids, position_ids=pos).logits).all()


def test_register_is_idempotent_and_set_attn_implementation_works():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    va.register()
    va.register()
    assert va.registered()
    assert list(AttentionInterface._global_mapping).count(va.NAME) == 1
    assert AttentionMaskInterface._global_mapping[va.NAME] is va.mask_interface
    model = build("qwen3", "sdpa")
    model.set_attn_implementation(va.NAME)
    assert model.config._attn_implementation == va.NAME
    ids, pos, _ = packed_row([4, 6])
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    assert va.COUNTS["varlen"] == LAYERS
    from swift_liger.integration.attention import ATTN_IMPL
    assert ATTN_IMPL == va.NAME


def test_with_every_fusion_applied_and_checkpointing():
    """Our RoPE / RMSNorm / SwiGLU / fused loss head around the attention (swift_liger.apply), gradient
    checkpointing with save_attention on (it keeps SDPA outputs only: here the layers recompute, counted 0)."""
    import swift_liger
    ours, ref = pair("llama")
    for m in (ours, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        assert swift_liger.apply(m, save_attention=True).patched["rope"] > 0
    train_step_matches(ours, ref, seed=4)
    assert va.COUNTS["varlen"] == 2 * LAYERS and va.COUNTS["bounds"] == 1, va.COUNTS
    assert swift_liger.call_counts(ours)["saved_attention"] == {"kept": 0}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_decoder_layers_keep_it_in_the_graph(backend):
    """liger_compile_layers compiles each decoder layer: with packed attention inside, each layer is one graph
    (fullgraph: a graph break fails), the document bounds traced per layer and the kernels as custom-op nodes; the
    loss and every gradient match the stock packed model. The eager-path counters stay untouched: a compiled graph
    replays without the attention function's Python."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    ours, ref = pair("llama")
    counter = CompileCounterWithBackend(backend)
    for layer in ours.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    for seed in (6, 7):   # the second forward reuses the compiled layers
        train_step_matches(ours, ref, seed)
        ours.zero_grad()
        ref.zero_grad()
    assert counter.frame_count >= 1
    assert va.COUNTS["varlen"] == 0 and va.COUNTS["bounds"] == 0, va.COUNTS
    torch._dynamo.reset()
