"""decode_attention (split-KV, GQA) against a float64 softmax reference; Triton interpreter on CPU."""
import pytest
import torch

from helpers import DTYPES, assert_close, inputs_unchanged
from swift_liger.ops.decode_attention_kernel import decode_attention, decode_attention_reference

CASES = [
    # B, Hq, Hkv, C, D
    (1, 4, 2, 37, 16),      # fewer keys than one block
    (2, 8, 2, 300, 24),     # several splits and blocks, head_dim not a power of two
    (3, 3, 3, 70, 8),       # no grouping (G = 1), head_dim below the dot minimum
    (2, 12, 2, 129, 32),    # G = 6 (not a power of two)
]


def make(B, HQ, HKV, C, D, dtype, device, layers=3, layer=1):
    """q as transformers hands it ([B, Hq, 1, D], a transposed view), k/v as views into an all-layer cache."""
    q = torch.randn(B, 1, HQ, D).to(device, dtype).transpose(1, 2)
    k_all = torch.randn(layers, B, HKV, C, D).to(device, dtype)
    v_all = torch.randn(layers, B, HKV, C, D).to(device, dtype)
    return q, k_all[layer], v_all[layer]


def f64_reference(q, k, v, scale):
    return decode_attention_reference(q.double().cpu(), k.double().cpu(), v.double().cpu(), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,HQ,HKV,C,D", CASES)
def test_matches_reference(device, dtype, B, HQ, HKV, C, D):
    q, k, v = make(B, HQ, HKV, C, D, dtype, device)
    scale = D ** -0.5
    with inputs_unchanged(q, k, v):
        out = decode_attention(q, k, v, scale)
    assert out.shape == (B, 1, HQ, D) and out.dtype == dtype
    assert_close(out, f64_reference(q, k, v, scale), dtype, name="decode_attention")


def test_peaky_scores_are_stable(device):
    """Large logits (one key dominates): the running max keeps exp() finite in every split."""
    q, k, v = make(2, 4, 2, 200, 16, torch.float32, device)
    q = q * 40
    out = decode_attention(q, k, v, 1.0)
    assert_close(out, f64_reference(q, k, v, 1.0), torch.float32, slack=10, name="peaky")


def test_bad_inputs(device):
    q, k, v = make(1, 4, 2, 10, 16, torch.float32, device)
    with pytest.raises(ValueError, match="one query token"):
        decode_attention(torch.cat((q, q), 2), k, v, 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q[:, :3], k, v, 0.25)
    with pytest.raises(ValueError, match="k and v"):
        decode_attention(q, k, v[:, :, :5], 0.25)
    with pytest.raises(ValueError, match="scale"):
        decode_attention(q, k, v, 0.0)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        decode_attention(q, k.half(), v.half(), 0.25)


@pytest.mark.parametrize("cfg_index", [1, 2, 5])
def test_every_candidate_config_matches_reference(device, cfg_index):
    """The smaller tiles / shallower pipelines picked on cards with less shared memory (T4, A10, L4; fp32 or
    D=256) give the same result: each candidate forced."""
    import dataclasses

    from swift_liger.ops import decode_attention_kernel as da
    from swift_liger.ops._common import launch_override
    cfg = da.CANDIDATES[cfg_index]
    with launch_override(da, **dataclasses.asdict(cfg)):
        assert da.launch_config(32, 4, device) == cfg
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = make(2, 8, 2, 300, 24, dtype, device)
            out = decode_attention(q, k, v, 24 ** -0.5)
            assert_close(out, f64_reference(q, k, v, 24 ** -0.5), dtype, name=f"decode_attention {cfg}")


def test_split_config_fits_every_architecture():
    """The chosen configuration's estimate fits each target's per-block shared memory; on the H100/H200 16-bit
    inputs keep the default at every head dim (the speed measured there)."""
    from swift_liger.ops import _targets
    from swift_liger.ops import decode_attention_kernel as da
    for arch in _targets.ARCHS.values():
        for block_d in (16, 32, 64, 128, 256):
            for elt in (2, 4):
                cfg = da.split_config(block_d, elt, arch.max_shared)
                assert da.shared_estimate(cfg, block_d, elt) <= arch.max_shared, (arch, block_d, elt, cfg)
    assert all(da.split_config(d, 2, _targets.ARCHS["sm_90"].max_shared) == da.DEFAULT for d in (64, 128, 256))
    assert da.split_config(256, 4, 1) == da.CANDIDATES[-1]   # nothing fits: the smallest


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,HQ,HKV,C,D", CASES)
def test_fused_write_matches_write_then_attend(device, dtype, B, HQ, HKV, C, D):
    """decode_attention_write_unchecked: the new token stored at `slot` (first, last, a split boundary, inside)
    and attended to in the same launch equals writing it and then attending (float64); every other column of the
    cache is untouched and the new token's tensors are unchanged."""
    from swift_liger.ops.decode_attention_kernel import decode_attention_write_unchecked
    scale = D ** -0.5
    for slot in sorted({0, C - 1, C // 2, min(C - 1, 64)}):
        q, k, v = make(B, HQ, HKV, C, D, dtype, device)
        k_new = torch.randn(B, 1, HKV, D).to(device, dtype).transpose(1, 2)   # [B, Hkv, 1, D], a strided view
        v_new = torch.randn(B, HKV, 1, D).to(device, dtype)
        k_want, v_want = k.clone(), v.clone()
        k_want[:, :, slot], v_want[:, :, slot] = k_new[:, :, 0], v_new[:, :, 0]
        with inputs_unchanged(q, k_new, v_new):
            out = decode_attention_write_unchecked(q, k, v, scale, k_new, v_new, slot)
        assert torch.equal(k, k_want) and torch.equal(v, v_want), f"cache after the fused write, slot {slot}"
        assert_close(out, f64_reference(q, k_want, v_want, scale), dtype, name=f"fused write, slot {slot}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,HQ,HKV,C,D", CASES + [(2, 2, 1, 300, 16)])   # the last: 3 splits per row, some empty
def test_lens_match_reference_over_each_rows_prefix(device, dtype, B, HQ, HKV, C, D):
    """lens [B]: row b attends to its first lens[b] keys only (one key, a slice boundary, every key, more than C),
    equal to the float64 softmax over exactly those keys; the keys past them (poisoned here) are never read into
    the output."""
    q, k, v = make(B, HQ, HKV, C, D, dtype, device)
    choices = [1, min(C, 64), C, C + 5, max(1, C // 3), C - 1]
    lens = torch.tensor([choices[(b * 5 + C) % len(choices)] for b in range(B)], device=device)
    for b in range(B):   # everything past a row's length: NaN, which would poison any sum it entered
        k[b, :, min(int(lens[b]), C):] = float("nan")
        v[b, :, min(int(lens[b]), C):] = float("nan")
    scale = D ** -0.5
    k0, v0 = k.clone(), v.clone()
    with inputs_unchanged(q, lens):
        out = decode_attention(q, k, v, scale, lens)
    assert torch.equal(k.nan_to_num(), k0.nan_to_num()) and torch.equal(v.nan_to_num(), v0.nan_to_num())
    assert torch.isfinite(out).all()
    for b in range(B):
        n = min(int(lens[b]), C)
        want = f64_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale)
        assert_close(out[b:b + 1], want, dtype, name=f"decode_attention lens={n} (row {b})")


def test_lens_equal_to_capacity_is_the_full_attention(device):
    q, k, v = make(2, 8, 2, 300, 24, torch.float32, device)
    lens = torch.full((2,), 300, device=device, dtype=torch.int32)
    assert torch.allclose(decode_attention(q, k, v, 0.2, lens), decode_attention(q, k, v, 0.2), atol=1e-6, rtol=0)


def test_bad_lens(device):
    q, k, v = make(2, 4, 2, 10, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"lens must be a \[B\] = \[2\] int32/int64"):
        decode_attention(q, k, v, 0.25, torch.ones(3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="lens must be"):
        decode_attention(q, k, v, 0.25, torch.ones(2, device=device))
    with pytest.raises(TypeError, match="lens must be"):
        decode_attention(q, k, v, 0.25, [3, 4])


def test_lens_on_the_pytorch_reference_backend(monkeypatch):
    """What users without CUDA run (SWIFT_LIGER_BACKEND=torch): each row attends to exactly its first lens[b] keys,
    equal to the float64 softmax over those keys."""
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")
    q, k, v = make(3, 6, 2, 40, 16, torch.float32, "cpu")
    lens = torch.tensor([1, 17, 99])
    out = decode_attention(q, k, v, 0.25, lens)
    for b, n in enumerate((1, 17, 40)):
        want = f64_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], 0.25)
        assert_close(out[b:b + 1], want, torch.float32, name=f"reference lens={n}")
