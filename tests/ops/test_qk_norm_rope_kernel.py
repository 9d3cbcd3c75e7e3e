"""qk_norm_rope: Triton kernels (interpreter on CPU) vs a float64 reference that rounds where HF eager rounds."""
import pytest
import torch

from helpers import DTYPES, REDUCTION_SLACK, assert_close, f64, inputs_unchanged
from swift_liger.ops import qk_norm_rope_kernel as qk_mod
from swift_liger.ops import _reduce as reduce_mod
from swift_liger.ops._common import launch_override
from swift_liger.ops.qk_norm_rope_kernel import QKNormRoPEFunction, qk_norm_rope, qk_norm_rope_reference
from swift_liger.ops.rope_kernel import apply_rope_reference
from test_rope_kernel import make_cos_sin, make_heads


def st_round(x, dtype):
    """HF's cast to ``dtype`` as a value, identity as a gradient (so the float64 gradients stay exact)."""
    if dtype == torch.float32:
        return x
    return x + (x.to(dtype).to(x.dtype) - x).detach()


def reference64(q, k, qw, kw, cos, sin, *, eps, offset, casting, dtype, w_dtype, unsqueeze_dim=1):
    """float64 q_norm -> k_norm -> rotary, rounding to ``dtype`` at HF's points (Qwen3RMSNorm / Gemma3RMSNorm)."""
    def norm(x, w):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if casting == "gemma":
            return st_round(n * (offset + w), dtype)
        y = st_round(n, dtype) * (offset + w)
        return st_round(y, dtype) if torch.promote_types(dtype, w_dtype) == dtype else y
    return apply_rope_reference(norm(q, qw), norm(k, kw), cos, sin, unsqueeze_dim=unsqueeze_dim)


def make_weight(D, dtype, device, casting, requires_grad=True):
    # Qwen3 weights sit near 1; Gemma3 stores w with the norm applying (1 + w).
    w = torch.rand(D) + 0.5 if casting == "llama" else torch.randn(D) * 0.5
    return w.to(device, dtype).requires_grad_(requires_grad)


def run_case(device, dtype, B, T, Hq, Hk, D, Dr, form, layout, *, casting="llama", eps=1e-6, w_dtype=None,
             cos_dtype=None, unsqueeze_dim=1, weights_grad=True):
    offset = 1.0 if casting == "gemma" else 0.0
    w_dtype = w_dtype or dtype
    cos, sin = make_cos_sin(B, T, Dr, cos_dtype or dtype, device, form)
    lay = "bthd" if unsqueeze_dim == 2 else layout
    # Scale away from 1 so the normalization matters.
    q = (make_heads(B, T, Hq, D, dtype, device, lay, requires_grad=False) * 3).requires_grad_()
    k = (make_heads(B, T, Hk, D, dtype, device, lay, requires_grad=False) * 0.5).requires_grad_()
    qw = make_weight(D, w_dtype, device, casting, weights_grad)
    kw = make_weight(D, w_dtype, device, casting, weights_grad)
    leaves = (q, k, qw, kw) if weights_grad else (q, k)
    with inputs_unchanged(q, k, qw, kw, cos, sin):
        qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin, eps=eps, offset=offset, casting=casting,
                              unsqueeze_dim=unsqueeze_dim)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        grads = torch.autograd.grad((qo, ko), leaves, (gq, gk))
    leaves64 = [f64(t) for t in leaves]
    if not weights_grad:
        leaves64 += [f64(qw), f64(kw)]
    rq, rk = reference64(*leaves64, f64(cos), f64(sin), eps=eps, offset=offset, casting=casting, dtype=dtype,
                         w_dtype=w_dtype, unsqueeze_dim=unsqueeze_dim)
    rgrads = torch.autograd.grad((rq, rk), leaves64[:len(leaves)], (f64(gq), f64(gk)))
    assert qo.dtype == dtype and ko.dtype == dtype
    assert_close(qo, rq, dtype, name="q_out")
    assert_close(ko, rk, dtype, name="k_out")
    for name, a, e in zip(("dq", "dk", "dq_weight", "dk_weight"), grads, rgrads):
        slack = REDUCTION_SLACK if "weight" in name else 1.0
        assert a.dtype == (w_dtype if "weight" in name else dtype), name
        assert_close(a, e, dtype, slack=slack, name=name)
    return q, k, qo, ko


CASE = (2, 13, 6, 2, 32, 32, "btd", "view")


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_dtypes(device, dtype, casting):
    q, k, qo, ko = run_case(device, dtype, *CASE, casting=casting)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("case", [
    (2, 13, 5, 1, 16, 16, "td", "contig"),
    (1, 9, 3, 2, 96, 96, "1td", "slice"),
    (2, 7, 4, 3, 32, 24, "btd", "view"),    # partial rotary: norm over all 32 dims, rotate 24
], ids=lambda c: "-".join(map(str, c)))
def test_qk_norm_rope_shapes_layouts(device, case):
    run_case(device, torch.bfloat16 if case[-1] == "slice" else torch.float32, *case)


def test_qk_norm_rope_partial_gemma_fp16(device):
    run_case(device, torch.float16, 2, 7, 4, 3, 32, 16, "td", "view", casting="gemma", eps=1e-5)


def test_qk_norm_rope_fp32_weight_and_cos_with_bf16_q(device):
    # fp32 weight: HF's weight * x.to(bf16) promotes to fp32, so there is no rounding before the rotation.
    run_case(device, torch.bfloat16, *CASE, w_dtype=torch.float32, cos_dtype=torch.float32)


