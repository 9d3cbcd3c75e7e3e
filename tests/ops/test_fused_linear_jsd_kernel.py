"""GKD's fused linear generalized JSD: Triton rows (interpreter on CPU) and the PyTorch chunks vs float64, and vs
ms-swift's own gkd_loss on the logits."""

import math

import pytest
import torch

import helpers
from helpers import assert_close, f64, inputs_unchanged, randn
from swift_liger.ops.fused_linear_jsd_kernel import fused_linear_jsd, fused_linear_jsd_reference, fused_linear_jsd_topk
from test_logprobs_op import _Shapes

# Rows and V are not multiples of any block; chunk 4 over ~13 valid rows gives 4 chunks.
B, S, HS, HT, V, CHUNK = 2, 9, 24, 40, 301, 4
SLACK = helpers.REDUCTION_SLACK


def make(device, dtype=torch.float32, bias=False, w_grad=False, seed=0):
    torch.manual_seed(seed)
    hs = randn(B, S, HS, dtype=dtype, device=device, requires_grad=True)
    ws = randn(V, HS, dtype=dtype, device=device, scale=HS ** -0.5 * 2, requires_grad=w_grad)
    bs = randn(V, dtype=dtype, device=device, scale=0.3, requires_grad=w_grad) if bias else None
    ht = randn(B, S, HT, dtype=dtype, device=device)
    wt = randn(V, HT, dtype=dtype, device=device, scale=HT ** -0.5 * 2)
    bt = randn(V, dtype=dtype, device=device, scale=0.3) if bias else None
    labels = torch.randint(0, V, (B, S), device=device)
    labels[0, :4] = -100   # a prompt
    labels[1, -2:] = -100  # padding
    return hs, ws, bs, ht, wt, bt, labels


def divergence(p, q, beta):
    """Per row: KL(q||p), KL(p||q) or beta KL(q||m) + (1-beta) KL(p||m), m = (1-beta) p + beta q."""
    if beta == 0:
        return (q * (q.log() - p.log())).sum(-1)
    if beta == 1:
        return (p * (p.log() - q.log())).sum(-1)
    m = (1 - beta) * p + beta * q
    return beta * (q * (q.log() - m.log())).sum(-1) + (1 - beta) * (p * (p.log() - m.log())).sum(-1)


def float64_jsd(hs, ws, bs, ht, wt, bt, labels, beta, temperature, teacher_labels=None):
    """From the definition, in float64: KL(q||p), KL(p||q) or beta KL(q||m) + (1-beta) KL(p||m)."""
    leaves = [None if t is None else f64(t) for t in (hs, ws, bs)]
    s_mask = labels.cpu().reshape(-1) != -100
    t_mask = s_mask if teacher_labels is None else teacher_labels.cpu().reshape(-1) != -100
    z = leaves[0].reshape(-1, HS)[s_mask] @ leaves[1].t() + (0 if bs is None else leaves[2])
    t = f64(ht, False).reshape(-1, HT)[t_mask] @ f64(wt, False).t() + (0 if bt is None else f64(bt, False))
    p, q = torch.softmax(z / temperature, -1), torch.softmax(t / temperature, -1)
    return divergence(p, q, beta).sum(), leaves


def check(device, dtype, beta, *, bias=False, w_grad=False, temperature=1.0, reduction="sum"):
    hs, ws, bs, ht, wt, bt, labels = make(device, dtype, bias, w_grad)
    with inputs_unchanged(*[t for t in (hs, ws, bs, ht, wt, bt, labels) if t is not None]):
        out = fused_linear_jsd(hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, beta=beta,
                               temperature=temperature, reduction=reduction, chunk_size=CHUNK)
        (out * 1.7).backward()
    ref, leaves = float64_jsd(hs, ws, bs, ht, wt, bt, labels, beta, temperature)
    if reduction == "mean":
        ref = ref / int((labels != -100).sum())
    assert out.dtype == torch.float32 and out.dim() == 0
    assert_close(out, ref, dtype, slack=SLACK, name="loss")
    (ref * 1.7).backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hs, ws, bs), leaves):
        if t is not None and t.requires_grad:
            assert_close(t.grad, r.grad, dtype, slack=1.0 if name == "hidden" else SLACK, name=f"grad_{name}")
    assert bool((hs.grad[labels == -100] == 0).all()), "ignored rows must get a zero gradient"
    return out


