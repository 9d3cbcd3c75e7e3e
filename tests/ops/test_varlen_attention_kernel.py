"""varlen_attention (causal attention within packed documents, GQA, window, softcap) against a float64 per-document
reference: outputs and all three input gradients; Triton interpreter on CPU, compiled kernels on the GPU leg."""
import pytest
import torch

from helpers import DTYPES, assert_close, inputs_unchanged
from swift_liger.ops.varlen_attention_kernel import (doc_bounds, seq_ids_from_positions, varlen_attention,
                                                     varlen_attention_reference)

CASES = [
    # B, Hq, Hkv, D, per-row document lengths, softcap, window
    (1, 2, 1, 16, [[5, 20, 12]], None, None),                     # three documents, one block boundary inside each
    (2, 4, 2, 24, [[40], [1, 1, 30, 8]], None, None),             # one-token documents; D not a power of two
    (1, 3, 3, 32, [[33]], None, None),                            # a single document (dense causal), G = 1
    (1, 6, 2, 8, [[7, 9, 3, 14]], None, None),                    # G = 3 (not a power of two), D below the dot minimum
    (2, 2, 1, 16, [[10, 23], [33]], None, 7),                     # sliding window inside documents
    (1, 4, 2, 16, [[17, 2, 19]], 5.0, None),                      # Gemma-2 style softcap
    (1, 2, 1, 16, [[25, 11]], 3.0, 5),                            # both
    (1, 4, 2, 16, [[70, 9]], None, 37),                           # window wider than a block: unmasked blocks in it
    (1, 2, 1, 16, [[3, 61, 16]], 2.0, None),                      # blocks wholly inside a document, not aligned
]


def make(B, HQ, HKV, D, lengths, dtype, device):
    """q as transformers hands it (a [B, Hq, T, D] view of a [B, T, Hq, D] projection), k/v contiguous."""
    T = sum(lengths[0])
    q = torch.randn(B, T, HQ, D).to(device, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, HKV, T, D).to(device, dtype).requires_grad_()
    v = torch.randn(B, T, HKV, D).to(device, dtype).transpose(1, 2).requires_grad_()
    seq = torch.stack([torch.repeat_interleave(torch.arange(len(row)) * 3 + 1, torch.tensor(row)) for row in lengths])
    return q, k, v, seq.to(device)


def f64(q, k, v, seq, **kw):
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    return leaves, varlen_attention_reference(*leaves, seq.cpu(), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,HQ,HKV,D,lengths,softcap,window", CASES)
def test_matches_reference(device, dtype, B, HQ, HKV, D, lengths, softcap, window):
    q, k, v, seq = make(B, HQ, HKV, D, lengths, dtype, device)
    kw = dict(scale=D ** -0.5, softcap=softcap, window=window)
    with inputs_unchanged(q, k, v, seq):
        out = varlen_attention(q, k, v, seq, **kw)
    T = q.shape[2]
    assert out.shape == (B, T, HQ, D) and out.dtype == dtype
    leaves, ref = f64(q, k, v, seq, **kw)
    assert_close(out, ref, dtype, name="out")
    grad = torch.randn_like(out)
    with inputs_unchanged(grad):
        out.backward(grad)
    ref.backward(grad.double().cpu())
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        assert t.grad.shape == t.shape
        assert_close(t.grad, r.grad, dtype, slack=2, name=name)


@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_head_dims(device, D):
    """The head dims of the model families (64 Qwen2.5-0.5B, 80 Phi-2-like, 128 Llama/Qwen, 256 Gemma)."""
    q, k, v, seq = make(1, 2, 1, D, [[9, 14]], torch.float32, device)
    out = varlen_attention(q, k, v, seq, scale=D ** -0.5)
    leaves, ref = f64(q, k, v, seq, scale=D ** -0.5)
    assert_close(out, ref, torch.float32, name=f"out D={D}")
    out.sum().backward()
    ref.sum().backward()
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        assert_close(t.grad, r.grad, torch.float32, slack=2, name=f"{name} D={D}")


def test_packed_equals_separate_rows(device):
    """A packed row gives each document exactly what it gets alone in a row of its own."""
    lengths = [6, 19, 11]
    q, k, v, seq = make(1, 4, 2, 16, [lengths], torch.float32, device)
    out = varlen_attention(q, k, v, seq, scale=0.25)
    s = 0
    for n in lengths:
        alone = varlen_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], scale=0.25)
        assert_close(out[:, s:s + n], alone, torch.float32, name=f"doc at {s}")
        s += n


def test_peaky_scores_and_no_grad(device):
    """Large logits stay finite (running max); without grad the forward alone runs and returns the same rows."""
    q, k, v, seq = make(1, 2, 1, 16, [[30, 7]], torch.float32, device)
    q = (q.detach() * 30).requires_grad_()
    out = varlen_attention(q, k, v, seq, scale=1.0)
    _, ref = f64(q, k, v, seq, scale=1.0)
    assert_close(out, ref, torch.float32, slack=10, name="peaky")
    with torch.no_grad():
        again = varlen_attention(q, k, v, seq, scale=1.0)
    assert not again.requires_grad
    assert_close(again, ref, torch.float32, slack=10, name="no_grad")


