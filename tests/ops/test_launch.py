"""FastLaunch: direct launches of compiled kernels keyed by what Triton specializes on.

On CPU a fake kernel stands in for Triton's JITFunction / CompiledKernel pair (the interpreter compiles nothing);
on the GPU (SWIFT_LIGER_TEST_GPU=1) the real kernels check that a hit launches the very kernel Triton would pick.
"""
import inspect
import os
import types

import pytest
import torch

from swift_liger.ops import _launch, rms_norm_kernel
from swift_liger.ops import rms_norm as rms_norm_op

GPU = torch.cuda.is_available() and not _launch._common.INTERPRET


def test_signature_classes():
    sig = _launch.signature
    assert sig((0,)) == (0,) and sig((1,)) == (1,)
    assert sig((16,)) == ((0, True),) and sig((17,)) == ((0, False),)
    assert sig((1 << 31,)) == ((1, True),) and sig((-(1 << 31),)) == ((0, True),)
    assert sig((1 << 63,)) == ((2, True),)
    assert sig((True,)) == ((bool, True),) and sig((False,)) != sig((True,))
    assert sig((True,)) != sig((1,)) and sig((False,)) != sig((0,))   # Triton: u1 against constexpr 1 / i32
    assert sig((0.5,)) == (float,) and sig((None,)) == (type(None),)
    with pytest.raises(_launch.Unkeyed):
        sig((object(),))
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert sig((base,)) == ((torch.bfloat16, True),)
    assert sig((base[1:],)) == ((torch.bfloat16, False),)      # 2-byte offset: not 16-byte aligned
    assert sig((base[8:],)) == ((torch.bfloat16, True),)
    assert sig((base.float(),)) != sig((base,))


def _native_specialize():
    """The installed Triton's own argument specialization for an NVIDIA target, called the way its binder calls it
    (not constexpr, specialized, alignment checked); it needs no GPU."""
    jit = pytest.importorskip("triton.runtime.jit")
    native = getattr(jit, "native_specialize_impl", None)
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        native = None
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl / CUDA backend to compare with")
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    return lambda a: native(backend, a, False, True, True)


def test_signature_refines_the_installed_tritons_specialization():
    """Calls that share our key get the same specialization from Triton, so they share Triton's compiled kernel
    (our key may split finer: 0/1 and True/False are kept apart)."""
    theirs = _native_specialize()
    base = torch.zeros(256, dtype=torch.bfloat16)
    corpus = [0, 1, 2, 3, 15, 16, 17, 32, 4096, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31),
              -(1 << 31) - 16, 1 << 32, (1 << 63) - 16, -(1 << 63), 1 << 63, (1 << 64) - 16, True, False, 0.0, 0.5,
              -2.5, None, base, base[1:], base[2:], base[8:], base[16:], base.float(), base.float()[3:], base.half(),
              base.to(torch.int32), base.to(torch.int64)[1:], base.to(torch.uint8)[5:], base.bool()]
    by_key = {}
    for arg in corpus:
        key, spec = _launch.signature((arg,)), theirs(arg)
        first = by_key.setdefault(key, (arg, spec))
        assert first[1] == spec, f"{first[0]!r} and {arg!r} share our key {key} but Triton gives {first[1]} / {spec}"


def test_tritons_launch_is_the_call_fastlaunch_replays():
    """For the Triton versions FastLaunch is enabled on, JITFunction.run still ends in the launcher call that
    FastLaunch makes (grid, stream, function, packed metadata, launch metadata, hooks, every bound argument)."""
    import triton
    from triton.runtime.jit import JITFunction
    if _launch._triton_minor() not in _launch.SUPPORTED_TRITON:
        pytest.skip(f"FastLaunch is off on Triton {triton.__version__}")
    source = " ".join(inspect.getsource(JITFunction.run).split())
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())") in source
    assert "bound_args, specialization, options = binder(*args, **kwargs)" in source
    # FastLaunch passes None for the launch metadata and both hooks: the launcher takes them by position (3.7-3.9
    # name them; 3.6 passes them on in *args to a C launcher generated from driver.py) and skips a hook that is None
    from triton.backends.nvidia import driver
    params = list(inspect.signature(driver.CudaLauncher.__call__).parameters)
    named = ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
             "launch_enter_hook", "launch_exit_hook", "args"]
    assert params in (named, named[:6] + ["args"]), params
    c_source = os.path.join(os.path.dirname(driver.__file__), "driver.c" if params == named else "driver.py")
    with open(c_source) as f:
        text = " ".join(f.read().split())
    assert ("if (hook != Py_None) {" in text if params == named else
            "if (launch_enter_hook != Py_None){{" in text and "if(launch_exit_hook != Py_None){{" in text)


