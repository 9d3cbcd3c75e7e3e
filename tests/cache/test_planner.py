"""The per-forward planner (swift_liger/cache/planner.py): which path each forward takes (fast, padded decode,
general), and the decoder pre-hook's refusals."""
import pytest
import torch

from helpers import left_padded
from ring_helpers import SINKS, WINDOW, check_generate_against_reference, count_layouts, generate, tiny_model
from swift_liger.cache import RollingKVCache


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
def test_padded_decode_after_every_ring_is_full_is_maskless_and_matches_reference(device, mode, monkeypatch):
    """Left-padded rows of different lengths: once every row has filled its ring, each decode token takes the
    per-row fast path (no mask, slots and positions from the row lengths); before that, the masked general path.
    Greedy tokens and logits equal the float64 reference either way."""
    model = tiny_model(device)
    ids, mask = left_padded([11, 6, 2], device)
    seen = count_layouts(monkeypatch)
    seqs, logits = generate(model, RollingKVCache(model, window=WINDOW, sinks=SINKS, mode=mode), ids, mask, 14)
    check_generate_against_reference(model, ids, mask, seqs, logits, mode)
    # prefill, then the shortest row (2 tokens) reaches sinks + window = 8 after 6 decode steps: 7 maskless steps
    assert [layout for layout, _ in seen] == ["concat"] + ["slots"] * 6 + ["rows"] * 7, seen


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

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
