"""CompileWatch: Triton's JIT hooks count the kernels built or loaded in the first step, chain the hooks already
installed (their results included: a true jit_cache_hook result makes Triton skip a compile) and restore them.
The interpreter compiles nothing, so the hooks are called here the way JITFunction._call_hook calls them."""
import types

import pytest

from swift_liger.integration import compile_watch

knobs = pytest.importorskip("triton").knobs


def _info(module, name):
    return types.SimpleNamespace(module=module, name=name, jit_function=None)


def _compile(runtime, module, name):
    key = (name, object())
    skip = runtime.jit_cache_hook(key=key, repr=name, fn=_info(module, name), compile={}, is_manual_warmup=False,
                                  already_compiled=False)
    runtime.jit_post_compile_hook(key=key, repr=name, fn=_info(module, name), compile={}, is_manual_warmup=False,
                                  already_compiled=False)
    return skip


def test_counts_chains_and_restores():
    runtime = knobs.runtime
    seen = []

    def prev_before(**kw):
        seen.append(("before", kw["fn"].name))
        return None

    def prev_after(**kw):
        seen.append(("after", kw["fn"].name))

    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = prev_before, prev_after
    try:
        watch = compile_watch.CompileWatch()
        assert watch.start()
        assert not watch.start()   # one installation at a time
        assert not _compile(runtime, "swift_liger.ops.rms_norm_kernel", "_rms_norm_fwd_kernel")
        _compile(runtime, "swift_liger.ops.rms_norm_kernel", "_rms_norm_fwd_kernel")
        _compile(runtime, "torch._inductor.generated", "triton_poi_fused_add_0")
        watch.stop()
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (prev_before, prev_after)
        _compile(runtime, "swift_liger.ops.rope_kernel", "_rope_kernel")   # after stop: not counted
        s = watch.summary()
        assert s["kernels"] == 3 and s["ours"] == 2 and s["seconds"] >= 0
        assert s["by_kernel"] == {"_rms_norm_fwd_kernel": 2, "triton_poi_fused_add_0": 1}
        assert seen.count(("before", "_rms_norm_fwd_kernel")) == 2 and ("after", "_rope_kernel") in seen
        line = compile_watch.describe(s)
        assert line.startswith("Triton built or loaded 3 kernels in the first step (2 of them ours)")
        assert "_rms_norm_fwd_kernel x2" in line
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_a_skipping_hook_keeps_its_result_and_nothing_is_summarized_without_compiles():
    runtime = knobs.runtime
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = (lambda **kw: True), None
    try:
        watch = compile_watch.CompileWatch()
        assert watch.summary() is None and compile_watch.describe(None) is None
        watch.start()
        assert runtime.jit_cache_hook(key=("k",), fn=_info("m", "k")) is True
        assert not watch.started   # a skipped compile gets no post-compile call: its start is not kept
        watch.stop()
        assert runtime.jit_post_compile_hook is None
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
