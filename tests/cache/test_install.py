"""install_rolling_cache / uninstall_rolling_cache / is_installed (swift_liger/cache/install.py)."""
import copy

import pytest
import torch
from transformers import DynamicCache

from helpers import left_padded
from ring_helpers import SINKS, WINDOW, generate, tiny_model
from swift_liger.cache import RollingKVCache, install_rolling_cache, is_installed, uninstall_rolling_cache


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


def test_window_that_cannot_fit_the_device_is_refused_at_install(device):
    """A window whose KV ring could never be allocated on the model's device (issue 32: 99999999999 tried 25 TB at
    the first prompt and hung) is an error at install, naming the window, the bytes and the largest that fits."""
    model = tiny_model(device)
    with pytest.raises(ValueError, match=r"window 99999999999 \+ 4 sinks needs .* per sequence.*largest window"):
        install_rolling_cache(model, window=99999999999, sinks=4)
    assert "generate" not in model.__dict__                                 # nothing installed
    install_rolling_cache(model, window=64, sinks=4)
    uninstall_rolling_cache(model)


def test_is_installed(device):
    """is_installed follows install / uninstall on this instance only (a deep copy of an installed model is
    installed too: its generate wrapper came with it)."""
    model, other = tiny_model(device), tiny_model(device)
    assert not is_installed(model) and not is_installed(other)
    RollingKVCache(model, window=WINDOW, sinks=SINKS)            # a cache alone installs nothing on generate
    assert not is_installed(model)
    install_rolling_cache(model, WINDOW, SINKS)
    assert is_installed(model) and not is_installed(other)
    install_rolling_cache(model, WINDOW + 1, SINKS)              # re-install: still on, new settings
    assert is_installed(model)
    clone = copy.deepcopy(model)
    assert is_installed(clone)
    uninstall_rolling_cache(model)
    assert not is_installed(model) and is_installed(clone)
    uninstall_rolling_cache(clone)
    assert not is_installed(clone)
    with pytest.raises(ValueError, match="sinks must be < window"):
        install_rolling_cache(model, 4, 4)
    assert not is_installed(model)                               # a refused install leaves nothing on
    assert not is_installed(object())                            # anything without a __dict__ entry


@pytest.mark.parametrize("padded", [False, True], ids=["uniform", "left-padded"])
def test_exact_window_sizes_each_call_and_equals_the_default_cache(device, padded, monkeypatch):
    """window="exact": each generate call gets a ring of its prompt columns + max_new_tokens (nothing evicted), so
    sampled tokens equal transformers' default cache's; with cuda_graph every decode step is a graph step (forced to
    run eagerly on CPU). Calls are counted; RollingKVCache itself refuses "exact" (it is sized per call)."""
    from swift_liger.cache import install
    from ring_helpers import GPU, count_layouts
    model = tiny_model(device)
    ids, mask = left_padded([9, 4, 6], device) if padded else (torch.randint(2, 64, (2, 7), device=device), None)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=0, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(4)
    want = model.generate(ids, **kw)
    if not GPU:
        monkeypatch.setattr(RollingKVCache, "_graph_ok", lambda self, dev: self._joint_ready and
                            not torch.is_grad_enabled())
    seen = count_layouts(monkeypatch)
    install_rolling_cache(model, "exact", cuda_graph=True)
    torch.manual_seed(4)
    got = model.generate(ids, **kw)
    cache = got.past_key_values
    assert isinstance(cache, RollingKVCache) and (cache.window, cache.sinks) == (ids.shape[1] + 10, 0)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=2e-5, rtol=1e-4)
    assert seen[1:] == [("rows" if padded else "full", True)] * 9, seen
    assert install.generate_counts(model) == {"generate": 1, "own_cache": 0, "unsized": 0, "forwards": 10,
                                              "graph_steps": 9}
    # A total max_length bounds the new tokens (generate adds its default one to the prompt): the ring holds them.
    assert install._exact_window(model, (ids,), {"max_length": 30}, model.generation_config) == ids.shape[1] + 30
    # No budget at all (neither set: generate applies a model-agnostic default we do not guess): the default cache.
    out = model.generate(ids, attention_mask=mask, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, DynamicCache) and install.generate_counts(model)["unsized"] == 1
    uninstall_rolling_cache(model)
    with pytest.raises(ValueError, match="window 'exact' is sized per generate call by install_rolling_cache"):
        RollingKVCache(model, window="exact")


def test_exact_window_is_refused_on_sliding_window_models(device):
    model = tiny_model(device, family="mistral", sliding_window=8)
    with pytest.raises(ValueError, match="has sliding-window layers .* use window 'model'"):
        install_rolling_cache(model, "exact")
