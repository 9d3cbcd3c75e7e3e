"""The per-op sweep's grid, order and report (no GPU: `run` needs CUDA, `report` reads the JSON lines it writes)."""
import json

import pytest

from swift_liger.bench import kernels, sweep


def test_grid_is_issue_12s():
    groups = kernels.sweep_groups()
    assert set(groups) == set(sweep.OPS)
    assert len(groups["rms_norm"]) == len(groups["rms_norm_residual"]) == 4 * 7
    assert len(groups["swiglu"]) == len(groups["geglu"]) == 6
    assert len(groups["rope"]) == len(groups["qk_norm_rope"]) == 6 * 3
    assert len(groups["cross_entropy"]) == 5 and len(groups["fused_linear_ce"]) == 10
    # every op's list starts at the shape issue 12 sets a target at
    assert groups["rms_norm"][0][0] == "16384x4096" and groups["swiglu"][0][0] == "16384x14336"
    assert groups["fused_linear_ce"][0][0].startswith("N8192 H4096 V128256 W trainable")
    keys = [(op, k) for op, g in groups.items() for k, _ in g]
    assert len(keys) == len(set(keys))
    # the in-place backward the fusions use is timed beside the out-of-place op (memory parity with Liger)
    for op in ("swiglu", "geglu", "cross_entropy"):
        assert "swift_liger inplace" in groups[op][0][1]().impls, op


def test_order_round_robin_keeps_each_ops_order():
    groups = {"a": [("a1", None), ("a2", None), ("a3", None)], "b": [("b1", None)]}
    assert [k for _, k, _ in sweep.order(groups, ["a", "b"])] == ["a1", "b1", "a2", "a3"]


def _row(op, shape, impl, ms, **kw):
    return {"op": op, "shape": shape, "impl": impl, "ms": ms, "gbps": kw.get("gbps"), "tflops": kw.get("tflops"),
            "peak_extra_gib": kw.get("peak", 0.25), "grad_gib": 0.2, "max_rel_err": 0.0, "error": None,
            "graphed": kw.get("graphed")}


def test_report_ratios_and_files(tmp_path):
    path = tmp_path / "sweep.jsonl"
    rows = [_row("rms_norm", "16384x4096", "eager", 2.0), _row("rms_norm", "16384x4096", "torch.compile", 0.5),
            _row("rms_norm", "16384x4096", "liger", 0.6, peak=0.3),
            _row("rms_norm", "16384x4096", "swift_liger", 0.4, gbps=1500.0),
            _row("rms_norm", "1024x1024", "eager", 0.05), _row("rms_norm", "1024x1024", "liger", 0.02),
            _row("rms_norm", "1024x1024", "swift_liger", 0.03, gbps=100.0),
            _row("fused_linear_ce", "N8192 W frozen", "torch.compile", 30.0, graphed=False),
            _row("fused_linear_ce", "N8192 W frozen", "swift_liger accumulate", 20.0),
            _row("fused_linear_ce", "N8192 W frozen", "swift_liger", 33.0, tflops=500.0),
            _row("swiglu", "16384x14336", "liger", 1.5, peak=0.44),
            _row("swiglu", "16384x14336", "swift_liger inplace", 1.4, peak=0.44),
            _row("swiglu", "16384x14336", "swift_liger", 1.5, peak=1.31)]
    with open(path, "w") as f:
        f.write(json.dumps({"environment": {"gpu": "H200", "command": "python -m swift_liger.bench.sweep run"}}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in rows)
    by = sweep.cases(sweep.load(str(path))[1])
    assert sweep._ratio(by[("rms_norm", "16384x4096")]) == pytest.approx((0.8, "torch.compile"))   # eager excluded
    assert sweep._ratio(by[("rms_norm", "1024x1024")]) == pytest.approx((1.5, "liger"))
    # our own second configuration is not a peer
    assert sweep._ratio(by[("fused_linear_ce", "N8192 W frozen")]) == pytest.approx((1.1, "torch.compile"))

    assert sweep.main(["report", str(path), "--out", str(tmp_path), "--name", "s"]) == 0
    md = (tmp_path / "s.md").read_text()
    assert "| rms_norm | 2 | 1 | 0 | 1.50 (liger, 1024x1024) |" in md
    assert "| 16384x4096 | 2.000 | 0.500 | 0.600 | 0.400 | 0.80 | 1500 GB/s | 0.250 / 0.300 |" in md
    assert "500 TFLOP/s" in md
    assert "| 1.00 | — | 1.310 (0.440) / 0.440 |" in md   # ours / ours in-place / liger; in-place is not a peer
    assert "| N8192 W frozen | 30.000 (eager) |" in md   # a --graphs run that could not capture this peer
    data = json.loads((tmp_path / "s.json").read_text())
    assert len(data["results"]) == len(rows) and data["environment"]["gpu"] == "H200"
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_run_refuses_unknown_ops_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="--ops: unknown"):
        sweep.main(["run", "--out", str(tmp_path / "x"), "--ops", "rms_norm,rmsnorm"])
    assert not (tmp_path / "x").exists()


