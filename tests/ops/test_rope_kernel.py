"""apply_rope: Triton kernel (interpreter on CPU) vs a float64 HF-eager reference; rotate-half and the GLM-4
interleaved layout (also vs transformers' glm4 ``apply_rotary_pos_emb`` itself)."""
import pytest
import torch

from helpers import DTYPES, assert_close, f64, inputs_unchanged
from swift_liger.ops import rope_kernel as rope_mod
from swift_liger.ops._common import launch_override
from swift_liger.ops.rope_kernel import RoPEFunction, apply_rope, apply_rope_reference


def make_cos_sin(B, T, dr, dtype, device, form="btd", base=10000.0):
    """HF-style cos/sin from inv_freq; per-batch position offsets so rows of different batches differ."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr))
    if form == "td":
        pos = torch.arange(T, dtype=torch.float64)[None]
    elif form == "1td":
        pos = torch.arange(T, dtype=torch.float64)[None] + 5
    else:
        pos = torch.arange(T, dtype=torch.float64)[None] + 7 * torch.arange(B, dtype=torch.float64)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    if form == "td":
        cos, sin = cos[0], sin[0]
    return cos.to(device), sin.to(device)


def make_heads(B, T, H, D, dtype, device, layout="view", requires_grad=True):
    """[B, H, T, D] tensor: "view" = transposed [B, T, H, D] projection (HF), "contig" = contiguous,
    "slice" = slice of a fused qkv projection (non-dense strides), "bthd" = [B, T, H, D] itself."""
    if layout == "contig":
        t = torch.randn(B, H, T, D).to(device, dtype)
    elif layout == "slice":
        t = torch.randn(B, T, H * D + 24).to(device, dtype)[..., 8: 8 + H * D].view(B, T, H, D).transpose(1, 2)
    elif layout == "bthd":
        t = torch.randn(B, T, H, D).to(device, dtype)
    else:
        t = torch.randn(B, T, H, D).to(device, dtype).transpose(1, 2)
    return t.detach().requires_grad_(requires_grad)


CASES = [
    # B, T, Hq, Hk, D, Dr, cos form, layout
    (2, 13, 6, 2, 32, 32, "btd", "view"),
    (2, 13, 5, 1, 16, 16, "td", "contig"),
    (1, 9, 3, 2, 96, 96, "1td", "slice"),
    (2, 13, 6, 2, 32, 16, "btd", "view"),      # partial rotary, power-of-2 tail
    (2, 7, 4, 3, 32, 24, "td", "view"),        # partial rotary, odd half (12) and tail (8)
]


def run_case(device, dtype, B, T, Hq, Hk, D, Dr, form, layout, cos_dtype=None, unsqueeze_dim=1,
             interleaved=False, cos_sin=None):
    cos, sin = cos_sin or make_cos_sin(B, T, Dr, cos_dtype or dtype, device, form)
    lay = "bthd" if unsqueeze_dim == 2 else layout
    q = make_heads(B, T, Hq, D, dtype, device, lay)
    k = make_heads(B, T, Hk, D, dtype, device, lay)
    with inputs_unchanged(q, k, cos, sin):
        qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    q64, k64 = f64(q), f64(k)
    rq, rk = apply_rope_reference(q64, k64, f64(cos), f64(sin), unsqueeze_dim=unsqueeze_dim,
                                  interleaved=interleaved)
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (f64(gq), f64(gk)))
    for name, a, e in (("q_embed", qo, rq), ("k_embed", ko, rk), ("dq", dq, rdq), ("dk", dk, rdk)):
        assert a.dtype == dtype, name
        assert_close(a, e, dtype, name=name)
    return q, k, qo, ko, dq, dk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_dtypes(device, dtype):
    q, k, qo, ko, dq, dk = run_case(device, dtype, *CASES[0])
    # Outputs keep the input's [B, T, H, D] memory layout (transposed view), so SDPA needs no copy.
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: "-".join(map(str, c)))
def test_rope_shapes_layouts(device, case):
    dtype = torch.bfloat16 if case[-1] == "slice" else torch.float32
    run_case(device, dtype, *case)


def test_rope_partial_fp16(device):
    run_case(device, torch.float16, *CASES[3])


def test_rope_fp32_cos_with_bf16_q(device):
    run_case(device, torch.bfloat16, *CASES[0], cos_dtype=torch.float32)


def test_rope_unsqueeze_dim_2(device):
    q, k, qo, ko, dq, dk = run_case(device, torch.float32, *CASES[4], unsqueeze_dim=2)
    assert qo.shape == q.shape and qo.is_contiguous()


def test_rope_head_loop_path(device):
    # Tiles smaller than the head count: the kernel loops over head blocks instead of one load phase.
    with launch_override(rope_mod, block_hq=1, block_hk=1):
        run_case(device, torch.float32, 2, 13, 6, 3, 32, 24, "btd", "view")


def test_rope_matches_hf_eager_bf16(device):
    B, T, Hq, Hk, D = 2, 13, 6, 2, 32
    cos, sin = make_cos_sin(B, T, D, torch.bfloat16, device)
    q = make_heads(B, T, Hq, D, torch.bfloat16, device, requires_grad=False)
    k = make_heads(B, T, Hk, D, torch.bfloat16, device, requires_grad=False)
    qo, ko = apply_rope(q, k, cos, sin)
    rq, rk = apply_rope_reference(q, k, cos, sin)  # HF rounds after each product; the kernel once
    assert_close(qo, rq.to(torch.float64), torch.bfloat16, slack=2, name="q vs HF bf16")
    assert_close(ko, rk.to(torch.float64), torch.bfloat16, slack=2, name="k vs HF bf16")


def test_rope_unused_output_and_expanded_grad(device):
    # k_embed unused (grad materialized as zeros); qo.sum() gives a stride-0 expanded gradient.
    B, T, Hq, Hk, D = 2, 5, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, Hq, D, torch.float32, device)
    k = make_heads(B, T, Hk, D, torch.float32, device)
    qo, _ = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad(qo.sum(), (q, k))
    q64 = f64(q)
    rq, _ = apply_rope_reference(q64, f64(k), f64(cos), f64(sin))
    (rdq,) = torch.autograd.grad(rq.sum(), (q64,))
    assert_close(dq, rdq, torch.float32, name="dq")
    assert torch.count_nonzero(dk) == 0


def test_rope_cos_requiring_grad_uses_reference(device):
    B, T, H, D = 1, 4, 2, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    cos.requires_grad_()
    q = make_heads(B, T, H, D, torch.float32, device)
    qo, ko = apply_rope(q, q.detach(), cos, sin)
    (dcos,) = torch.autograd.grad(qo.sum(), (cos,))
    assert dcos.shape == cos.shape


def test_rope_torch_compile_no_graph_break(device):
    B, T, Hq, Hk, D = 2, 5, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)

    def f(q, k, cos, sin):
        qo, ko = apply_rope(q, k, cos, sin)
        return qo * 2.0, ko + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = make_heads(B, T, Hq, D, torch.float32, device)
    k = make_heads(B, T, Hk, D, torch.float32, device)
    out_c = compiled(q, k, cos, sin)
    grads_c = torch.autograd.grad(out_c, (q, k), (torch.ones_like(out_c[0]), torch.ones_like(out_c[1])))
    out_e = f(q, k, cos, sin)
    grads_e = torch.autograd.grad(out_e, (q, k), (torch.ones_like(out_e[0]), torch.ones_like(out_e[1])))
    for a, e in zip(out_c + grads_c, out_e + grads_e):
        torch.testing.assert_close(a, e)


def test_rope_function_direct(device):
    # RoPEFunction takes the validated [B, H, T, D] / [Bc, T, Dr] form.
    B, T, H, D = 1, 3, 2, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, H, D, torch.float32, device)
    qo, ko = RoPEFunction.apply(q, q, cos, sin)
    rq, _ = apply_rope_reference(f64(q), f64(q), f64(cos), f64(sin))
    assert_close(qo, rq, torch.float32, name="q")


def _bad_inputs(device):
    B, T, Hq, Hk, D = 1, 4, 2, 1, 8
    q = torch.randn(B, Hq, T, D, device=device)
    k = torch.randn(B, Hk, T, D, device=device)
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    c6, s6 = make_cos_sin(B, T, 6, torch.float32, device)
    c_odd = torch.randn(B, T, 5, device=device)
    return [
        ("q", (q[0], k, cos, sin), {}, ValueError),
        ("k", (q, k[0], cos, sin), {}, ValueError),
        ("k", (q, torch.randn(B, Hk, T, 16, device=device), cos, sin), {}, ValueError),      # D mismatch
        ("k", (q, torch.randn(B, Hk, T + 1, D, device=device), cos, sin), {}, ValueError),  # T mismatch
        ("k", (q, k.half(), cos, sin), {}, TypeError),
        ("q", (q.long(), k, cos, sin), {}, TypeError),
        ("q", (torch.randn(B, Hq, T, 2 * D, device=device)[..., ::2], k, cos, sin), {}, ValueError),  # stride
        ("cos", (q, k, cos[:, :3], sin[:, :3]), {}, ValueError),                           # T mismatch
        ("cos", (q, k, torch.randn(B, T, 2 * D, device=device), torch.randn(B, T, 2 * D, device=device)), {},
         ValueError),                                                                       # Dr > D
        ("cos", (q, k, c_odd, c_odd), {}, ValueError),                                      # odd Dr
        ("sin", (q, k, cos, s6), {}, ValueError),                                           # cos/sin mismatch
        ("cos", (q, k, cos.expand(3, T, D), sin.expand(3, T, D)), {}, ValueError),          # batch mismatch
        ("cos", (q, k, cos[None], sin[None]), {}, ValueError),                              # rank
        ("sin", (q, k, cos, sin.double()), {}, TypeError),
        ("unsqueeze_dim", (q, k, cos, sin), {"unsqueeze_dim": 0}, ValueError),
        ("interleaved", (q, k, cos, sin), {"interleaved": 1}, TypeError),
        ("cos_interleaved", (q, k, c_odd, c_odd), {"interleaved": True}, ValueError),        # odd Dr
        ("cos", (q, k, [1.0], sin), {}, TypeError),
        ("c6", (q, k, c6, s6), {}, None),  # a valid partial rotary call
        ("c6_interleaved", (q, k, c6, s6), {"interleaved": True}, None),
    ]


def test_rope_bad_inputs(device):
    for name, args, kwargs, exc in _bad_inputs(device):
        if exc is None:
            apply_rope(*args, **kwargs)
            continue
        with pytest.raises(exc) as info:
            apply_rope(*args, **kwargs)
        assert name.split("_")[0] in str(info.value), (name, str(info.value))


# ---------------------------------------------------------------------------------------------------------------
# Interleaved layout (GLM-4 family): pairs (2i, 2i + 1) rotated by cos/sin[..., i]; second half of cos/sin unused.
# ---------------------------------------------------------------------------------------------------------------

IL_CASES = [
    # B, T, Hq, Hk, D, Dr, cos form, layout
    (2, 7, 3, 1, 16, 16, "btd", "view"),       # full rotary, odd head counts
    (2, 7, 3, 1, 16, 8, "btd", "view"),        # partial rotary (GLM-4: partial_rotary_factor 0.5)
    (1, 5, 3, 1, 64, 32, "1td", "slice"),      # partial, D=64 / Dr=32, fused-qkv slice
    (2, 5, 2, 1, 32, 32, "td", "contig"),      # [T, Dr] cos/sin
    (2, 5, 3, 2, 32, 24, "btd", "view"),       # partial, odd pair count (12) and tail (8)
    (1, 5, 3, 1, 24, 24, "btd", "contig"),     # full rotary, 12 pairs in a 16-pair tile: masked tile end
]


def hf_glm4_apply_rotary_pos_emb():
    glm4 = pytest.importorskip("transformers.models.glm4.modeling_glm4")
    return glm4.apply_rotary_pos_emb


def manual_interleaved(x, cos, sin, unsqueeze_dim=1):
    """The brief's formula, element by element: out[2i] = x[2i] c[i] - x[2i+1] s[i],
    out[2i+1] = x[2i+1] c[i] + x[2i] s[i] for i < Dr/2, c = cos[..., :Dr/2]; dims Dr.. pass through."""
    dr = cos.shape[-1]
    c = cos[..., : dr // 2].unsqueeze(unsqueeze_dim)
    s = sin[..., : dr // 2].unsqueeze(unsqueeze_dim)
    out = x.clone()
    xe, xo = x[..., 0:dr:2], x[..., 1:dr:2]
    out[..., 0:dr:2] = xe * c - xo * s
    out[..., 1:dr:2] = xo * c + xe * s
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", IL_CASES[:2], ids=lambda c: "-".join(map(str, c)))
def test_rope_interleaved_dtypes(device, dtype, case):
    q, k, qo, ko, dq, dk = run_case(device, dtype, *case, interleaved=True)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("case", IL_CASES[2:], ids=lambda c: "-".join(map(str, c)))
def test_rope_interleaved_shapes_layouts(device, case):
    dtype = torch.bfloat16 if case[-1] == "slice" else torch.float32
    run_case(device, dtype, *case, interleaved=True)


@pytest.mark.parametrize("dr", [16, 8])
def test_rope_interleaved_unsqueeze_dim_2(device, dr):
    q, k, qo, ko, dq, dk = run_case(device, torch.float32, 2, 5, 3, 1, 16, dr, "btd", "view", unsqueeze_dim=2,
                                    interleaved=True)
    assert qo.shape == q.shape and qo.is_contiguous() and ko.shape == k.shape


def test_rope_interleaved_fp32_cos_with_bf16_q(device):
    run_case(device, torch.bfloat16, *IL_CASES[1], cos_dtype=torch.float32, interleaved=True)


def test_rope_interleaved_head_loop_path(device):
    with launch_override(rope_mod, block_hq=1, block_hk=1):
        run_case(device, torch.float32, 2, 5, 5, 3, 32, 24, "btd", "view", interleaved=True)


def test_rope_interleaved_ignores_second_half_of_cos_sin(device):
    # Garbage in cos/sin[..., Dr/2:] (finite, so inputs_unchanged can compare it): neither the forward nor the
    # backward kernel may read it.
    B, T, Dr = 2, 5, 8
    cos, sin = make_cos_sin(B, T, Dr, torch.float32, device)
    cos[..., Dr // 2:] = 1e4
    sin[..., Dr // 2:] = -3e3
    run_case(device, torch.float32, B, T, 3, 1, 16, Dr, "btd", "view", interleaved=True, cos_sin=(cos, sin))


def test_rope_interleaved_is_a_different_layout(device):
    B, T, Hq, Hk, D = 1, 4, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, Hq, D, torch.float32, device, requires_grad=False)
    k = make_heads(B, T, Hk, D, torch.float32, device, requires_grad=False)
    qi, ki = apply_rope(q, k, cos, sin, interleaved=True)
    qh, kh = apply_rope(q, k, cos, sin)
    assert not torch.allclose(qi, qh) and not torch.allclose(ki, kh)
    # Against the pairwise formula written out element by element.
    assert_close(qi, manual_interleaved(f64(q), f64(cos), f64(sin)), torch.float32, name="q vs formula")
    assert_close(ki, manual_interleaved(f64(k), f64(cos), f64(sin)), torch.float32, name="k vs formula")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,Dr,unsqueeze_dim", [(16, 16, 1), (16, 8, 1), (64, 32, 2)], ids=str)
def test_rope_interleaved_reference_is_hf_glm4(device, dtype, D, Dr, unsqueeze_dim):
    # The reference is HF GLM-4's function, bit for bit, in the input dtype.
    hf = hf_glm4_apply_rotary_pos_emb()
    B, T, Hq, Hk = 2, 5, 3, 1
    cos, sin = make_cos_sin(B, T, Dr, dtype, device)
    lay = "bthd" if unsqueeze_dim == 2 else "view"
    q = make_heads(B, T, Hq, D, dtype, device, lay, requires_grad=False)
    k = make_heads(B, T, Hk, D, dtype, device, lay, requires_grad=False)
    eq, ek = hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    rq, rk = apply_rope_reference(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=True)
    assert rq.dtype == eq.dtype == dtype
    assert torch.equal(rq, eq) and torch.equal(rk, ek)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,Dr,unsqueeze_dim", [(16, 16, 1), (16, 8, 2), (64, 32, 1)], ids=str)
def test_rope_interleaved_matches_hf_glm4(device, dtype, D, Dr, unsqueeze_dim):
    # Kernel vs transformers' glm4 apply_rotary_pos_emb: outputs in dtype, and gradients of q and k.
    hf = hf_glm4_apply_rotary_pos_emb()
    B, T, Hq, Hk = 2, 5, 3, 1
    cos, sin = make_cos_sin(B, T, Dr, dtype, device)
    lay = "bthd" if unsqueeze_dim == 2 else "view"
    q = make_heads(B, T, Hq, D, dtype, device, lay)
    k = make_heads(B, T, Hk, D, dtype, device, lay)
    with inputs_unchanged(q, k, cos, sin):
        qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=True)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    eq, ek = hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)      # HF rounds after each product; the kernel once
    slack = 1 if dtype == torch.float32 else 2
    assert_close(qo, eq.to(torch.float64), dtype, slack=slack, name="q vs HF glm4")
    assert_close(ko, ek.to(torch.float64), dtype, slack=slack, name="k vs HF glm4")
    # HF's autograd in float64 (its function is dtype-generic).
    q64, k64 = f64(q), f64(k)
    e64 = hf(q64, k64, f64(cos), f64(sin), unsqueeze_dim=unsqueeze_dim)
    edq, edk = torch.autograd.grad(e64, (q64, k64), (f64(gq), f64(gk)))
    assert_close(dq, edq, dtype, name="dq vs HF glm4")
    assert_close(dk, edk, dtype, name="dk vs HF glm4")


def test_rope_interleaved_outputs_poisoned():
    # The suite allocates every kernel output NaN-filled (conftest: SWIFT_LIGER_POISON=1), so the NaN checks of
    # assert_close above catch any element of q_embed / k_embed / dq / dk the interleaved kernel leaves unwritten.
    assert rope_mod._common.POISON


def test_rope_interleaved_torch_backend(device, monkeypatch):
    # SWIFT_LIGER_BACKEND=torch: the PyTorch reference runs (no kernel launch) and honours interleaved.
    hf = hf_glm4_apply_rotary_pos_emb()
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")

    def no_kernel(*args, **kwargs):
        raise AssertionError("the torch backend launched the Triton kernel")

    monkeypatch.setattr(rope_mod, "_rope_launch", no_kernel)
    B, T, Hq, Hk, D, Dr = 2, 5, 3, 1, 16, 8
    cos, sin = make_cos_sin(B, T, Dr, torch.bfloat16, device)
    q = make_heads(B, T, Hq, D, torch.bfloat16, device)
    k = make_heads(B, T, Hk, D, torch.bfloat16, device)
    qo, ko = apply_rope(q, k, cos, sin, interleaved=True)
    eq, ek = hf(q, k, cos, sin)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (torch.ones_like(qo), torch.ones_like(ko)))
    edq, edk = torch.autograd.grad((eq, ek), (q, k), (torch.ones_like(eq), torch.ones_like(ek)))
    assert torch.equal(dq, edq) and torch.equal(dk, edk)
    qh, _ = apply_rope(q, k, cos, sin)   # and the default is still rotate-half there
    assert torch.equal(qh, apply_rope_reference(q, k, cos, sin)[0]) and not torch.equal(qh, qo)


def test_rope_interleaved_torch_compile_no_graph_break(device):
    B, T, Hq, Hk, D, Dr = 2, 5, 3, 1, 16, 8
    cos, sin = make_cos_sin(B, T, Dr, torch.float32, device)

    def f(q, k, cos, sin):
        qo, ko = apply_rope(q, k, cos, sin, interleaved=True)
        return qo * 2.0, ko + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = make_heads(B, T, Hq, D, torch.float32, device)
    k = make_heads(B, T, Hk, D, torch.float32, device)
    out_c = compiled(q, k, cos, sin)
    grads_c = torch.autograd.grad(out_c, (q, k), (torch.ones_like(out_c[0]), torch.ones_like(out_c[1])))
    q64, k64 = f64(q), f64(k)
    rq, rk = apply_rope_reference(q64, k64, f64(cos), f64(sin), interleaved=True)
    rdq, rdk = torch.autograd.grad((rq * 2.0, rk + 1.0), (q64, k64), (torch.ones_like(rq), torch.ones_like(rk)))
    for name, a, e in (("q", out_c[0], rq * 2.0), ("k", out_c[1], rk + 1.0), ("dq", grads_c[0], rdq),
                       ("dk", grads_c[1], rdk)):
        assert_close(a, e, torch.float32, name=name)


def test_rope_function_direct_interleaved(device):
    # RoPEFunction takes interleaved positionally (autograd.Function.apply has no keyword arguments).
    B, T, H, D = 1, 3, 2, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, H, D, torch.float32, device)
    qo, ko = RoPEFunction.apply(q, q, cos, sin, True)
    (dq,) = torch.autograd.grad(qo.sum(), (q,))
    q64 = f64(q)
    rq, _ = apply_rope_reference(q64, f64(q), f64(cos), f64(sin), interleaved=True)
    (rdq,) = torch.autograd.grad(rq.sum(), (q64,))
    assert_close(qo, rq, torch.float32, name="q")
    assert_close(dq, rdq, torch.float32, name="dq")


# ---------------------------------------------------------------------------------------------------------------
# inplace=True: q/k rotated in their own memory, incoming gradients rotated in theirs (Liger-Kernel's memory).
# ---------------------------------------------------------------------------------------------------------------

def _inplace_case(device, dtype, B, T, Hq, Hk, D, Dr, form, layout, interleaved=False):
    """Projection outputs (non-leaf views of leaves, as an attention layer sees q/k) rotated in place; values and
    gradients against the float64 reference, and which memory each result lives in."""
    cos, sin = make_cos_sin(B, T, Dr, dtype, device, form)
    q_src, k_src = make_heads(B, T, Hq, D, dtype, device, layout), make_heads(B, T, Hk, D, dtype, device, layout)
    q64, k64 = f64(q_src), f64(k_src)
    q, k = q_src * 1, k_src * 1   # fresh non-leaf tensors with q_src's strides
    qo, ko = apply_rope(q, k, cos, sin, interleaved=interleaved, inplace=True)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    for out, inp in ((qo, q), (ko, k)):   # same layout (strides of size-1 dims do not matter)
        assert [st for n, st in zip(out.shape, out.stride()) if n > 1] == \
            [st for n, st in zip(inp.shape, inp.stride()) if n > 1]
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    gq_in, gk_in = gq.clone(), gk.clone()
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))   # the gradients RoPE hands to the projections
    rq, rk = apply_rope_reference(q64, k64, f64(cos), f64(sin), interleaved=interleaved)
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (f64(gq_in), f64(gk_in)))
    for name, a, e in (("q_embed", qo, rq), ("k_embed", ko, rk), ("dq", dq, rdq), ("dk", dk, rdk)):
        assert_close(a, e, dtype, name=name)
    # the gradients were rotated in the incoming buffers (no new [B, H, T, D] tensors)
    assert dq.data_ptr() == gq.data_ptr() and dk.data_ptr() == gk.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_inplace_values_and_gradients(device, dtype):
    _inplace_case(device, dtype, *CASES[0])


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: "-".join(map(str, c)))
def test_rope_inplace_shapes_layouts(device, case):
    _inplace_case(device, torch.float32, *case)


def test_rope_inplace_interleaved(device):
    _inplace_case(device, torch.float32, *IL_CASES[1], interleaved=True)


def test_rope_inplace_head_loop_path(device):
    with launch_override(rope_mod, block_hq=1, block_hk=1):
        _inplace_case(device, torch.float32, 2, 13, 6, 3, 32, 24, "btd", "view")


def test_rope_inplace_leaf_and_no_grad(device):
    # A leaf that requires grad is overwritten too (the caller asked), and still gets the right gradient;
    # under no_grad the launcher runs directly.
    B, T, Hq, Hk, D = 2, 5, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q, k = make_heads(B, T, Hq, D, torch.float32, device), make_heads(B, T, Hk, D, torch.float32, device)
    q64, k64 = f64(q), f64(k)
    rq, rk = apply_rope_reference(q64, k64, f64(cos), f64(sin))
    qo, ko = apply_rope(q, k, cos, sin, inplace=True)
    assert qo.data_ptr() == q.data_ptr()
    assert_close(q, rq, torch.float32, name="q overwritten")
    g = torch.randn_like(qo)
    (qo * g).sum().backward()
    (rdq,) = torch.autograd.grad((rq * f64(g)).sum(), (q64,))
    assert_close(q.grad, rdq, torch.float32, name="dq of a leaf")
    with torch.no_grad():
        q2, k2 = q.detach().clone(), k.detach().clone()
        a, b = apply_rope(q2, k2, cos, sin, inplace=True)
        assert a.data_ptr() == q2.data_ptr() and b.data_ptr() == k2.data_ptr()
        ra, rb = apply_rope_reference(f64(q.detach()), f64(k.detach()), f64(cos), f64(sin))
        assert_close(q2, ra, torch.float32, name="no_grad q")
        assert_close(k2, rb, torch.float32, name="no_grad k")


def test_rope_inplace_saved_input_fails_loudly(device):
    # A graph node that saved q before the rotation must not read rotated values: autograd's version check.
    B, T, Hq, Hk, D = 1, 4, 2, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    x = torch.randn(B, T, Hq, D, device=device, requires_grad=True)
    q = (x * 2).transpose(1, 2)
    saved = q * q                       # mul saves q
    qo, _ = apply_rope(q, make_heads(B, T, Hk, D, torch.float32, device), cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved.sum() + qo.sum()).backward()


def test_rope_inplace_falls_back_out_of_place(device):
    # q and k in one buffer (a fused qkv projection), an expanded incoming gradient: new tensors, right values.
    B, T, H, D = 2, 5, 2, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    qkv = torch.randn(B, T, 3 * H * D, device=device)
    q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
    k = qkv[..., H * D: 2 * H * D].view(B, T, H, D).transpose(1, 2)
    before = qkv.clone()
    qo, ko = apply_rope(q, k, cos, sin, inplace=True)
    assert qo.data_ptr() != q.data_ptr() and torch.equal(qkv, before)
    rq, rk = apply_rope_reference(f64(q), f64(k), f64(cos), f64(sin))
    assert_close(qo, rq, torch.float32, name="q")
    q_src = make_heads(B, T, H, D, torch.float32, device)
    k_src = make_heads(B, T, H, D, torch.float32, device)
    qo, ko = apply_rope(q_src * 1, k_src * 1, cos, sin, inplace=True)
    dq, = torch.autograd.grad(qo.sum(), (q_src,))   # stride-0 gradient: rotated into a new tensor
    q64 = f64(q_src)
    (rdq,) = torch.autograd.grad(apply_rope_reference(q64, f64(k_src), f64(cos), f64(sin))[0].sum(), (q64,))
    assert_close(dq, rdq, torch.float32, name="dq from an expanded gradient")


def test_rope_function_direct_inplace_checks_its_inputs(device):
    # RoPEFunction.apply(..., inplace=True) called directly (not through apply_rope) with q and k in one buffer:
    # the same check runs, so the buffer is left alone and the values are right.
    B, T, H, D = 1, 4, 2, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    qk = torch.randn(B, T, 2 * H * D, device=device)
    q = qk[..., : H * D].view(B, T, H, D).transpose(1, 2)
    k = qk[..., H * D:].view(B, T, H, D).transpose(1, 2)
    before = qk.clone()
    qo, ko = RoPEFunction.apply(q, k, cos, sin, False, True)
    assert torch.equal(qk, before) and qo.data_ptr() != q.data_ptr()
    rq, rk = apply_rope_reference(f64(q), f64(k), f64(cos), f64(sin))
    assert_close(qo, rq, torch.float32, name="q")
    assert_close(ko, rk, torch.float32, name="k")


def test_rope_inplace_bad_flag(device):
    B, T, H, D = 1, 3, 1, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, H, D, torch.float32, device, requires_grad=False)
    with pytest.raises(TypeError, match="inplace"):
        apply_rope(q, q.clone(), cos, sin, inplace=1)


def test_rope_inplace_torch_backend(device, monkeypatch):
    # SWIFT_LIGER_BACKEND=torch (users without CUDA): the reference runs out of place; q and k stay as they were.
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    B, T, Hq, Hk, D = 2, 5, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q, k = make_heads(B, T, Hq, D, torch.float32, device), make_heads(B, T, Hk, D, torch.float32, device)
    with inputs_unchanged(q, k, cos, sin):
        qo, ko = apply_rope(q * 1, k * 1, cos, sin, inplace=True)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (torch.ones_like(qo), torch.ones_like(ko)))
    eq, ek = apply_rope_reference(q, k, cos, sin)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    edq, edk = torch.autograd.grad((eq, ek), (q, k), (torch.ones_like(eq), torch.ones_like(ek)))
    assert torch.equal(dq, edq) and torch.equal(dk, edk)
