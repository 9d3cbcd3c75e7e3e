"""Runner for the real `swift` CLI in subprocesses, used by the integration tests (see conftest.py)."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

# Settings shared by every CLI run: fp32 on CPU, one thread (deterministic, kind to shared CI cores).
CPU_FLAGS = ["--torch_dtype", "float32", "--fp16", "false", "--bf16", "false", "--check_model", "false",
             "--gradient_accumulation_steps", "1", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
             "--logging_steps", "1", "--seed", "42"]


def hook_installed() -> bool:
    try:
        import importlib.metadata as md
        files = md.distribution("swift-liger").files or []
        return any(str(f).endswith("swift_liger_hook.pth") for f in files)
    except Exception:
        return False


def swift_env(**extra) -> dict:
    env = dict(os.environ)
    # in-process ms-swift (test_swift_args) setdefaults these in os.environ; a child must pick its own
    for key in ("SWIFT_LIGER_DISABLE_HOOK", "TENSORBOARD_LOGGING_DIR", "SWIFT_CONFIG_FILE"):
        env.pop(key, None)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    for key in ("NO_PROXY", "no_proxy"):   # the API-teacher tests talk to a server on 127.0.0.1: never via a proxy
        env[key] = ",".join(p for p in (env.get(key), "127.0.0.1", "localhost") if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def teardown_abort_only(log: str) -> bool:
    """True when the run's only failure is a rank aborting after ms-swift's `main` returned."""
    end = log.rfind("End time of running main")
    return end >= 0 and "terminate called without an active exception" in log[end:] and "Traceback" not in log[:end]


@dataclass
class SwiftRun:
    cmd: list
    log_path: str
    output_dir: str
    returncode: int = None
    seconds: float = None
    _proc: object = None
    _t0: float = None

    @property
    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait(self, timeout=600):
        if self._proc is not None:
            try:
                self.returncode = self._proc.wait(timeout=timeout)
            finally:
                if self._proc.poll() is None:
                    self._proc.kill()
            self.seconds = time.time() - self._t0
            self._proc = None
        return self

    def check(self, teardown_abort_ok: bool = False):
        """Assert the run exited 0. `teardown_abort_ok`, for gloo torchrun runs: also accept a rank's exit-time
        abort (pytorch/pytorch#179291: ms-swift never calls destroy_process_group) when it came after `main` ended
        with no traceback before it. --use_liger runs destroy the group in an atexit handler
        (swift_patches.destroy_gloo_group_at_exit), which makes the abort rarer but, under CPU load, not absent:
        one FSDP2 run still hit it, so patched and stock runs are judged alike."""
        if self.returncode != 0 and teardown_abort_ok and teardown_abort_only(self.log):
            return self
        assert self.returncode == 0, f"{' '.join(self.cmd[2:])} failed ({self.returncode}):\n{self.log[-6000:]}"
        return self

    @property
    def run_dir(self) -> str:
        """The versioned v*-* dir (args.json, logging.jsonl, liger_patch.json)."""
        dirs = sorted(glob.glob(os.path.join(self.output_dir, "v*-*")))
        assert dirs, f"no v*-* run dir in {self.output_dir}:\n{self.log[-3000:]}"
        return dirs[-1]

    def steps(self):
        from swift_liger.plot import read_steps
        return read_steps(self.run_dir)

    def patch_record(self) -> dict:
        path = os.path.join(self.run_dir, "liger_patch.json")
        assert os.path.exists(path), f"no liger_patch.json in {self.run_dir}"
        with open(path) as f:
            return json.load(f)


def start_swift(subcommand: str, argv: list, output_dir: str, env: dict = None) -> SwiftRun:
    """Start `swift <subcommand> ...` (the real CLI entry point) in the background."""
    os.makedirs(output_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "swift.cli.main", subcommand, *argv, "--output_dir", output_dir]
    if argv and argv[0].endswith((".yaml", ".yml")):  # ms-swift wants the YAML first, flags after
        cmd = [sys.executable, "-m", "swift.cli.main", subcommand, argv[0], *argv[1:], "--output_dir", output_dir]
    run = SwiftRun(cmd=cmd, log_path=output_dir.rstrip("/") + ".log", output_dir=output_dir)
    log = open(run.log_path, "w")
    run._proc = subprocess.Popen(cmd, env=env or swift_env(), stdout=log, stderr=subprocess.STDOUT,
                                 cwd=os.path.dirname(output_dir))
    log.close()
    run._t0 = time.time()
    return run


def run_swift(subcommand, argv, output_dir, env=None, timeout=600) -> SwiftRun:
    return start_swift(subcommand, argv, output_dir, env).wait(timeout)


PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe")


def model_vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def probed(specs: dict, root, vocab: int, min_positions: int = 0) -> dict:
    """{name: (argv, env)} with the logits probe (probe/sitecustomize.py) on in every env, its counts written under
    root; min_positions > 0 counts only heads over that many positions per row (see the probe)."""
    out = {}
    for name, (argv, env) in specs.items():
        env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (PROBE, env.get("PYTHONPATH")) if p),
                   SWIFT_LIGER_PROBE_VOCAB=str(vocab), SWIFT_LIGER_PROBE_OUT=str(root / f"{name}.probe"))
        if min_positions:
            env["SWIFT_LIGER_PROBE_MIN_POSITIONS"] = str(min_positions)
        out[name] = (argv, env)
    return out


def paired_specs(cases: dict, root, vocab: int, min_positions: int = 0) -> dict:
    """{name: (argv, backend)} -> {name_base / name_liger: (argv, env)}: each case unpatched and with --use_liger,
    both with the logits probe on (see probed); backend "torch" runs the patched one on the CPU reference
    (SWIFT_LIGER_BACKEND=torch), "triton" on the real kernels in the interpreter."""
    specs = {}
    for name, (argv, backend) in cases.items():
        for patched in (False, True):
            env = swift_env()
            if patched and backend == "torch":
                env["SWIFT_LIGER_BACKEND"] = "torch"
                env.pop("TRITON_INTERPRET", None)
            specs[f"{name}_{'liger' if patched else 'base'}"] = (argv + (["--use_liger"] if patched else []), env)
    return probed(specs, root, vocab, min_positions)


def run_probed(subcommand: str, specs: dict, root) -> dict:
    """Run {name: (argv, env)} two at a time, in the dict's order; each SwiftRun gets .probe: the processes the probe
    saw and the [rows, V] logits their lm_heads materialised (sum), the most rows at once (max)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(run_swift, subcommand, a, str(root / n), e) for n, (a, e) in specs.items()}
        results = {n: f.result() for n, f in futures.items()}
    for name, run in results.items():   # one probe file per process (the CLI launcher and its training child)
        seen = [json.loads(p.read_text()) for p in root.glob(f"{name}.probe.*.json")]
        run.probe = {"processes": len(seen), "lm_head_logits": sum(s["lm_head_logits"] for s in seen),
                     "max_rows": max((s["max_rows"] for s in seen), default=0)}
    return results


def close(a, b, atol=1e-5, rtol=1e-4) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(b))


def compare_metrics(base: list, liger: list, not_compared: set) -> set:
    """Assert two runs logged the same numeric metrics at every step, equal within `close`, apart from
    `not_compared`; returns the names compared."""
    compared = set()
    for a, b in zip(base, liger):
        keys = {k for k, v in a.items() if isinstance(v, (int, float)) and k not in not_compared}
        assert keys == {k for k, v in b.items() if isinstance(v, (int, float)) and k not in not_compared}, (a, b)
        bad = {k: (a[k], b[k]) for k in keys if not close(a[k], b[k])}
        assert not bad, f"step {a['step']}: {bad}"
        compared |= keys
    return compared