def _param(name, constexpr=False, default=inspect.Parameter.empty):
    return types.SimpleNamespace(name=name, is_constexpr=constexpr, default=default)


class FakeCompiled:
    def __init__(self, log):
        self.function, self.packed_metadata = "FUNCTION", "PACKED"
        self.run = lambda *a: log.append(("direct", a))


class FakeKernel:
    """Parameters (x, n, BLOCK: constexpr, FLAG: constexpr = 7); kernel[grid] logs and returns one compiled kernel."""

    def __init__(self):
        self.params = [_param("x"), _param("n"), _param("BLOCK", True), _param("FLAG", True, 7)]
        self.arg_names = [p.name for p in self.params]
        self.pre_run_hooks = []
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return self.compiled
        return run


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(_launch, "_KNOBS", None)
    kernel = FakeKernel()
    fl = _launch.FastLaunch(kernel)
    fl._plain = False      # as with compiled Triton 3.6 / 3.7
    return kernel, fl


def test_second_launch_goes_direct(fast):
    kernel, fl = fast
    x = torch.zeros(32, dtype=torch.bfloat16)
    fl.launch((4,), x, 33, BLOCK=64, num_warps=4)
    assert [e[0] for e in kernel.log] == ["triton"]
    fl.launch((5, 2), x, 35, BLOCK=64, num_warps=4)            # same signature: 33 and 35 are both plain i32
    assert kernel.log[-1] == ("direct", (5, 2, 1, 1234, "FUNCTION", "PACKED", None, None, None, x, 35, 64, 7))
    assert (fl.hits, fl.misses) == (1, 1)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_16", "constexpr", "option"])
def test_new_signature_goes_through_triton(fast, change):
    kernel, fl = fast
    x = torch.zeros(64, dtype=torch.bfloat16)
    fl.launch((1,), x, 33, BLOCK=64, num_warps=4)
    args, meta = [x, 33], dict(BLOCK=64, num_warps=4)
    if change == "misaligned":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.float()
    elif change == "int_one":
        args[1] = 1
    elif change == "int_16":
        args[1] = 48
    elif change == "constexpr":
        meta["BLOCK"] = 128
    else:
        meta["num_warps"] = 8
    fl.launch((1,), *args, **meta)
    assert kernel.log[-1][0] == "triton"
    fl.launch((1,), *args, **meta)
    assert kernel.log[-1][0] == "direct"


def test_hooks_and_keyword_runtime_args_stay_on_triton(fast, monkeypatch):
    kernel, fl = fast
    x = torch.zeros(32)
    fl.launch((1,), x, 3, BLOCK=64)
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]),
                                  launch_exit_hook=types.SimpleNamespace(calls=[]))
    monkeypatch.setattr(_launch, "_KNOBS", hooks)
    fl.launch((1,), x, 3, BLOCK=64)
    assert kernel.log[-1][0] == "triton"                       # a profiler's hook must see the launch
    monkeypatch.setattr(_launch, "_KNOBS", None)
    kernel.pre_run_hooks.append(print)
    fl.launch((1,), x, 3, BLOCK=64)
    assert kernel.log[-1][0] == "triton"
    kernel.pre_run_hooks.clear()
    fl.launch((1,), x, 3, BLOCK=64)
    assert kernel.log[-1][0] == "direct"

    other = _launch.FastLaunch(kernel)
    other._plain = False
    other.launch((1,), x, n=3, BLOCK=64)                       # runtime argument by keyword: never replayed
    other.launch((1,), x, n=3, BLOCK=64)
    assert kernel.log[-1][0] == "triton" and other._plain


