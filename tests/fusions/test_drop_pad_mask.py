"""drop_pad_mask (patching/pad_mask.py): right-padded batches run SDPA's causal path without the padding mask.

The check against masks built by hand (right, left and no padding, packed rows, windows, broadcast rows, blocks of
query rows), then tiny SDPA models of several families under reentrant checkpointing: the patched model with and
without the fusion against the unpatched one, loss and every gradient (float64 for the equality of real tokens);
which masks are dropped and kept (counted once per mask tensor); eager attention, left padding, a KV cache, a mask
changed in place, inference mode and revert.
"""
from __future__ import annotations

import copy

import pytest
import torch

import swift_liger
from swift_liger.fusions import REGISTRY
from swift_liger.patching import pad_mask
from helpers import assert_grads_match, close_scaled, left_padded, tiny_causal_lm

transformers = pytest.importorskip("transformers")
VOCAB = 64


def causal(lengths, n):
    """The [rows, 1, n, n] bool mask transformers builds for right-padded rows of these real lengths."""
    q = torch.arange(n)
    m = (q[None, :] <= q[:, None])[None] & (q[None, None, :] < torch.tensor(lengths)[:, None, None])
    return m[:, None]


@pytest.mark.parametrize("lengths,n", [([5, 3, 7], 7), ([7], 7), ([9, 1], 9), ([0, 4], 4), ([13, 6, 13, 2], 13)])
@pytest.mark.parametrize("block", [1 << 24, 7, 1])
def test_right_padded_causal_masks_are_recognised(monkeypatch, lengths, n, block):
    monkeypatch.setattr(pad_mask, "BLOCK_ELEMENTS", block)   # blocks of 1 .. all query rows
    assert pad_mask.right_padded_causal(causal(lengths, n))


def test_other_masks_are_not():
    n = 8
    right = causal([8, 5], n)
    left = right.clone()
    left[1, 0] = torch.roll(causal([5], n)[0, 0], 3, dims=1) & torch.ones(n, n, dtype=torch.bool).tril()
    gap = causal([8, 8], n)
    gap[1, 0, :, 3] = False                       # a hole inside the row: not a prefix
    packed = causal([8], n).clone()
    packed[0, 0, 4:, :4] = False                   # two documents in one row
    window = causal([8], n).clone()
    window[0, 0] &= torch.ones(n, n, dtype=torch.bool).triu(-2)   # a sliding window of 3
    full = torch.ones(1, 1, n, n, dtype=torch.bool)                 # bidirectional
    one_cell = right.clone()
    one_cell[0, 0, 2, 5] = True                                     # a future key visible
    for name, m in [("left", left), ("gap", gap), ("packed", packed), ("window", window), ("full", full),
                    ("one future key", one_cell)]:
        assert not pad_mask.right_padded_causal(m), name


def build(model_type="llama", attn="sdpa", layers=3, **kw):
    m = tiny_causal_lm(model_type, layers=layers, vocab=VOCAB, attn=attn).double()
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.enable_input_require_grads()
    ref = copy.deepcopy(m)
    # every other fusion off (their kernels take no float64; tested elsewhere): this one alone, in float64
    report = swift_liger.apply(m, **{**{f.key: f.off for f in REGISTRY}, "drop_pad_mask": True, **kw})
    return m, ref, report


def right_batch(lengths, seed=0):
    n = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, :length] = torch.randint(2, VOCAB, (length,), generator=gen)
        mask[b, :length] = 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return ids, mask, labels


def loss_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach()


def counts(model):
    return swift_liger.call_counts(model, reset=True).get("pad_masks")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "qwen3"])
def test_right_padded_training_matches_the_masked_model(model_type, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    m, ref, report = build(model_type)
    assert report.patched["drop_pad_mask"] == 3
    layer = m.model.layers[0]
    seen = []
    layer.self_attn.register_forward_pre_hook(lambda mod, a, k: seen.append(k.get("attention_mask")),
                                              with_kwargs=True)
    counts(m)
    for seed, lengths in enumerate([[9, 4, 7], [6, 6], [11, 2, 11, 5]]):
        ids, mask, labels = right_batch(lengths, seed)
        got, want = loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels)
        close_scaled(got, want, "loss", atol=1e-12, rtol=1e-10)
        assert_grads_match(m, ref, atol=1e-12, rtol=1e-10)
    # batches 1 and 3 are padded (one check each, first pass and recompute share it); batch 2 had no mask at all
    assert counts(m) == {"dropped": 2, "kept": 0}
    assert seen and all(s is None for s in seen)


def test_left_padding_keeps_the_mask(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    m, ref, _ = build()
    torch.manual_seed(0)
    ids, mask = left_padded([3, 7, 5], "cpu", vocab=VOCAB)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    counts(m)
    got, want = loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels)
    close_scaled(got, want, "loss", atol=1e-12, rtol=1e-10)
    assert_grads_match(m, ref, atol=1e-12, rtol=1e-10)
    assert counts(m) == {"dropped": 0, "kept": 1}