def _write(path, rows, gpu="H200"):
    with open(path, "w") as f:
        f.write(json.dumps({"environment": {"gpu": gpu, "command": "python -m swift_liger.bench.sweep run"}}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_skip_leaves_out_what_an_earlier_run_measured(tmp_path):
    first = tmp_path / "a.jsonl"
    _write(first, [_row("rms_norm", "16384x4096", "swift_liger", 0.3), _row("swiglu", "16384x14336", "liger", 1.5)])
    todo = sweep.order(kernels.sweep_groups(), list(sweep.OPS))
    left, measured = sweep.remaining(todo, [str(first)])
    assert measured == 2 and len(left) == len(todo) - 2
    assert ("rms_norm", "16384x4096") not in {(op, k) for op, k, _ in left}
    assert [t[:2] for t in left] == [t[:2] for t in todo if t[:2] not in {("rms_norm", "16384x4096"),
                                                                            ("swiglu", "16384x14336")}]
    assert sweep.remaining(todo, [])[1] == 0


def test_run_refuses_a_missing_skip_file_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="--skip: no such file"):
        sweep.main(["run", "--out", str(tmp_path / "x"), "--skip", str(tmp_path / "nope.jsonl")])
    assert not (tmp_path / "x").exists()


def test_report_merges_runs_later_file_wins(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [_row("rms_norm", "1024x1024", "liger", 0.02), _row("rms_norm", "1024x1024", "swift_liger", 0.03),
               _row("rms_norm", "4096x4096", "liger", 0.05), _row("rms_norm", "4096x4096", "swift_liger", 0.04)])
    _write(b, [_row("rms_norm", "1024x1024", "liger", 0.02), _row("rms_norm", "1024x1024", "swift_liger", 0.01),
               _row("swiglu", "16384x14336", "liger", 1.5), _row("swiglu", "16384x14336", "swift_liger", 1.2)],
           gpu="other")
    assert sweep.main(["report", str(a), str(b), "--out", str(tmp_path), "--name", "m"]) == 0
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["environment"]["gpu"] == "H200" and len(data["results"]) == 6
    by = sweep.cases(data["results"])
    assert sweep._ratio(by[("rms_norm", "1024x1024")]) == pytest.approx((0.5, "liger"))   # b's rows replace a's
    assert sweep._ratio(by[("rms_norm", "4096x4096")]) == pytest.approx((0.8, "liger"))
    with pytest.raises(SystemExit, match="no environment line"):
        (tmp_path / "c.jsonl").write_text(json.dumps(_row("rms_norm", "1x1", "liger", 1.0)) + "\n")
        sweep.main(["report", str(tmp_path / "c.jsonl"), "--out", str(tmp_path), "--name", "c"])