def test_interpreter_launches_plainly():
    if _launch._common.INTERPRET:
        assert not _launch.ENABLED
        assert rms_norm_kernel._FWD._plain


@pytest.mark.skipif(not GPU, reason="compiled kernels need CUDA")
def test_hits_launch_the_kernel_triton_picks(monkeypatch):
    """Decode-path ops at aligned and offset views, odd and aligned widths, three calls each: every call after the
    first takes the direct path, gives the first call's bits, and its cached compiled kernel is the very object
    Triton's own binding and cache lookup return (JITFunction.warmup, which compiles or looks up without
    launching)."""
    from swift_liger.ops import apply_rope, decode_attention, kv_ring_write, rms_norm, swiglu
    calls = []
    plain = _launch.FastLaunch.launch

    def recorded(self, grid, *args, **meta):
        calls.append((self, grid, args, meta))
        return plain(self, grid, *args, **meta)

    monkeypatch.setattr(_launch.FastLaunch, "launch", recorded)
    dev, bf = "cuda", torch.bfloat16

    def view(shape, offset):
        n = 1
        for s in shape:
            n *= s
        return torch.randn(n + offset, device=dev, dtype=bf)[offset:].view(shape)

    cases = []
    for rows, H, off in ((1, 4096, 0), (3, 4096, 1), (16, 1000, 0), (5, 17, 3)):
        x, r, w = view((rows, H), off), view((rows, H), 0), torch.randn(H, device=dev, dtype=bf)
        cases.append(lambda x=x, w=w: rms_norm(x, w, 1e-6))
        cases.append(lambda x=x, w=w, r=r: rms_norm(x, w, 1e-6, residual=r))
        cases.append(lambda x=x, r=r: swiglu(x, r))
    for B, T, off in ((1, 1, 0), (2, 1, 1), (1, 7, 0)):
        q, k = view((B, 32, T, 128), off), view((B, 8, T, 128), 0)
        cos, sin = view((B, T, 128), 0), view((B, T, 128), 0)
        cases.append(lambda q=q, k=k, c=cos, s=sin: apply_rope(q, k, c, s))
    for B, C in ((1, 4100), (3, 77)):
        q, kc, vc = view((B, 32, 1, 128), 0), view((B, 8, C, 128), 0), view((B, 8, C, 128), 0)
        cases.append(lambda q=q, kc=kc, vc=vc: decode_attention(q, kc, vc, 0.088))
        kn, vn = view((B, 8, 1, 128), 0), view((B, 8, 1, 128), 0)
        cases.append(lambda kc=kc, vc=vc, kn=kn, vn=vn, C=C: kv_ring_write(kc, vc, kn, vn, C + 13, None, 4, C - 4))
    for case in cases:
        first = case()
        hits = sum(fl.hits for fl in {c[0] for c in calls})
        again = [case() for _ in range(2)]
        assert sum(fl.hits for fl in {c[0] for c in calls}) > hits
        for out in again:
            if isinstance(first, torch.Tensor):
                assert torch.equal(out, first)
    assert calls
    for fl, grid, args, meta in calls:
        mine = fl.compiled(grid, *args, **meta)
        assert mine is not None
        assert mine is fl.kernel.warmup(*args, grid=grid, **meta), fl.kernel.__name__


def test_plain_launches_block(fast):
    kernel, fl = fast
    x = torch.zeros(32)
    fl.launch((1,), x, 3, BLOCK=64)
    with _launch.plain_launches():
        fl.launch((1,), x, 3, BLOCK=64)
        assert kernel.log[-1][0] == "triton"
    fl.launch((1,), x, 3, BLOCK=64)
    assert kernel.log[-1][0] == "direct"


def test_unmodelled_argument_goes_through_triton(fast):
    kernel, fl = fast
    x = torch.zeros(32)
    odd = types.SimpleNamespace()
    for _ in range(2):
        fl.launch((1,), x, odd, BLOCK=64)
        assert kernel.log[-1][0] == "triton"
    assert not fl._cache


