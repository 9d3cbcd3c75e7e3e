"""Which models RollingKVCache refuses (swift_liger/cache/support.py): other families, RoPE that cannot stream,
attention implementations that cannot take its mask."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from ring_helpers import tiny_model
from swift_liger.cache import RollingKVCache


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
