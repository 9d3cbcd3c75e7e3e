"""End-to-end: `swift deploy --infer_backend pt --use_liger --liger_rolling_cache 32,4` (the server `swift app` runs)
on the tiny offline Qwen3, and a scripted multi-turn chat through its OpenAI-compatible HTTP API on localhost, the
client re-sending the whole history every turn, streamed (server-sent events) on odd turns. The probe of
test_swift_infer.py (a sitecustomize.py on the server's PYTHONPATH) records every generate call's cache from outside
swift_liger: each turn must run on a RollingKVCache of the same storage size while the prompt grows far past the
window, and every turn must produce an answer.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from swift_runner import swift_env
from test_swift_infer import MAX_NEW, PROBE, SINKS, TURNS, WINDOW

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url, body, stream):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["message"]["content"]
        text = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0].get("delta") or {}
            text.append(delta.get("content") or "")
        return "".join(text)


def _stop_group(proc) -> None:
    """SIGTERM to the server's process group (the CLI and the server it started); SIGKILL to what is left after
    30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + 30
    while True:
        proc.poll()   # reap the CLI: a zombie would still count as a member of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    proc.wait()


@pytest.fixture(scope="module")
def served_chat(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("swift_deploy")
    probe_dir = root / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    out = root / "calls"
    port = _free_port()
    env = swift_env(SWIFT_LIGER_BACKEND="torch", SWIFT_INFER_PROBE_OUT=str(out),
                    PYTHONPATH=os.pathsep.join(filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "swift.cli.main", "deploy", *tiny_qwen3["swift_flags"], "--infer_backend", "pt",
           "--torch_dtype", "float32", "--max_new_tokens", str(MAX_NEW), "--host", "127.0.0.1", "--port", str(port),
           "--log_interval", "-1", "--use_liger", "--liger_rolling_cache", f"{WINDOW},{SINKS}"]
    log_path = root / "deploy.log"
    with open(log_path, "w") as log:
        # its own process group: `swift deploy` serves from a child process, which terminate() alone would leave running
        proc = subprocess.Popen(cmd, env=env, cwd=str(root), stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            deadline = time.time() + 300
            model = None
            while time.time() < deadline and proc.poll() is None:
                try:
                    model = _get(f"{base}/models")["data"][0]["id"]
                    break
                except (urllib.error.URLError, ConnectionError, OSError, KeyError, IndexError):
                    time.sleep(1)
            assert model is not None, log_path.read_text()[-4000:]
            history, answers = [], []
            for i, turn in enumerate(TURNS):
                history.append({"role": "user", "content": turn})
                body = {"model": model, "messages": history, "max_tokens": MAX_NEW, "temperature": 0,
                        "stream": i % 2 == 1}
                answer = _post(f"{base}/chat/completions", body, stream=body["stream"])
                answers.append(answer)
                history.append({"role": "assistant", "content": answer})
        finally:
            _stop_group(proc)
    rows = []
    for path in glob.glob(f"{out}.*.jsonl"):
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    return log_path.read_text(), answers, rows


def test_deployed_chat_runs_on_a_rolling_cache_of_constant_size(served_chat, tiny_qwen3):
    log, answers, rows = served_chat
    assert "swift_liger: patched the inference model" in log and "rolling_cache" in log, log[-4000:]
    assert len(answers) == len(TURNS) and all(a.strip() for a in answers), answers
    assert len(rows) == len(TURNS), rows
    assert {r["cache"] for r in rows} == {"RollingKVCache"} and all(r["cache_given"] for r in rows), rows
    prompts = [r["prompt_tokens"] for r in rows]
    assert prompts == sorted(prompts) and prompts[-1] > 4 * (WINDOW + SINKS), prompts   # the history grows past it
    spec = tiny_qwen3["spec"]
    fixed = 2 * spec["num_layers"] * spec["num_kv_heads"] * (WINDOW + SINKS) * spec["head_dim"] * 4   # K+V, fp32
    assert [r["nbytes"] for r in rows] == [fixed] * len(TURNS), rows
