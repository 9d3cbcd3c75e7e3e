"""Shared by the RollingKVCache tests (test_ring, test_planner, test_decode, test_install): tiny random models
(fp32), a from-scratch float64 reference and the generate / chunk drivers.

`reference_logits` is a hand-written attention that, for every query, gathers the visible keys (sinks + last
`window`) and rotates them at that mode's positions (true positions, or 0..L-1 by order within the cache for
"streaming"). It shares nothing with the cache's ring, masks or sink re-rotation.
"""
import copy
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

from helpers import assert_close
from swift_liger.cache import RollingKVCache

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


def count_layouts(monkeypatch):
    """Record each forward's plan layout (and whether it was a graph step)."""
    seen = []
    original = RollingKVCache._begin_forward

    def begin(self, *a, **kw):
        out = original(self, *a, **kw)
        seen.append((self._plan.layout, self._plan.graph))
        return out
    monkeypatch.setattr(RollingKVCache, "_begin_forward", begin)
    return seen
