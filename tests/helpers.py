"""Shared test helpers: the one table of tolerances, poisoning, float64 references, input snapshots."""
from __future__ import annotations

import contextlib

import torch

# Tolerances per dtype, used by every op test: (atol, rtol) on elementwise comparison against a float64 reference.
# bf16 has 8 mantissa bits (rel. step 2^-8 = 3.9e-3) and the interpreter stores round toward zero, so its
# tolerance is a few ulps; fp16 has 11 bits (4.9e-4); fp32 kernels accumulate in fp32 (tl.sum tree order).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float64: (1e-10, 1e-10),
}
# Gradients that are reductions over many rows (dW) collect more rounding: scale TOL by this.
REDUCTION_SLACK = 4.0
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POISON = float("nan")


def tol(dtype, slack: float = 1.0):
    atol, rtol = TOL[dtype]
    return atol * slack, rtol * slack


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype=None, *, slack: float = 1.0, name: str = ""):
    """Compare a kernel output (any dtype) with a float64 reference, at the tolerance of `dtype`."""
    dtype = dtype or actual.dtype
    atol, rtol = tol(dtype, slack)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in output (unwritten element or overflow)"
    # Scale atol by the reference's magnitude so large-valued outputs (sums, dW) are compared fairly.
    scale = max(1.0, e.abs().max().item())
    torch.testing.assert_close(a, e, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name} ({dtype}): {m}")


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, requires_grad=False):
    t = (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def f64(t: torch.Tensor, requires_grad=None) -> torch.Tensor:
    """A float64 CPU copy of t (a leaf, grad enabled like t unless told)."""
    rg = t.requires_grad if requires_grad is None else requires_grad
    return t.detach().to("cpu", torch.float64).requires_grad_(rg)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, POISON)


@contextlib.contextmanager
def inputs_unchanged(*tensors: torch.Tensor):
    """Assert that the tensors hold the same values after the block as before it."""
    before = [t.detach().clone() for t in tensors]
    yield
    for i, (b, t) in enumerate(zip(before, tensors)):
        assert torch.equal(b, t.detach()), f"input #{i} was modified in place"


def close_scaled(a: torch.Tensor, b: torch.Tensor, name: str = "", atol: float = 2e-5, rtol: float = 2e-4):
    """Model-level comparison (losses, logits, gradients): atol scaled by max(1, |b|max)."""
    scale = max(1.0, b.detach().abs().max().item())
    torch.testing.assert_close(a.detach(), b.detach(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")


def assert_grads_match(model, ref, **tol):
    """Every parameter of `model` has a gradient exactly where `ref`'s has one, and close to it; at least one."""
    named = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            close_scaled(p.grad, q.grad, name, **tol)
            checked += 1
    assert checked, "no gradients to compare"


def left_padded(lengths, device, vocab=64):
    """Random prompts of the given lengths, left-padded to the longest: (ids, mask) [B, max(lengths)]."""
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length:] = torch.randint(2, vocab, (length,))
        mask[b, n - length:] = 1
    return ids.to(device), mask.to(device)


def tiny_causal_lm(model_type="llama", *, layers=3, vocab=128, attn="eager", seed=0):
    """A random fp32 CausalLM of `model_type` (hidden 32, 4/2 heads of 8): for checkpointing and patching tests."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                               max_position_embeddings=128, hidden_act="silu", pad_token_id=0, eos_token_id=1,
                               bos_token_id=None)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