def test_bounds_argument(device):
    q, k, v, seq = make(2, 2, 1, 16, [[5, 12], [17]], torch.float32, device)
    a = varlen_attention(q, k, v, seq, scale=0.25)
    b = varlen_attention(q, k, v, bounds=doc_bounds(seq), scale=0.25)
    assert torch.equal(a, b)


def test_doc_bounds():
    seq = torch.tensor([[0, 0, 0, 4, 4, 9], [2, 2, 2, 2, 2, 2], [1, 2, 3, 3, 5, 5]])
    lo, hi = doc_bounds(seq)
    assert lo.dtype == torch.int32 and hi.dtype == torch.int32
    assert lo.tolist() == [[0, 0, 0, 3, 3, 5], [0] * 6, [0, 1, 2, 2, 4, 4]]
    assert hi.tolist() == [[3, 3, 3, 5, 5, 6], [6] * 6, [1, 2, 4, 4, 6, 6]]


def test_seq_ids_from_positions_match_transformers():
    """Document starts read from position ids exactly as transformers' packed-sequence detection does."""
    from transformers.masking_utils import find_packed_sequence_indices
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert torch.equal(seq_ids_from_positions(pos), find_packed_sequence_indices(pos))
    # right padding (positions keep counting or restart at 0): the padding run is its own document
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    ids = seq_ids_from_positions(torch.arange(6)[None], mask)
    assert ids.tolist() == [[0, 0, 0, 0, 1, 1]]


def test_reference_backend(device, monkeypatch):
    """SWIFT_LIGER_BACKEND=torch (the default for CPU tensors): the PyTorch reference runs, with gradients."""
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    q, k, v, seq = make(1, 4, 2, 16, [[6, 13]], torch.float32, device)
    out = varlen_attention(q, k, v, seq, scale=0.25, window=4, softcap=2.0)
    leaves, ref = f64(q, k, v, seq, scale=0.25, window=4, softcap=2.0)
    assert_close(out, ref, torch.float32, name="reference backend")
    out.sum().backward()
    ref.sum().backward()
    for t, r in zip((q, k, v), leaves):
        assert_close(t.grad, r.grad, torch.float32, slack=2, name="reference backend grad")


def test_bad_inputs(device):
    q, k, v, seq = make(1, 4, 2, 16, [[5, 5]], torch.float32, device)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        varlen_attention(q[:, :3], k, v, seq, scale=0.25)
    with pytest.raises(ValueError, match="k and v"):
        varlen_attention(q, k, v[:, :, :5], seq, scale=0.25)
    with pytest.raises(ValueError, match="seq_ids"):
        varlen_attention(q, k, v, seq[:, :4], scale=0.25)
    with pytest.raises(TypeError, match="seq_ids"):
        varlen_attention(q, k, v, seq.float(), scale=0.25)
    with pytest.raises(ValueError, match="scale"):
        varlen_attention(q, k, v, seq, scale=0.0)
    with pytest.raises(ValueError, match="window"):
        varlen_attention(q, k, v, seq, scale=0.25, window=0)
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention(q, k, v, seq, scale=0.25, softcap=-1.0)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        varlen_attention(q, k.half(), v.half(), seq, scale=0.25)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.zeros(1, 2, 4, 320, device=device)
        varlen_attention(big, big, big, scale=0.25)


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (3.0, 9)])
def test_torch_compile_no_graph_break(device, softcap, window):
    """A compiled region (fullgraph: a graph break fails) with packed attention inside keeps each launch as one
    custom-op node; outputs and all three gradients equal the eager call's, with and without grad."""
    from swift_liger.ops.varlen_attention_kernel import varlen_attention_unchecked
    q, k, v, seq = make(1, 4, 2, 16, [[11, 20, 6]], torch.float32, device)
    bounds = doc_bounds(seq)

    def f(q, k, v, lo, hi):
        return varlen_attention_unchecked(q, k, v, (lo, hi), 0.3, softcap, window) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g = torch.randn(1, 37, 4, 16).to(device)
    out_c = compiled(q, k, v, *bounds)
    grads_c = torch.autograd.grad(out_c, (q, k, v), g)
    out_e = f(q, k, v, *bounds)
    grads_e = torch.autograd.grad(out_e, (q, k, v), g)
    for a, e in zip((out_c,) + grads_c, (out_e,) + grads_e):
        torch.testing.assert_close(a, e)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, *bounds), out_e)


def test_custom_ops_schema_and_fake(device):
    """The registered ops' schemas and fake (meta) implementations agree with what the kernels return."""
    from swift_liger.ops import varlen_attention_kernel as m
    q, k, v, seq = make(1, 4, 2, 16, [[9, 8]], torch.float32, device)
    q, k, v = q.detach(), k.detach(), v.detach()
    lo, hi = doc_bounds(seq)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(m._fwd_op, (q, k, v, lo, 0.25, 0.0, 0), test_utils=tests)
    out, lse = m._fwd_op(q, k, v, lo, 0.25, 0.0, 0)
    grad = torch.randn_like(out)
    torch.library.opcheck(m._bwd_op, (grad, q, k, v, out, lse, lo, hi, 0.25, 0.0, 0), test_utils=tests)
