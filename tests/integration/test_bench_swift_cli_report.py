"""swift_liger.bench.swift_cli's report: the tokens/s statistic follows the build's row lengths (rows of one length:
the median measured step; rows of varying length: every measured token over every measured second)."""
from __future__ import annotations

import json

import pytest

from swift_liger.bench import swift_cli


def _result(variant: str, steps: list) -> dict:
    """A run's results as `run` writes them: steps are (tokens, seconds), the first one warm-up."""
    rows = [{"step": i + 1, "loss": 1.0, "tokens/s": n / t, "step_time(s)": t} for i, (n, t) in enumerate(steps)]
    return {"variant": variant, "task": "sft", "tuner": "lora", "wall_s": 1.0, "command": f"swift sft # {variant}",
            "steps": len(steps), "seq": 256, "dtype": "bfloat16", "summary": swift_cli.summarize(rows, 1),
            "rows": rows, "versions": {"torch": "2.13.0"}, "gpu": "cpu", "date": "2026-12-06 00:00 UTC"}


@pytest.mark.parametrize("lengths", ["full", "longtail"])
def test_report_rate_follows_the_row_lengths(tmp_path, lengths):
    runs, build = tmp_path / "runs", tmp_path / "build"
    runs.mkdir()
    build.mkdir()
    # plain: every step 0.4 s; ours: three steps 0.05 s and one 0.4 s (a new batch shape), rows of 100-1000 tokens
    plain = _result("plain", [(500, 1.0), (100, 0.4), (1000, 0.4), (300, 0.4), (200, 0.4)])
    ours = _result("swift_liger", [(500, 3.0), (100, 0.05), (1000, 0.4), (300, 0.05), (200, 0.05)])
    for r in (plain, ours):
        (runs / f"{r['variant']}.json").write_text(json.dumps(r))
    config = {"shape": "qwen2.5-0.5b", "layers": 2, "hidden": 64, "vocab": 256, "seq": 256, "lengths": lengths}
    (build / "build.json").write_text(json.dumps({
        "model": str(build / "model"), "config": config, "params": 1e6,
        "row_tokens": {"min": 100, "max": 1000, "mean": 400.0}}))
    assert swift_cli.main(["report", str(runs), "--out", str(tmp_path), "--name", "r", "--build", str(build)]) == 0
    md, js = (tmp_path / "r.md").read_text(), json.loads((tmp_path / "r.json").read_text())
    if lengths == "longtail":   # 1600 tokens / 1.6 s against 1600 / 0.55 s
        assert "| plain (no kernels) | 1000 | 1.00× |" in md, md
        assert "| 2909 | 2.91× |" in md and "all tokens / all seconds of steps 2–5" in md, md
        assert js["tokens_per_s_statistic"] == "all measured tokens / all measured seconds"
        assert "--lengths longtail" in md   # the build command names them
    else:                       # the median measured step of each run
        med = {r["variant"]: r["summary"]["tokens_per_s"] for r in js["results"]}
        assert f"| plain (no kernels) | {med['plain']:.0f} | 1.00× |" in md, md
        assert f"{med['swift_liger'] / med['plain']:.2f}×" in md and "median over steps 2–5" in md, md
        assert js["tokens_per_s_statistic"] == "median over measured steps"
