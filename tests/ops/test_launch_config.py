"""Launch-configuration convention: every kernel module's ``launch_config`` returns its frozen dataclass (one of
``LAUNCH_CONFIGS``) at a grid of shapes, on the interpreter and on fake sm_75 / sm_80 / sm_90 targets; and
``_common.launch_override`` forces fields and is undone on exit. Pure selection: no kernel runs."""
import dataclasses
import itertools

import pytest
import torch

from swift_liger.ops import (_common, _reduce as red, _scale as sc, _targets, cross_entropy_kernel as ce,
                             decode_attention_kernel as da, dropout_mask_kernel as dm, fp8_quant_kernel as fq,
                             fp8_transpose_kernel as ft,
                             fused_linear_cross_entropy_kernel as fl, kv_ring_write_kernel as kv,
                             qk_norm_rope_kernel as qk, rms_norm_kernel as rn, rope_kernel as rope,
                             swiglu_kernel as sw)

SMS = {"sm_75": 40, "sm_80": 108, "sm_90": 132}
TARGETS = {arch: _common.Target("cuda", _targets.ARCHS[arch].cc, sms, _targets.ARCHS[arch].max_shared)
           for arch, sms in SMS.items()}
DEVICES = [torch.device("cpu"), *TARGETS.values()]
ROWS = (1, 7, 4096, 131072)
HEADS = ((8, 8), (32, 8), (64, 8), (16, 2))


def _calls():
    """(module, kind, thunk) over the shape grid; thunk(device) -> a configuration."""
    for kind, n, H in itertools.product(("fwd", "bwd"), ROWS, (128, 4096, 65536)):
        yield rn, kind, lambda d, kind=kind, n=n, H=H: rn.launch_config(kind, n, H, d)
    for (HQ, HK), D, n in itertools.product(HEADS, (64, 128, 256), ROWS):
        for half in (D // 2, D // 4):
            yield rope, None, lambda d, a=(HQ, HK, D, half): rope.launch_config(*a, d)
            for kind in ("fwd", "bwd"):
                yield qk, kind, lambda d, kind=kind, a=(n, HQ, HK, D, half): qk.launch_config(kind, *a, d)
    for P, N in itertools.product((1, 7, 132, 528, 1056), (1, 96, 4096, 65536)):
        yield red, None, lambda d, P=P, N=N: red.launch_config(P, N, d)
    for n in (1, 4096, 1 << 30):
        yield sc, None, lambda d, n=n: sc.launch_config(n, d)
    for I, contiguous in itertools.product((1, 4864, 11008, 28672), (True, False)):
        yield sw, None, lambda d, I=I, c=contiguous: sw.launch_config(I, c, d)
    for K in (1, 16, 3584, 18944):
        yield fq, None, lambda d, K=K: fq.launch_config(K, d)
    yield ft, None, lambda d: ft.launch_config(d)
    for V in (1, 1000, 32000, 151936, 256000):
        yield ce, None, lambda d, V=V: ce.launch_config(V, d)
        for kind in ("rows", "slice"):
            yield fl, kind, lambda d, kind=kind, V=V: fl.launch_config(kind, V, d)
    for kind, n, D in itertools.product(("write", "refresh", "rotate"), (1, 16, 4096), (64, 128, 256)):
        yield kv, kind, lambda d, kind=kind, n=n, D=D: kv.launch_config(kind, n, D, d)
    for kind, n in itertools.product(("pack", "scale"), (1, 1 << 30)):
        yield dm, kind, lambda d, kind=kind, n=n: dm.launch_config(kind, n, d)
    for block_d, elt in itertools.product((16, 64, 128, 256), (2, 4)):
        yield da, None, lambda d, b=block_d, e=elt: da.launch_config(b, e, d)


MODULES = (rn, rope, qk, red, sc, sw, ce, fl, kv, dm, da, fq, ft)


def test_every_module_follows_the_convention():
    for mod in MODULES:
        assert callable(mod.launch_config), mod.__name__
        for kind, cls in mod.LAUNCH_CONFIGS.items():
            assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, (mod.__name__, kind)
            assert cls.__doc__, cls


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: "interpreter" if isinstance(d, torch.device) else f"sm{d.cc}")
def test_launch_config_returns_frozen_dataclass(device):
    for mod, kind, call in _calls():
        cfg = call(device)
        assert type(cfg) is mod.LAUNCH_CONFIGS[kind], (mod.__name__, kind, cfg)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.num_warps = 1
        assert cfg.num_warps in (1, 2, 4, 8, 16, 32), cfg
        assert call(device) == cfg   # pure: same answer for the same arguments