@pytest.mark.parametrize("dtype", helpers.DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_float64(device, dtype, beta):
    check(device, dtype, beta, bias=True)


@pytest.mark.parametrize("beta", [0.0, 0.2, 1.0])
def test_trainable_head_and_temperature(device, beta):
    check(device, torch.float32, beta, bias=True, w_grad=True, temperature=0.7)


@pytest.mark.parametrize("beta", [0.0, 0.9, 1.0])
def test_reference_backend(device, monkeypatch, beta):
    """The PyTorch chunks that users without CUDA run (SWIFT_LIGER_BACKEND=torch)."""
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    check(device, torch.float32, beta, bias=True, w_grad=True, temperature=2.0, reduction="mean")


def test_op_reference_matches_float64(device):
    hs, ws, bs, ht, wt, bt, labels = make(device, bias=True)
    for beta in (0.0, 0.3, 1.0):
        got = fused_linear_jsd_reference(hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, beta=beta,
                                         temperature=1.5)
        assert_close(got, float64_jsd(hs, ws, bs, ht, wt, bt, labels, beta, 1.5)[0], torch.float32, slack=SLACK)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_ms_swift_gkd_loss(device, beta):
    """ms-swift 4.6's own loss on the logits (its HF trainer divides its total by the number of valid rows)."""
    gkd = pytest.importorskip("swift.rlhf_trainers.gkd_loss")
    hs, ws, _, ht, wt, _, labels = make(device)
    s_logits = (hs.detach() @ ws.t()).cpu().double()
    t_logits = (ht @ wt.t()).cpu().double()
    total, num_valid = gkd.gkd_loss(s_logits, gkd.TeacherOutput(full_logits=t_logits, labels=labels.cpu()),
                                    labels.cpu(), beta, 1.3)
    ours = fused_linear_jsd(hs, ws, ht, wt, labels, beta=beta, temperature=1.3, reduction="mean")
    assert_close(ours, total / num_valid, torch.float32, slack=SLACK, name="vs ms-swift")


@pytest.mark.parametrize("beta, backend", [(0.0, "triton"), (0.5, "triton"), (1.0, "triton"), (0.5, "torch")])
def test_wider_teacher_vocabulary_as_ms_swift_pads_it(device, monkeypatch, beta, backend):
    """A teacher head padded wider than the student's (Qwen2.5-7B 152064 vs 1.5B 151936): ms-swift fills the
    student's missing columns with the teacher's logits (swift/rlhf_trainers/gkd_loss.py _align_vocab)."""
    gkd = pytest.importorskip("swift.rlhf_trainers.gkd_loss")
    if backend == "torch":
        monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    hs, ws, bs, ht, wt, bt, labels = make(device, bias=True, w_grad=True)
    ws_narrow = ws.detach()[:V - 7].clone().requires_grad_()
    bs_narrow = bs.detach()[:V - 7].clone().requires_grad_()
    out = fused_linear_jsd(hs, ws_narrow, ht, wt, labels, student_bias=bs_narrow, teacher_bias=bt, beta=beta,
                           temperature=1.2, reduction="mean", chunk_size=CHUNK)
    out.backward()
    leaves = [f64(t) for t in (hs, ws_narrow, bs_narrow)]
    s_logits = leaves[0] @ leaves[1].t() + leaves[2]
    t_logits = f64(ht, False) @ f64(wt, False).t() + f64(bt, False)
    total, num_valid = gkd.gkd_loss(s_logits, gkd.TeacherOutput(full_logits=t_logits, labels=labels.cpu()),
                                    labels.cpu(), beta, 1.2)
    ref = total / num_valid
    assert_close(out, ref, torch.float32, slack=SLACK, name="loss")
    ref.backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hs, ws_narrow, bs_narrow), leaves):
        assert_close(t.grad, r.grad, torch.float32, slack=SLACK, name=f"grad_{name}")
    got_ref = fused_linear_jsd_reference(hs.detach(), ws_narrow.detach(), ht, wt, labels, student_bias=bs_narrow,
                                         teacher_bias=bt, beta=beta, temperature=1.2, reduction="mean")
    assert_close(got_ref, ref, torch.float32, slack=SLACK, name="op reference")


def test_teacher_labels_pick_other_rows(device):
    """OPSD: the teacher scored another prompt, so its valid rows sit elsewhere (as many of them)."""
    hs, ws, _, ht, wt, _, labels = make(device)
    t_labels = torch.roll(labels, shifts=3, dims=1)
    out = fused_linear_jsd(hs, ws, ht, wt, labels, teacher_labels=t_labels, beta=0.4, chunk_size=CHUNK)
    out.backward()
    ref, leaves = float64_jsd(hs, ws, None, ht, wt, None, labels, 0.4, 1.0, teacher_labels=t_labels)
    assert_close(out, ref, torch.float32, slack=SLACK)
    ref.backward()
    assert_close(hs.grad, leaves[0].grad, torch.float32)
    with pytest.raises(ValueError, match="teacher_labels mark"):
        fused_linear_jsd(hs, ws, ht, wt, labels, teacher_labels=torch.full_like(labels, 5))


