"""apply_rope: Triton kernel (interpreter on CPU) vs a float64 HF-eager reference."""
import importlib
import pytest
import torch

from helpers import DTYPES, assert_close, f64, inputs_unchanged
rope_mod = importlib.import_module("swift_liger.ops.rope")
from swift_liger.ops.rope import RoPEFunction, apply_rope, apply_rope_reference


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


def run_case(device, dtype, B, T, Hq, Hk, D, Dr, form, layout, cos_dtype=None, unsqueeze_dim=1):
    cos, sin = make_cos_sin(B, T, Dr, cos_dtype or dtype, device, form)
    lay = "bthd" if unsqueeze_dim == 2 else layout
    q = make_heads(B, T, Hq, D, dtype, device, lay)
    k = make_heads(B, T, Hk, D, dtype, device, lay)
    with inputs_unchanged(q, k, cos, sin):
        qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    q64, k64 = f64(q), f64(k)
    rq, rk = apply_rope_reference(q64, k64, f64(cos), f64(sin), unsqueeze_dim=unsqueeze_dim)
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


def test_rope_head_loop_path(device, monkeypatch):
    # Tiles smaller than the head count: the kernel loops over head blocks instead of one load phase.
    monkeypatch.setitem(rope_mod.TUNING, "tile_elems", 16)
    monkeypatch.setitem(rope_mod.TUNING, "programs_per_sm", 2)
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
        ("cos", (q, k, [1.0], sin), {}, TypeError),
        ("c6", (q, k, c6, s6), {}, None),  # a valid partial rotary call
    ]


def test_rope_bad_inputs(device):
    for name, args, kwargs, exc in _bad_inputs(device):
        if exc is None:
            apply_rope(*args, **kwargs)
            continue
        with pytest.raises(exc) as info:
            apply_rope(*args, **kwargs)
        assert name.split("_")[0] in str(info.value), (name, str(info.value))
