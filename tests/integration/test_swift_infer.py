"""End-to-end: the real `swift infer --infer_backend pt` CLI on the tiny offline Qwen3, as an interactive multi-turn
streaming chat (the turns are fed on stdin, as a user types them at the `<<<` prompt; ms-swift re-sends the whole
history every turn). Three runs, two at a time: without swift_liger (baseline), `--use_liger` (default preset, no
rolling cache) and `--use_liger --liger_rolling_cache 32,4`, whose window is far smaller than the conversation.

Memory evidence comes from a probe written into a temporary directory put on the child's PYTHONPATH as
sitecustomize.py (the mechanism of tests/integration/probe/): it wraps transformers' GenerationMixin.generate and
records, per generate call, the prompt length and the cache that call ran on (class, bytes held, tokens seen). So the
cache's storage is measured from outside swift_liger, in the process that chats.

The patched runs use the PyTorch reference backend (SWIFT_LIGER_BACKEND=torch) rather than the Triton interpreter
the training CLI tests use: each generated token is a forward pass, and the interpreter would make 7 turns x 24
tokens take minutes; the kernels themselves are covered by the op tests and the sft CLI tests.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from swift_runner import swift_env

pytestmark = pytest.mark.slow

WINDOW, SINKS = 32, 4
MAX_NEW = 24
TURNS = [  # 7 turns: the prompt of the last one carries ~6 x (question + 24-token answer), far past 36 tokens
    "Hello, what is the quick river?",
    "What is 3 plus 4?",
    "Tell me more about the blue stone.",
    "Why is the tiger happy?",
    "What is 12 plus 30?",
    "How does the small model learn?",
    "Say the answer again, slowly.",
]
FLAGS = ["--infer_backend", "pt", "--max_new_tokens", str(MAX_NEW), "--stream", "true", "--torch_dtype", "float32"]

PROBE = textwrap.dedent('''
    """Test probe (tests/integration/test_swift_infer.py): one JSON line per generate call."""
    import json, os, threading
    _OUT = os.environ.get("SWIFT_INFER_PROBE_OUT")
    if _OUT:
        import transformers.generation.utils as _gu
        _orig = _gu.GenerationMixin.generate
        _lock = threading.Lock()

        def _nbytes(cache):
            if cache is None:
                return None
            if hasattr(cache, "nbytes") and type(cache).__name__ == "RollingKVCache":
                return int(cache.nbytes)
            total = 0
            for layer in getattr(cache, "layers", []):
                for name in ("keys", "values", "sink_keys"):
                    t = getattr(layer, name, None)
                    if t is not None and hasattr(t, "numel"):
                        total += t.numel() * t.element_size()
            return total

        def generate(self, *args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            given = kwargs.get("past_key_values")
            out = _orig(self, *args, **kwargs)
            cache = given if given is not None else getattr(out, "past_key_values", None)
            row = {"prompt_tokens": int(ids.shape[-1]) if ids is not None else None,
                   "cache_given": given is not None, "cache": type(cache).__name__, "nbytes": _nbytes(cache),
                   "seen": int(cache.get_seq_length()) if cache is not None else None,
                   "capacity": getattr(cache, "capacity", None)}
            with _lock, open(f"{_OUT}.{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\\n")
            return out

        _gu.GenerationMixin.generate = generate
''')


def probe_env(root, source: str, **extra) -> dict:
    """The child's environment (PyTorch backend) with `source` as a sitecustomize.py on its PYTHONPATH."""
    probe_dir = root / f"probe_{zlib.crc32(source.encode()):08x}"
    probe_dir.mkdir(exist_ok=True)
    path = probe_dir / "sitecustomize.py"
    if not path.exists():   # runs start two at a time: never truncate a file another child may be importing
        tmp = probe_dir / f".sitecustomize.{threading.get_ident()}"
        tmp.write_text(source)
        os.replace(tmp, path)
    return swift_env(SWIFT_LIGER_BACKEND="torch", **extra,
                     PYTHONPATH=os.pathsep.join(filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")])))


def chat(model_info, extra, root, name):
    """`swift infer ... <<< TURNS` (then `exit`); returns (returncode, log, answers, probe rows)."""
    out = root / name
    env = probe_env(root, PROBE, SWIFT_INFER_PROBE_OUT=str(out))
    cmd = [sys.executable, "-m", "swift.cli.main", "infer", *model_info["swift_flags"], *FLAGS, *extra]
    proc = subprocess.run(cmd, input="\n".join(TURNS + ["exit"]) + "\n", env=env, cwd=str(root),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    log = proc.stdout
    (root / f"{name}.log").write_text(log)
    answers = [a.strip() for a in re.findall(r"<<< (.*?)\n-{50}\n", log, flags=re.S)]
    rows = []
    for path in glob.glob(f"{out}.*.jsonl"):
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    return proc.returncode, log, answers, rows


@pytest.fixture(scope="module")
def chats(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("swift_infer")
    specs = {
        "rolling": ["--use_liger", "--liger_rolling_cache", f"{WINDOW},{SINKS}"],
        "base": [],
        "liger": ["--use_liger"],
        "exact": ["--use_liger", "--liger_rolling_cache", "exact"],
    }
    def chat_once_more_if_it_crashed(name, extra):
        # the rare abort at exit (SWIFT_EXIT_ABORT, ms-swift's streaming threads) under a loaded CI machine: one more
        # run; a failure that repeats is reported
        result = chat(tiny_qwen3, extra, root, name)
        if result[0] != 0:
            result = chat(tiny_qwen3, extra, root, name + "_again")
        return result

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(chat_once_more_if_it_crashed, name, extra) for name, extra in specs.items()}
        return {name: f.result() for name, f in futures.items()}


# ms-swift's streaming chat leaves its generate threads unjoined; at interpreter exit that sometimes aborts the
# process ("terminate called without an active exception", rc 250 or -6) after every answer was printed. With
# --use_liger the plugin joins them (swift_patches.py); the unpatched baseline can still hit it.
SWIFT_EXIT_ABORT = "terminate called without an active exception"


def _ok(result, allow_swift_exit_abort=False):
    rc, log, answers, rows = result
    if allow_swift_exit_abort and rc != 0 and SWIFT_EXIT_ABORT in log:
        rc = 0
    assert rc == 0, log[-6000:]
    assert len(answers) == len(TURNS) and all(answers), (answers, log[-3000:])
    if allow_swift_exit_abort:   # unjoined: the last turn's generate thread can die at exit before the probe writes
        assert len(TURNS) - 1 <= len(rows) <= len(TURNS), rows
    else:
        assert len(rows) == len(TURNS), rows
    prompts = [r["prompt_tokens"] for r in rows]
    assert prompts == sorted(prompts) and prompts[-1] > prompts[0] + 5 * MAX_NEW, prompts   # the history grows
    return log, answers, rows


def test_baseline_chat_without_liger(chats):
    log, _, rows = _ok(chats["base"], allow_swift_exit_abort=True)
    assert "swift_liger: patched" not in log
    assert {r["cache"] for r in rows} == {"DynamicCache"} and not any(r["cache_given"] for r in rows)
    sizes = [r["nbytes"] for r in rows]
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[0], sizes   # KV memory grows with the history


def test_liger_chat_without_rolling_cache_matches_baseline(chats):
    log, answers, rows = _ok(chats["liger"])
    report = re.search(r"swift_liger: patched the inference model:\n(.*)", log)
    assert report, log[-3000:]
    assert "rms_norm" in report.group(1) and "rolling_cache" not in report.group(1), report.group(1)
    assert {r["cache"] for r in rows} == {"DynamicCache"}
    assert answers == chats["base"][2]   # greedy, fp32: the patched model answers exactly like the unpatched one


def test_exact_rolling_cache_chat_matches_baseline(chats):
    """--liger_rolling_cache exact: every turn's generate runs on a fresh ring of its prompt + max new tokens, so
    nothing is evicted and the greedy answers equal the unpatched chat's; the ring grows with the history."""
    log, answers, rows = _ok(chats["exact"])
    assert {r["cache"] for r in rows} == {"RollingKVCache"}
    assert answers == chats["base"][2]
    sizes = [r["nbytes"] for r in rows]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0], sizes
    assert "runs on a fresh ring of its prompt + max new tokens" in log


def test_rolling_cache_chat_has_constant_kv_memory(chats, tiny_qwen3):
    log, answers, rows = _ok(chats["rolling"])
    report = re.search(r"swift_liger: patched the inference model:\n(.*)", log)
    assert report and "rolling_cache" in report.group(1), log[-3000:]
    assert f"RollingKVCache(window={WINDOW}, sinks={SINKS}" in log
    # every turn ran on a RollingKVCache that swift_liger installed (ms-swift's engine passes no cache of its own)
    assert {r["cache"] for r in rows} == {"RollingKVCache"}, rows
    assert all(r["cache_given"] and r["capacity"] == WINDOW + SINKS for r in rows), rows
    spec = tiny_qwen3["spec"]
    fixed = 2 * spec["num_layers"] * 1 * spec["num_kv_heads"] * (WINDOW + SINKS) * spec["head_dim"] * 4  # K+V fp32
    assert [r["nbytes"] for r in rows] == [fixed] * len(TURNS), rows   # the same storage size every turn
    assert all(r["seen"] >= r["prompt_tokens"] for r in rows) and rows[-1]["seen"] > 4 * (WINDOW + SINKS), rows
    base_rows = chats["base"][3]
    assert base_rows[-1]["nbytes"] > 4 * fixed, (base_rows[-1], fixed)   # what the unpatched chat held at the end


# ---------------------------------------------------------------------------------------------------------------
# Batched inference: `swift infer --val_dataset ... --max_batch_size 4` pads the prompts (left) into one generate
# ---------------------------------------------------------------------------------------------------------------

LAYOUT_PROBE = textwrap.dedent('''
    """Test probe (tests/integration/test_swift_infer.py): the RollingKVCache plan of every forward, by batch size."""
    import atexit, json, os
    _OUT = os.environ.get("SWIFT_INFER_LAYOUT_OUT")
    if _OUT:
        from swift_liger.cache.ring import RollingKVCache as _Cache
        _seen = {}
        _orig = _Cache._begin_forward

        def _begin_forward(self, batch, T, *args, **kwargs):
            out = _orig(self, batch, T, *args, **kwargs)
            key = f"{self._plan.layout} b{batch}"
            _seen[key] = _seen.get(key, 0) + 1
            return out

        _Cache._begin_forward = _begin_forward
        atexit.register(lambda: _seen and open(f"{_OUT}.{os.getpid()}.json", "w").write(json.dumps(_seen)))
''')


def batch_infer(model_info, root, name, max_batch_size):
    """`swift infer --val_dataset <8 rows> --max_batch_size N` with a 16 + 2 token ring; (responses, plan counts)."""
    out = root / name
    env = probe_env(root, LAYOUT_PROBE, SWIFT_INFER_LAYOUT_OUT=str(out))
    cmd = [sys.executable, "-m", "swift.cli.main", "infer", *model_info["swift_flags"], "--infer_backend", "pt",
           "--val_dataset", f"{model_info['sft']}#8", "--max_batch_size", str(max_batch_size), "--max_new_tokens",
           str(MAX_NEW), "--torch_dtype", "float32", "--use_liger", "--liger_rolling_cache", "16,2",
           "--result_path", str(out) + ".result.jsonl"]
    proc = subprocess.run(cmd, env=env, cwd=str(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    with open(str(out) + ".result.jsonl") as f:
        responses = [json.loads(line)["response"] for line in f]
    seen = {}
    for path in glob.glob(f"{out}.*.json"):
        with open(path) as f:
            seen.update(json.load(f))
    return responses, seen


def test_batched_infer_with_rolling_cache_equals_one_prompt_at_a_time(tiny_qwen3, tmp_path):
    """Left-padded batches of 4 prompts of different lengths: once every row's ring is full, each decode step takes
    the maskless per-row path ("rows"); the greedy answers equal the same prompts generated one at a time (the
    unpadded fast path), so padding changes nothing a row sees."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        batched, single = pool.map(lambda n: batch_infer(tiny_qwen3, tmp_path, f"b{n}", n), (4, 1))
    (b_answers, b_seen), (s_answers, s_seen) = batched, single
    assert len(b_answers) == len(s_answers) == 8 and all(b_answers)
    assert b_answers == s_answers
    assert b_seen.get("rows b4", 0) >= MAX_NEW - 1 and not any(k.endswith("b1") for k in b_seen), b_seen
    assert "rows b1" not in s_seen and s_seen.get("full b1", 0) > 0, s_seen


def test_rolling_cache_note_says_what_the_cache_keeps():
    """The log line for `--liger_rolling_cache model` names the model's own window (no 'None+model tokens', no
    'None sinks'); a "window,sinks" setting without sinks names the default 4."""
    import types
    from swift_liger.cache.install import INSTALL_ATTR
    from swift_liger.integration.swift_patches import _rolling_cache_note
    report = types.SimpleNamespace(patched={"rolling_cache": 1})

    def note(settings):
        model = types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=4096), generation_config=None)
        setattr(model, INSTALL_ATTR, {"settings": settings})
        return _rolling_cache_note(model, report)[1]
    text = note({"window": "model", "sinks": None, "mode": "absolute"})
    assert "None" not in text and "4096" in text and "own sliding window" in text, text
    text = note({"window": 64, "sinks": None, "mode": "streaming"})
    assert "4+64 tokens" in text and "None" not in text, text
    text = note({"window": "exact", "sinks": 0, "mode": "absolute", "cuda_graph": True})
    assert "prompt + max new tokens" in text and "CUDA-graph replay" in text and "0+" not in text, text