def test_teacher_gets_no_gradient_and_no_valid_row(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    ht.requires_grad_(True)
    wt.requires_grad_(True)
    fused_linear_jsd(hs, ws, ht, wt, labels).backward()
    assert ht.grad is None and wt.grad is None and hs.grad is not None
    hs.grad = None
    out = fused_linear_jsd(hs, ws, ht, wt, torch.full_like(labels, -100), reduction="mean")
    out.backward()
    assert out.item() == 0.0 and bool((hs.grad == 0).all())


def test_no_grad(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    with torch.no_grad():
        out = fused_linear_jsd(hs, ws, ht, wt, labels, beta=0.5)
    assert not out.requires_grad
    assert math.isfinite(float(out)) and float(out) > 0


def test_never_materialises_all_logits(device):
    hs, ws, _, ht, wt, _, labels = make(device, w_grad=True)
    with _Shapes() as seen:
        fused_linear_jsd(hs, ws, ht, wt, labels, chunk_size=CHUNK).backward()
    with_v = [s for s in seen.shapes if len(s) >= 2 and s[-1] == V and s not in ((HS, V), (HT, V))]   # W^T views
    assert with_v and max(s[0] for s in with_v) <= CHUNK, with_v


@pytest.mark.parametrize("kwargs, match", [
    (dict(beta=1.5), "beta must be a number in"), (dict(beta=True), "beta must be"),
    (dict(temperature=0), "temperature must be"), (dict(reduction="none"), "reduction must be one of"),
    (dict(chunk_size=0), "chunk_size must be"),
])
def test_bad_options(device, kwargs, match):
    hs, ws, _, ht, wt, _, labels = make(device)
    with pytest.raises(ValueError, match=match):
        fused_linear_jsd(hs, ws, ht, wt, labels, **kwargs)


def test_bad_tensors(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    with pytest.raises(ValueError, match="vocabulary .* is wider than the teacher's"):
        fused_linear_jsd(hs, ws, ht, wt[:-1], labels)
    with pytest.raises(ValueError, match="does not match student_weight"):
        fused_linear_jsd(hs[..., :-1], ws, ht, wt, labels)
    with pytest.raises(ValueError, match="labels .* must be student_hidden's leading shape"):
        fused_linear_jsd(hs, ws, ht, wt, labels[:, :-1])
    with pytest.raises(ValueError, match="must be an integer tensor"):
        fused_linear_jsd(hs, ws, ht, wt, labels.float())
    with pytest.raises(TypeError, match="mixed dtypes"):
        fused_linear_jsd(hs, ws.double().float().half(), ht, wt, labels)


# ---------------------------------------------------------------------------------------------------------------
# topk: ms-swift's --gkd_logits_topk (the divergence over the teacher's k largest logits per row)
# ---------------------------------------------------------------------------------------------------------------

def float64_topk_jsd(hs, ws, bs, ht, wt, bt, labels, beta, temperature, k):
    """From the definition, in float64: the teacher's k largest logits per row, the student's at the same ids, both
    softmaxes over those k, then the divergence of float64_jsd."""
    leaves = [None if t is None else f64(t) for t in (hs, ws, bs)]
    mask = labels.cpu().reshape(-1) != -100
    z = leaves[0].reshape(-1, HS)[mask] @ leaves[1].t() + (0 if bs is None else leaves[2])
    t = f64(ht, False).reshape(-1, HT)[mask] @ f64(wt, False).t() + (0 if bt is None else f64(bt, False))
    top, ids = t.topk(k, dim=-1)
    p, q = torch.softmax(z.gather(-1, ids) / temperature, -1), torch.softmax(top / temperature, -1)
    return divergence(p, q, beta).sum(), leaves


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [7, 64])
def test_topk_matches_float64(device, beta, k):
    hs, ws, bs, ht, wt, bt, labels = make(device, bias=True, w_grad=True)
    with inputs_unchanged(hs, ws, bs, ht, wt, bt, labels):
        out = fused_linear_jsd(hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, beta=beta,
                               temperature=0.8, chunk_size=CHUNK, topk=k)
        (out * 1.7).backward()
    ref, leaves = float64_topk_jsd(hs, ws, bs, ht, wt, bt, labels, beta, 0.8, k)
    assert float(ref.detach()) > 0.05
    assert_close(out, ref, torch.float32, slack=SLACK, name="loss")
    (ref * 1.7).backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hs, ws, bs), leaves):
        assert_close(t.grad, r.grad, torch.float32, slack=1.0 if name == "hidden" else SLACK, name=f"grad_{name}")
    assert bool((hs.grad[labels == -100] == 0).all())