def test_qk_norm_rope_frozen_weights_unsqueeze_2(device):
    run_case(device, torch.float32, 2, 5, 3, 1, 16, 16, "btd", "view", unsqueeze_dim=2, weights_grad=False)


def test_qk_norm_rope_head_loop_path(device):
    # Two heads per tile (of 6 and 3), a persistent backward of 4 programs, dW sums in 8-column, 2-row blocks.
    with launch_override(qk_mod, "fwd", block_hq=2, block_hk=2), \
            launch_override(qk_mod, "bwd", block_hq=2, block_hk=2, programs=4), \
            launch_override(reduce_mod, block_n=8, block_p=2):
        run_case(device, torch.float32, 2, 7, 6, 3, 32, 24, "btd", "view", casting="gemma")


def test_qk_norm_rope_matches_hf_eager_bf16(device):
    B, T, Hq, Hk, D = 2, 13, 6, 2, 32
    cos, sin = make_cos_sin(B, T, D, torch.bfloat16, device)
    q = make_heads(B, T, Hq, D, torch.bfloat16, device, requires_grad=False)
    k = make_heads(B, T, Hk, D, torch.bfloat16, device, requires_grad=False)
    qw = make_weight(D, torch.bfloat16, device, "llama", False)
    kw = make_weight(D, torch.bfloat16, device, "llama", False)
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin)
    rq, rk = qk_norm_rope_reference(q, k, qw, kw, cos, sin)
    assert rq.dtype == torch.bfloat16
    assert_close(qo, rq.to(torch.float64), torch.bfloat16, slack=2, name="q vs HF bf16")
    assert_close(ko, rk.to(torch.float64), torch.bfloat16, slack=2, name="k vs HF bf16")


def test_qk_norm_rope_torch_compile_no_graph_break(device):
    B, T, Hq, Hk, D = 2, 5, 3, 1, 16
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    qw = make_weight(D, torch.float32, device, "llama")
    kw = make_weight(D, torch.float32, device, "llama")

    def f(q, k, qw, kw, cos, sin):
        qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-6)
        return qo * 2.0, ko + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = make_heads(B, T, Hq, D, torch.float32, device)
    k = make_heads(B, T, Hk, D, torch.float32, device)
    leaves = (q, k, qw, kw)
    out_c = compiled(q, k, qw, kw, cos, sin)
    grads_c = torch.autograd.grad(out_c, leaves, (torch.ones_like(out_c[0]), torch.ones_like(out_c[1])))
    out_e = f(q, k, qw, kw, cos, sin)
    grads_e = torch.autograd.grad(out_e, leaves, (torch.ones_like(out_e[0]), torch.ones_like(out_e[1])))
    for a, e in zip(out_c + grads_c, out_e + grads_e):
        torch.testing.assert_close(a, e)


def test_qk_norm_rope_function_direct(device):
    B, T, H, D = 1, 3, 2, 8
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    q = make_heads(B, T, H, D, torch.float32, device)
    w = make_weight(D, torch.float32, device, "llama")
    qo, _ = QKNormRoPEFunction.apply(q, q, w, w, cos, sin, 1e-6, 0.0, False)
    rq, _ = reference64(f64(q), f64(q), f64(w), f64(w), f64(cos), f64(sin), eps=1e-6, offset=0.0,
                        casting="llama", dtype=torch.float32, w_dtype=torch.float32)
    assert_close(qo, rq, torch.float32, name="q")


def test_qk_norm_rope_bad_inputs(device):
    B, T, Hq, Hk, D = 1, 4, 2, 1, 8
    q = torch.randn(B, Hq, T, D, device=device)
    k = torch.randn(B, Hk, T, D, device=device)
    w = torch.ones(D, device=device)
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    bad = [
        ("q", (q[0], k, w, w, cos, sin), {}, ValueError),
        ("k", (q, torch.randn(B, Hk, T, 16, device=device), w, w, cos, sin), {}, ValueError),
        ("k", (q, k.bfloat16(), w, w, cos, sin), {}, TypeError),
        ("q", (torch.randn(B, Hq, T, 2 * D, device=device)[..., ::2], k, w, w, cos, sin), {}, ValueError),
        ("cos", (q, k, w, w, cos[:, :2], sin[:, :2]), {}, ValueError),
        ("cos", (q, k, w, w, cos[..., :3], sin[..., :3]), {}, ValueError),
        ("q_weight", (q, k, torch.ones(D + 1, device=device), w, cos, sin), {}, ValueError),
        ("k_weight", (q, k, w, torch.ones(1, D, device=device), cos, sin), {}, ValueError),
        ("k_weight", (q, k, w, w.half(), cos, sin), {}, TypeError),
        ("k_weight", (q, k, w, torch.ones(2 * D, device=device)[::2], cos, sin), {}, ValueError),
        ("eps", (q, k, w, w, cos, sin), {"eps": 0.0}, ValueError),
        ("eps", (q, k, w, w, cos, sin), {"eps": -1e-6}, ValueError),
        ("offset", (q, k, w, w, cos, sin), {"offset": "1"}, TypeError),
        ("casting", (q, k, w, w, cos, sin), {"casting": "t5"}, ValueError),
        ("unsqueeze_dim", (q, k, w, w, cos, sin), {"unsqueeze_dim": 3}, ValueError),
    ]
    for name, args, kwargs, exc in bad:
        with pytest.raises(exc) as info:
            qk_norm_rope(*args, **kwargs)
        assert name in str(info.value), (name, str(info.value))
