"""kv_ring_write / kv_sink_rotate: Triton kernels (interpreter on CPU) vs the PyTorch references and a
slot-by-slot oracle written from the layout definition."""
import pytest
import torch

from helpers import DTYPES, assert_close, inputs_unchanged
from swift_liger.ops.kv_ring_write_kernel import (
    kv_ring_write,
    kv_ring_write_reference,
    kv_sink_rotate,
    kv_sink_rotate_reference,
)

SENTINEL = 7.0   # untouched slots keep it: an exact check that nothing else was written


def oracle(k_cache, v_cache, k, v, pos, end, sinks, window, k_sink=None):
    """Loop form of the layout: token p of a row goes to slot p (sink; also to k_sink when given) or
    sinks + (p - sinks) % window if it is among the row's last `window` tokens; later tokens win."""
    kc, vc = k_cache.clone(), v_cache.clone()
    ks = None if k_sink is None else k_sink.clone()
    B, _, T, _ = k.shape
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            if p < 0:
                continue
            if p < sinks:
                kc[b, :, p] = k[b, :, t]
                vc[b, :, p] = v[b, :, t]
                if ks is not None:
                    ks[b, :, p] = k[b, :, t]
            elif p >= int(end[b]) - window:
                s = sinks + (p - sinks) % window
                kc[b, :, s] = k[b, :, t]
                vc[b, :, s] = v[b, :, t]
    return kc, vc, ks


def make_pos(B, T, n0, pads, device, dtype=torch.int64):
    """Stream indices of T new columns per row: row b starts at n0[b], its first pads[b] columns are padding."""
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        real = T - pads[b]
        pos[b, pads[b]:] = torch.arange(real) + n0[b]
    end = torch.tensor([n0[b] + T - pads[b] for b in range(B)])
    return pos.to(device, dtype), end.to(device, dtype)