def test_topk_of_the_whole_vocabulary_is_the_full_divergence(device):
    hs, ws, bs, ht, wt, bt, labels = make(device, bias=True)
    full = fused_linear_jsd(hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, beta=0.3, chunk_size=CHUNK)
    top = fused_linear_jsd(hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, beta=0.3, chunk_size=CHUNK,
                           topk=V)
    assert_close(top, full, torch.float32, slack=SLACK)


def test_topk_gathers_in_sub_chunks(device, monkeypatch):
    """The student's head rows are gathered a few rows at a time (TOPK_GATHER_BYTES): same loss and gradient."""
    from swift_liger.ops import fused_linear_jsd_kernel as mod
    hs, ws, _, ht, wt, _, labels = make(device, w_grad=True)
    out = fused_linear_jsd(hs, ws, ht, wt, labels, beta=0.5, topk=16)
    out.backward()
    grads = hs.grad.clone(), ws.grad.clone()
    hs.grad = ws.grad = None
    monkeypatch.setattr(mod, "TOPK_GATHER_BYTES", 2 * 16 * HS * 4)   # 2 rows per gather
    small = fused_linear_jsd(hs, ws, ht, wt, labels, beta=0.5, topk=16)
    small.backward()
    assert_close(small, out, torch.float32, slack=SLACK)
    assert_close(hs.grad, grads[0], torch.float32)
    assert_close(ws.grad, grads[1], torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_matches_ms_swift(device, beta):
    """ms-swift's own top-k path: TeacherOutput.to_topk on the teacher's logits, the student's gathered (its
    _compute_jsd_loss), divided by the number of valid rows."""
    gkd = pytest.importorskip("swift.rlhf_trainers.gkd_loss")
    hs, ws, _, ht, wt, _, labels = make(device)
    s_logits = (hs.detach() @ ws.t()).cpu().double()
    t_out = gkd.TeacherOutput(full_logits=(ht @ wt.t()).cpu().double(), labels=labels.cpu()).to_topk(9)
    total, num_valid = gkd.gkd_loss(s_logits, t_out, labels.cpu(), beta, 1.3)
    ours = fused_linear_jsd(hs, ws, ht, wt, labels, beta=beta, temperature=1.3, reduction="mean", topk=9)
    ref = fused_linear_jsd_reference(hs, ws, ht, wt, labels, beta=beta, temperature=1.3, reduction="mean", topk=9)
    assert_close(ours, total / num_valid, torch.float32, slack=SLACK, name="vs ms-swift")
    assert_close(ref, total / num_valid, torch.float32, slack=SLACK, name="reference vs ms-swift")


def test_topk_with_a_wider_student_and_refusals(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    wider = torch.cat([ws.detach(), randn(5, HS, device=device)]).requires_grad_()   # ids < V index it as before
    out = fused_linear_jsd(hs, wider, ht, wt, labels, beta=0.5, topk=12)
    out.backward()
    ref, leaves = float64_topk_jsd(hs, ws, None, ht, wt, None, labels, 0.5, 1.0, 12)
    assert_close(out, ref, torch.float32, slack=SLACK)
    assert bool((wider.grad[V:] == 0).all())
    # a teacher head padded wider (Qwen2.5-7B for a 1.5B student): fine while its top-k ids index the student's head
    narrow = ws.detach()[:V - 7].clone().requires_grad_()
    wt_pad = wt.clone()
    wt_pad[V - 7:] = 0   # padded rows: logit 0, below every row's 12 largest
    out = fused_linear_jsd(hs, narrow, ht, wt_pad, labels, beta=0.5, topk=12)
    ref, _ = float64_topk_jsd(hs, narrow.detach(), None, ht, wt_pad, None, labels, 0.5, 1.0, 12)
    assert_close(out, ref, torch.float32, slack=SLACK)
    wt_pad[V - 7:] = wt[:7] * 50   # now they lead: ms-swift's gather would fail, ours says why
    with pytest.raises(ValueError, match="topk: a teacher top-12 id .* is beyond the student's vocabulary"):
        fused_linear_jsd(hs, narrow, ht, wt_pad, labels, topk=12)
    for bad in (0, V + 1, True, 2.0):
        with pytest.raises(ValueError, match="topk must be an int in"):
            fused_linear_jsd(hs, ws, ht, wt, labels, topk=bad)


def test_topk_never_materialises_all_logits(device):
    hs, ws, _, ht, wt, _, labels = make(device, w_grad=True)
    with _Shapes() as seen:
        fused_linear_jsd(hs, ws, ht, wt, labels, chunk_size=CHUNK, topk=5).backward()
    with_v = [s for s in seen.shapes if len(s) >= 2 and s[-1] == V and s not in ((HS, V), (HT, V))]
    assert with_v and max(s[0] for s in with_v) <= CHUNK, with_v


# ---------------------------------------------------------------------------------------------------------------
# fused_linear_jsd_topk: the teacher's top-k given (ms-swift's teacher served by API)
# ---------------------------------------------------------------------------------------------------------------

def api_topk(ht, wt, labels, k, uncovered=()):
    """What ms-swift assembles from a teacher server: its top-k log-probs per position, -inf where not covered."""
    with torch.no_grad():
        top = torch.log_softmax((ht @ wt.t()).float(), -1).topk(k, -1)
    values = top.values.clone()
    for pos in uncovered:
        values[pos] = float("-inf")
    return values, top.indices


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_given_matches_ms_swift(device, beta):
    """ms-swift's own loss and gradient (gkd_loss in top-k mode on the student's float64 logits), with a teacher
    scoring other rows (OPSD) and a scored position it did not cover."""
    gkd = pytest.importorskip("swift.rlhf_trainers.gkd_loss")
    hs, ws, bs, ht, wt, _, labels = make(device, bias=True, w_grad=True)
    t_labels = torch.roll(labels, shifts=2, dims=1)
    covered_gap = tuple(int(i) for i in (t_labels[1] != -100).nonzero()[1])   # a scored teacher row, uncovered
    values, ids = api_topk(ht, wt, t_labels, 10, uncovered=[(1, covered_gap[0])])
    with inputs_unchanged(hs, ws, bs, values, ids, labels, t_labels):
        out = fused_linear_jsd_topk(hs, ws, labels, values, ids, student_bias=bs, teacher_labels=t_labels, beta=beta,
                                    temperature=0.9, reduction="mean")
        out.backward()
    leaves = [f64(t) for t in (hs, ws, bs)]
    s_logits = leaves[0] @ leaves[1].t() + leaves[2]
    teacher = gkd.TeacherOutput(topk_logprobs=values.cpu().double(), topk_indices=ids.cpu(), labels=t_labels.cpu())
    total, num_valid = gkd.gkd_loss(s_logits.cpu(), teacher, labels.cpu(), beta, 0.9)
    assert int(num_valid) == int((labels != -100).sum()) - 1   # the uncovered row left out
    ref = total / num_valid
    assert_close(out, ref, torch.float32, slack=SLACK, name="loss")
    ref.backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hs, ws, bs), leaves):
        assert_close(t.grad, r.grad, torch.float32, slack=1.0 if name == "hidden" else SLACK, name=f"grad_{name}")