def test_off_and_eager_attention_keep_the_mask(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    ids, mask, labels = right_batch([8, 3])
    off, _, report = build(drop_pad_mask=False)
    assert report.patched["drop_pad_mask"] == 0
    eager, ref, report = build(attn="eager")
    assert report.patched["drop_pad_mask"] == 0   # eager attention: no mask means no causal masking there
    assert any(s["fusion"] == "drop_pad_mask" and "'eager' keeps its masks" in s["reason"] for s in report.skipped)
    for m in (off, eager):
        got, want = loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels)
        close_scaled(got, want, "loss", atol=1e-12, rtol=1e-10)
    m, ref, _ = build()
    m.config._attn_implementation = "eager"   # switched after patching: checked per call too
    ref.config._attn_implementation = "eager"
    close_scaled(loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels), "loss", atol=0, rtol=0)
    assert counts(m) == {"dropped": 0, "kept": 0}


def test_generation_with_a_cache_and_inference_mode_keep_masks(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    m, ref, _ = build()
    m.eval()
    ref.eval()
    ids, mask, _ = right_batch([6, 6])
    ids, mask = left_padded([4, 6], "cpu", vocab=VOCAB)
    with torch.no_grad():
        a = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        b = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    rids, rmask, _ = right_batch([7, 3])
    with torch.inference_mode():
        close_scaled(m(input_ids=rids, attention_mask=rmask).logits, ref(input_ids=rids, attention_mask=rmask).logits,
                     "logits", atol=1e-12, rtol=1e-10)
    assert counts(m)["dropped"] == 0


def test_a_mask_changed_in_place_is_checked_again():
    masks = pad_mask.PadMasks(type("Cfg", (), {"_attn_implementation": "sdpa"})())
    m = causal([6, 4], 6)
    assert masks.causal_only(m, 6) and masks.causal_only(m, 6)
    assert masks.stats == {"dropped": 1, "kept": 0}
    m[1, 0, 5, 5] = True   # a pad key visible to itself: no longer causal + right padding
    assert not masks.causal_only(m, 6)
    assert masks.stats == {"dropped": 1, "kept": 1}
    assert not masks.causal_only(m, 5)                         # tokens disagree with the mask: not checked
    assert not masks.causal_only(m.float(), 6)                 # float masks are not checked
    assert not masks.causal_only(causal([6], 6), 6, {"past_key_values": object()})
    assert masks.stats == {"dropped": 1, "kept": 1}


def test_revert_removes_it(monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    m, ref, _ = build()
    swift_liger.revert(m)
    assert all("_liger_pad_masks" not in layer.__dict__ for layer in m.model.layers)
    ids, mask, labels = right_batch([8, 3])
    close_scaled(loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels), "loss", atol=0, rtol=0)


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_sliding_window_masks_are_kept(model_type, monkeypatch):
    """Rows longer than the window: the window is in the mask (not causal + padding alone), so it stays."""
    from transformers import AutoConfig, AutoModelForCausalLM
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                               max_position_embeddings=64, sliding_window=4, pad_token_id=0, eos_token_id=1,
                               bos_token_id=None)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="sdpa")
    m.train()
    ref = copy.deepcopy(m)
    swift_liger.apply(m, **{**{f.key: f.off for f in REGISTRY}, "drop_pad_mask": True})
    ids, mask, labels = right_batch([11, 6])
    got, want = loss_and_grads(m, ids, mask, labels), loss_and_grads(ref, ids, mask, labels)
    close_scaled(got, want, "loss", atol=1e-12, rtol=1e-10)
    assert_grads_match(m, ref, atol=1e-12, rtol=1e-10)
    c = counts(m)
    assert c["kept"] >= 1, c   # the sliding layers' masks (gemma2's full layers: dropped)


@pytest.mark.skipif(not (torch.cuda.is_available() and __import__("conftest").GPU), reason="SWIFT_LIGER_TEST_GPU=1")
def test_cuda_bf16_training_with_every_fusion_matches_masks_kept():
    """On the GPU, every default fusion and graph_layers: right-padded bf16 batches with the masks dropped train as
    with them kept (loss and LoRA gradients within bf16 rounding), and the padded batches replay graphs."""
    from peft import LoraConfig, get_peft_model
    base = tiny_causal_lm("qwen2", layers=3, vocab=VOCAB, attn="sdpa").to("cuda", torch.bfloat16)
    runs = []
    for drop in (False, True):
        m = copy.deepcopy(base)
        swift_liger.apply(m, drop_pad_mask=drop)
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.enable_input_require_grads()
        torch.manual_seed(5)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        m.train()
        losses, grads = [], {}
        for seed, lengths in enumerate([[40, 23, 31], [40, 40, 40], [37, 12, 40]]):
            ids, mask, labels = (t.cuda() for t in right_batch(lengths, seed))
            loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(loss.detach().float())
        grads = {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}
        runs.append((m, torch.stack(losses), grads))
    (_, l_kept, g_kept), (m, l_drop, g_drop) = runs
    torch.testing.assert_close(l_drop, l_kept, atol=2e-2, rtol=2e-2)
    assert g_kept.keys() == g_drop.keys() and g_kept
    for k in g_kept:
        torch.testing.assert_close(g_drop[k], g_kept[k], atol=5e-2, rtol=5e-2, msg=k)
    counts_ = swift_liger.call_counts(m)
    assert counts_["pad_masks"] == {"dropped": 2, "kept": 0}, counts_
    assert counts_["graph_layers"]["replays"] > 0, counts_["graph_layers"]