def test_selection_per_architecture():
    """Decode attention fits each target's shared memory; qk_norm_rope's backward grid follows the SM count;
    the other modules choose the same configuration on every GPU."""
    for arch, t in TARGETS.items():
        for block_d, elt in itertools.product((64, 128, 256), (2, 4)):
            cfg = da.launch_config(block_d, elt, t)
            assert cfg == da.config_for(t, block_d, elt) == da.split_config(block_d, elt, t.max_shared)
            assert da.shared_estimate(cfg, block_d, elt) <= t.max_shared, (arch, block_d, elt, cfg)
        assert qk.launch_config("bwd", 1 << 20, 32, 8, 128, 64, t).programs == 4 * t.sm_count
    assert da.launch_config(256, 4, TARGETS["sm_75"]) != da.launch_config(256, 4, TARGETS["sm_90"])
    assert da.launch_config(128, 2, TARGETS["sm_90"]) == da.DEFAULT
    assert da.launch_config(256, 4, torch.device("cpu")) == da.DEFAULT   # interpreter: no shared-memory limit
    for mod, kind, call in _calls():
        if mod is not da and not (mod is qk and kind == "bwd"):
            assert call(TARGETS["sm_75"]) == call(TARGETS["sm_80"]) == call(TARGETS["sm_90"]), (mod.__name__, kind)


def test_override_takes_effect_and_is_restored():
    cpu = torch.device("cpu")
    for mod, kind, call in _calls():
        base = call(cpu)
        with _common.launch_override(mod, kind, num_warps=1):
            assert call(cpu) == dataclasses.replace(base, num_warps=1)
        assert call(cpu) == base
    base, fwd = rn.launch_config("bwd", 100, 4096, cpu), rn.launch_config("fwd", 100, 4096, cpu)
    with _common.launch_override(rn, "bwd", block_m=2):
        with _common.launch_override(rn, "bwd", num_warps=8):   # nested: added to the enclosing override
            assert rn.launch_config("bwd", 100, 4096, cpu) == dataclasses.replace(base, block_m=2, num_warps=8)
        assert rn.launch_config("bwd", 100, 4096, cpu) == dataclasses.replace(base, block_m=2)
        assert rn.launch_config("fwd", 100, 4096, cpu) == fwd   # per kind
    assert rn.launch_config("bwd", 100, 4096, cpu) == base
    with pytest.raises(RuntimeError), _common.launch_override(rn, "fwd", num_warps=2):
        raise RuntimeError   # restored on an exception too
    assert rn.launch_config("fwd", 100, 4096, cpu).num_warps == 4
    _common.set_launch_override(sw, block=512)
    try:
        assert sw.launch_config(4864, True, cpu).block == 512
    finally:
        _common.set_launch_override(sw)   # no fields: cleared
    assert sw.launch_config(4864, True, cpu).block == 4096


def test_override_rejects_unknown_kinds_and_fields():
    with pytest.raises(ValueError, match="kinds"):
        _common.set_launch_override(rn, "blocked", num_warps=4)
    with pytest.raises(TypeError, match="no field"):
        _common.set_launch_override(rn, "bwd", block_rows=32)
    with pytest.raises(TypeError, match="LAUNCH_CONFIGS"):
        _common.set_launch_override(_common, num_warps=4)
    assert not _common._OVERRIDES