def test_topk_given_equals_topk_from_the_teacher_head(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    values, ids = api_topk(ht, wt, labels, 7)
    given = fused_linear_jsd_topk(hs, ws, labels, values, ids, beta=0.3, temperature=1.2)
    computed = fused_linear_jsd(hs, ws, ht, wt, labels, beta=0.3, temperature=1.2, topk=7)
    assert_close(given, computed, torch.float32, slack=SLACK)


def test_topk_given_refusals(device):
    hs, ws, _, ht, wt, _, labels = make(device)
    values, ids = api_topk(ht, wt, labels, 4)
    with pytest.raises(ValueError, match="teacher_topk_ids must index the student's vocabulary"):
        fused_linear_jsd_topk(hs, ws[:V // 4], labels, values, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_linear_jsd_topk(hs, ws, labels, values[:, :-1], ids[:, :-1])
    with pytest.raises(ValueError, match="floating point and teacher_topk_ids integer"):
        fused_linear_jsd_topk(hs, ws, labels, values, ids.float())
    with pytest.raises(ValueError, match="teacher_labels mark"):
        fused_linear_jsd_topk(hs, ws, labels, values, ids, teacher_labels=torch.full_like(labels, 3))
    with pytest.raises(ValueError, match="beta must be"):
        fused_linear_jsd_topk(hs, ws, labels, values, ids, beta=2)