def _unspecialized(kernel) -> set:
    """Parameter names a kernel leaves unspecialized (JITFunction, or the interpreter's InterpretedFunction)."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return set(names)


def test_token_counts_are_not_specialized():
    """Arguments that follow the token count of a batch (rows, sequence length, partial rows) are left unspecialized:
    Triton would otherwise compile a kernel again the first time a batch's count changes between a multiple of 16
    and not (padded SFT batches do, step to step). Strides and widths stay specialized: their 16-divisibility sets
    the vector width of the loads."""
    from swift_liger.ops import _reduce, fp8_quant_kernel, qk_norm_rope_kernel, rope_kernel, varlen_attention_kernel
    expected = {
        rms_norm_kernel._rms_norm_fwd_kernel: {"n_rows", "n_inner"},
        rms_norm_kernel._rms_norm_bwd_kernel: {"n_rows", "n_inner"},
        rope_kernel._rope_kernel: {"T"},
        qk_norm_rope_kernel._qk_norm_rope_fwd_kernel: {"T"},
        qk_norm_rope_kernel._qk_norm_rope_bwd_kernel: {"n_tok", "T"},
        fp8_quant_kernel._fp8_quant_rows_kernel: {"N"},
        _reduce._column_sum_kernel: {"P"},
        varlen_attention_kernel._varlen_fwd_kernel: {"T"},
        varlen_attention_kernel._varlen_dq_kernel: {"T"},
        varlen_attention_kernel._varlen_dkdv_kernel: {"T"},
    }
    for kernel, names in expected.items():
        params = inspect.signature(kernel.fn).parameters
        assert names <= set(params), kernel.fn.__name__
        assert names <= _unspecialized(kernel), kernel.fn.__name__
        for name in ("H", "sx_outer", "sx_inner", "stride_x", "K", "N"):   # widths and strides stay specialized
            if name in params and name not in names:
                assert name not in _unspecialized(kernel), (kernel.fn.__name__, name)


@pytest.mark.skipif(not GPU, reason="compiled kernels need CUDA")
def test_row_count_changes_compile_nothing_new():
    """RMSNorm forward and backward and RoPE at 64 rows, then at 63 and 48: one compiled kernel each."""
    from swift_liger.ops import apply_rope, rope_kernel
    dev, bf = "cuda", torch.bfloat16
    kernels = (rms_norm_kernel._rms_norm_fwd_kernel, rms_norm_kernel._rms_norm_bwd_kernel, rope_kernel._rope_kernel)

    def compiled():
        return {k: len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels}

    def step(rows):
        x = torch.randn(rows, 256, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(256, device=dev, dtype=bf, requires_grad=True)
        rms_norm_op(x, w, 1e-6).float().sum().backward()
        q, k = torch.randn(1, 4, rows, 64, device=dev, dtype=bf), torch.randn(1, 2, rows, 64, device=dev, dtype=bf)
        cos, sin = torch.randn(1, rows, 64, device=dev, dtype=bf), torch.randn(1, rows, 64, device=dev, dtype=bf)
        apply_rope(q, k, cos, sin)
        torch.cuda.synchronize()

    step(64)
    before = compiled()
    for rows in (63, 48, 2049):
        step(rows)
    assert compiled() == before


class _Warmups:
    """A kernel that records warm-ups (on which thread) and refuses to launch."""
    pre_run_hooks = []

    def __init__(self, fail_on=None):
        import threading
        self.lock, self.calls, self.fail_on = threading.Lock(), [], fail_on

    def warmup(self, *args, grid, **meta):
        import threading
        import time
        time.sleep(0.02)   # the block's exit must wait for it
        if self.fail_on is not None and args[1] == self.fail_on:
            raise RuntimeError("compile error")
        with self.lock:
            self.calls.append((args[1], grid, meta, threading.get_ident()))

    def __getitem__(self, grid):
        raise AssertionError("a launch inside compile_ahead")


def test_compile_ahead_compiles_once_per_signature_on_the_pool_and_launches_nothing(monkeypatch):
    """Inside compile_ahead: no launch from any thread (autograd's backward runs in its own), one warm-up per call
    site and signature on the pool's threads, all finished when the block ends, a failing compile counted and left
    to the real launch; outside, launches go through as before; nested blocks share the outer one."""
    import threading
    monkeypatch.setattr(_launch._common, "INTERPRET", False)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    kernel = _Warmups(fail_on=33)
    fl = _launch.FastLaunch(kernel)
    t = torch.zeros(64)
    with _launch.compile_ahead(workers=3) as ahead:
        fl.launch((4,), t, 16, BLOCK=32)
        fl.launch((8,), t, 32, BLOCK=32)          # the same signature (16 and 32: multiples of 16): not again
        fl.launch((4,), t, 17, BLOCK=32)          # another one
        fl.launch((4,), t, 16, BLOCK=64)          # another constexpr
        fl.launch((4,), t, 33, BLOCK=256)         # fails to compile: counted, not raised
        other = threading.Thread(target=fl.launch, args=((4,), t, 18), kwargs={"BLOCK": 128})
        other.start()
        other.join()
        with _launch.compile_ahead() as inner:
            assert inner is ahead
    assert _launch._AHEAD is None
    assert sorted((c[0], c[2]["BLOCK"]) for c in kernel.calls) == [(16, 32), (16, 64), (17, 32), (18, 128)]
    assert len(ahead.futures) == 5 and ahead.failed == 1
    assert all(c[3] != threading.get_ident() for c in kernel.calls)
    with pytest.raises(AssertionError, match="a launch inside"):   # outside the block: a real launch again
        fl.launch((4,), t, 16, BLOCK=32)


def test_compile_ahead_is_a_no_op_under_the_interpreter():
    """Nothing compiles under TRITON_INTERPRET=1: the block yields None and launches run as they would."""
    if not _launch._common.INTERPRET:
        pytest.skip("the interpreter is off")
    with _launch.compile_ahead() as ahead:
        assert ahead is None and _launch._AHEAD is None


def test_warm_cache_key_hashes_once_on_a_thread(monkeypatch):
    """warm_cache_key computes Triton's installation key (triton.runtime.cache.triton_key) once per process on a
    daemon thread; under the interpreter it starts nothing."""
    import triton.runtime.cache as cache
    calls = []
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(1) or "key")
    monkeypatch.setattr(_launch, "_KEY_THREAD", None)
    monkeypatch.setattr(_launch._common, "INTERPRET", True)
    assert _launch.warm_cache_key() is None and not calls
    monkeypatch.setattr(_launch._common, "INTERPRET", False)
    thread = _launch.warm_cache_key()
    thread.join(timeout=30)
    assert thread.daemon and not thread.is_alive() and calls == [1]
    assert _launch.warm_cache_key() is thread and calls == [1]


def test_a_fork_waits_for_the_key_thread(monkeypatch):
    """os.fork() runs only after the key thread has finished (a child must not inherit an import lock it holds)."""
    import threading
    import time
    import triton.runtime.cache as cache
    release = threading.Event()
    monkeypatch.setattr(cache, "triton_key", lambda: release.wait(5) and time.sleep(0.2))
    monkeypatch.setattr(_launch, "_KEY_THREAD", None)
    monkeypatch.setattr(_launch._common, "INTERPRET", False)
    thread = _launch.warm_cache_key()
    release.set()
    pid = os.fork()
    if pid == 0:   # the child: exit at once, without pytest's teardown
        os._exit(0)
    alive_at_fork = thread.is_alive()
    os.waitpid(pid, 0)
    assert not alive_at_fork


def test_warm_cache_key_swallows_a_failing_key(monkeypatch):
    import triton.runtime.cache as cache

    def broken():
        raise OSError("libtriton missing")
    monkeypatch.setattr(cache, "triton_key", broken)
    monkeypatch.setattr(_launch, "_KEY_THREAD", None)
    monkeypatch.setattr(_launch._common, "INTERPRET", False)
    thread = _launch.warm_cache_key()
    thread.join(timeout=30)
    assert not thread.is_alive()