CASES = [
    # B, H, D, sinks, window, T, n0 per row, pads per row
    (2, 2, 16, 2, 5, 1, (0, 3), (0, 0)),          # decode into empty / partly filled rows
    (2, 2, 16, 2, 5, 1, (9, 23), (0, 0)),         # decode after several wraps
    (3, 2, 8, 3, 4, 12, (0, 0, 0), (0, 4, 10)),   # prefill longer than the window, left padding, 2-token row
    (2, 3, 24, 0, 6, 9, (4, 11), (2, 0)),         # no sinks, chunk wraps the ring, odd head_dim block
    (1, 1, 96, 4, 8, 37, (2,), (0,)),             # chunk straddles the sinks and wraps ~4 times
    (2, 2, 8, 1, 3, 5, (0, 0), (5, 0)),           # a row that is all padding
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("separate_sinks", [False, True])
def test_write_matches_oracle(device, dtype, case, separate_sinks):
    B, H, D, S, W, T, n0, pads = case
    C = S + W
    k_cache = torch.full((B, H, C, D), SENTINEL, dtype=dtype, device=device)
    v_cache = torch.full((B, H, C, D), SENTINEL, dtype=dtype, device=device)
    k_sink = torch.full((B, H, S, D), SENTINEL, dtype=dtype, device=device) if separate_sinks else None
    # HF layout: keys are the transposed view of a [B, T, H, D] projection.
    k = torch.randn(B, T, H, D).to(device, dtype).transpose(1, 2)
    v = torch.randn(B, T, H, D).to(device, dtype).transpose(1, 2)
    pos, end = make_pos(B, T, n0, pads, device)
    want_k, want_v, want_s = oracle(k_cache, v_cache, k, v, pos, end, S, W, k_sink)
    with inputs_unchanged(k, v, pos, end):
        kv_ring_write(k_cache, v_cache, k, v, pos, end, S, W, k_sink=k_sink)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
    if separate_sinks:
        assert torch.equal(k_sink, want_s)


@pytest.mark.parametrize("case", CASES[:4])
def test_reference_matches_oracle(device, case):
    B, H, D, S, W, T, n0, pads = case
    k_cache = torch.full((B, H, S + W, D), SENTINEL, device=device)
    v_cache = k_cache.clone()
    k = torch.randn(B, H, T, D, device=device)
    v = torch.randn(B, H, T, D, device=device)
    pos, end = make_pos(B, T, n0, pads, device, torch.int32)
    want_k, want_v, _ = oracle(k_cache, v_cache, k, v, pos, end, S, W)
    kv_ring_write_reference(k_cache, v_cache, k, v, pos, end, S, W)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("T,p0", [(1, 0), (1, 3), (1, 40), (11, 0), (5, 17)])
def test_uniform_pos_matches_tensor_pos(device, T, p0, rotate):
    """An int pos (decode fast path) is the same as the explicit index tensors p0 .. p0+T-1."""
    B, H, D, S, W = 2, 3, 16, 2, 5
    k = torch.randn(B, T, H, D, device=device).transpose(1, 2)
    v = torch.randn(B, H, T, D, device=device)
    ks_a = torch.randn(B, H, S, D, device=device)
    ks_b = ks_a.clone()
    angle = float(p0) * torch.rand(1, D // 2, device=device).expand(B, -1)
    rot = dict(sink_cos=angle.cos(), sink_sin=angle.sin()) if rotate else {}
    a = [torch.full((B, H, S + W, D), SENTINEL, device=device) for _ in range(2)]
    b = [t.clone() for t in a]
    kv_ring_write(a[0], a[1], k, v, p0, None, S, W, k_sink=ks_a, **rot)
    pos = (torch.arange(T, device=device) + p0).expand(B, T)
    end = torch.full((B,), p0 + T, device=device)
    start = {"start": torch.full((B,), p0, device=device)} if rotate else {}
    kv_ring_write(b[0], b[1], k, v, pos, end, S, W, k_sink=ks_b, **rot, **start)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(ks_a, ks_b)


def test_write_into_cache_view(device):
    """The cache may be a strided view (e.g. a slice of a bigger buffer); int32 indices."""
    B, H, D, S, W, T = 2, 2, 16, 1, 4, 3
    big = torch.full((B, H + 1, S + W + 2, D), SENTINEL, device=device)
    k_cache = big[:, 1:, 2:]
    v_cache = torch.full((B, H, S + W, D), SENTINEL, device=device)
    k = torch.randn(B, H, T, D, device=device)
    v = torch.randn(B, H, T, D, device=device)
    pos, end = make_pos(B, T, (3, 0), (0, 1), device, torch.int32)
    want_k, want_v, _ = oracle(k_cache, v_cache, k, v, pos, end, S, W)
    kv_ring_write(k_cache, v_cache, k, v, pos, end, S, W)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert (big[:, :1] == SENTINEL).all() and (big[:, :, :2] == SENTINEL).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    # B, H, D, sinks, window, T, n0 per row, pads per row
    (3, 2, 16, 3, 4, 1, (1, 5, 30), (0, 0, 0)),   # decode: row 0 adds its 2nd sink, rows 1, 2 refresh all sinks
    (2, 5, 96, 4, 6, 7, (2, 17), (3, 0)),         # chunk, odd head count and head_dim
    (1, 2, 8, 1, 3, 1, (0,), (0,)),               # very first token: nothing to refresh
])
def test_write_with_sink_refresh(device, dtype, case):
    """The fused streaming step: write, keep pristine sinks, re-rotate sinks stored earlier (slots < start)."""
    B, H, D, S, W, T, n0, pads = case
    C = S + W
    k_cache = torch.full((B, H, C, D), SENTINEL, dtype=dtype, device=device)
    v_cache = k_cache.clone()
    k_sink = torch.randn(B, H, S, D).to(device, dtype)       # sinks stored by earlier steps
    k = torch.randn(B, T, H, D).to(device, dtype).transpose(1, 2)
    v = torch.randn(B, H, T, D).to(device, dtype)
    pos, end = make_pos(B, T, n0, pads, device)
    start = torch.tensor(n0, device=device)
    angle = torch.tensor(n0, device=device).float()[:, None] * torch.rand(D // 2, device=device)
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    want_k, want_v, want_s = oracle(k_cache, v_cache, k, v, pos, end, S, W, k_sink)
    rotated = rotate_f64(k_sink, cos, sin)
    ref_k, ref_v, ref_s = k_cache.clone(), v_cache.clone(), k_sink.clone()
    kv_ring_write_reference(ref_k, ref_v, k, v, pos, end, S, W, ref_s, cos, sin, start)
    with inputs_unchanged(k, v, pos, end, cos, sin, start):
        kv_ring_write(k_cache, v_cache, k, v, pos, end, S, W, k_sink=k_sink, sink_cos=cos, sink_sin=sin, start=start)
    for got_k in (k_cache, ref_k):
        assert torch.equal(v_cache, want_v) and torch.equal(ref_v, want_v)
        assert torch.equal(k_sink, want_s) and torch.equal(ref_s, want_s)
        for b in range(B):
            old = min(n0[b], S)
            assert torch.equal(got_k[b, :, old:], want_k[b, :, old:])
            if old:
                assert_close(got_k[b, :, :old], rotated[b, :, :old], dtype, name="refreshed sinks")


def rotate_f64(src, cos, sin):
    x = src.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[:, None, None, :], sin.double()[:, None, None, :]
    return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,S,D", [(2, 2, 4, 16), (3, 1, 3, 96), (1, 4, 1, 8)])
def test_sink_rotate(device, dtype, B, H, S, D):
    src = torch.randn(B, H, S, D).to(device, dtype)
    cache = torch.full((B, H, S + 5, D), SENTINEL, dtype=dtype, device=device)
    angle = torch.randint(0, 50000, (B,), device=device).float()[:, None] * torch.rand(D // 2, device=device)
    cos, sin = angle.cos(), angle.sin()
    with inputs_unchanged(src, cos, sin):
        kv_sink_rotate(cache[:, :, :S], src, cos, sin)
    assert_close(cache[:, :, :S], rotate_f64(src, cos, sin), dtype, name="sink_rotate")
    assert (cache[:, :, S:] == SENTINEL).all()
    ref = torch.empty_like(src)
    kv_sink_rotate_reference(ref, src, cos, sin)
    assert_close(ref, rotate_f64(src, cos, sin), dtype, name="sink_rotate_reference")


def test_sink_rotate_by_zero_is_exact(device):
    src = torch.randn(2, 2, 3, 16, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    kv_sink_rotate(dst, src, torch.ones(2, 8, device=device), torch.zeros(2, 8, device=device))
    assert torch.equal(dst, src)


def test_bad_arguments(device):
    kc = torch.zeros(2, 2, 6, 8, device=device)
    k = torch.zeros(2, 2, 3, 8, device=device)
    pos = torch.zeros(2, 3, dtype=torch.long, device=device)
    end = torch.ones(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="window"):
        kv_ring_write(kc, kc.clone(), k, k, pos, end, 6, 0)
    with pytest.raises(ValueError, match="sinks"):
        kv_ring_write(kc, kc.clone(), k, k, pos, end, -1, 7)
    with pytest.raises(ValueError, match="sinks \\+ window"):
        kv_ring_write(kc, kc.clone(), k, k, pos, end, 2, 5)
    with pytest.raises(TypeError, match="pos"):
        kv_ring_write(kc, kc.clone(), k, k, pos.float(), end, 2, 4)
    with pytest.raises(ValueError, match="pos"):
        kv_ring_write(kc, kc.clone(), k, k, pos[:, :2], end, 2, 4)
    with pytest.raises(TypeError, match="dtype"):
        kv_ring_write(kc, kc.clone(), k.half(), k.half(), pos, end, 2, 4)
    with pytest.raises(ValueError, match="k and v"):
        kv_ring_write(kc, kc.clone(), k[:, :1], k[:, :1], pos, end, 2, 4)
    with pytest.raises(ValueError, match="k_sink"):
        kv_ring_write(kc, kc.clone(), k, k, pos, end, 2, 4, k_sink=torch.zeros(2, 2, 3, 8, device=device))
    with pytest.raises(ValueError, match="implied"):
        kv_ring_write(kc, kc.clone(), k, k, 3, end, 2, 4)
    with pytest.raises(ValueError, match="go together"):
        kv_ring_write(kc, kc.clone(), k, k, pos, end, 2, 4, sink_cos=torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match="cos"):
        kv_sink_rotate(kc[:, :, :2], kc[:, :, :2], torch.ones(2, 3, device=device), torch.ones(2, 3, device=device))
    with pytest.raises(TypeError, match="cos"):
        kv_sink_rotate(kc[:, :, :2], kc[:, :, :2], torch.ones(2, 4, device=device).double(),
                       torch.ones(2, 4, device=device).double())
