"""The per-family end-to-end benchmark runs its whole pipeline on CPU: tiny llama and qwen3, LoRA and full, stock
and patched, both JSON and markdown written, and in fp32 the patched losses track the stock ones."""
import json

from swift_liger.bench import families


def test_families_bench_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_LIGER_BACKEND", "torch")   # reference ops: the pipeline, not the kernels, is tested
    families.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "2", "--seq", "32",
                   "--families", "llama,qwen3", "--out", str(tmp_path)])

    data = json.loads((tmp_path / "families_e2e.json").read_text())
    rows = data["results"]
    assert [(r["family"], r["tuner"]) for r in rows] == [("llama", "lora"), ("llama", "full"),
                                                          ("qwen3", "lora"), ("qwen3", "full")]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["supported"] is True and r["patched"], r
        assert len(r["stock"]["losses"]) == len(r["swift_liger"]["losses"]) == 4   # 2 warm-up + 2 measured
        assert r["first_loss_stock"] > 0 and r["tok_s_stock"] > 0 and r["tok_s_ours"] > 0
        assert r["max_loss_rel_diff"] < 1e-4, r
        assert r["peak_gib_stock"] is None and r["peak_gib_ours"] is None   # no memory numbers on CPU
    assert data["environment"]["command"].startswith("python -m swift_liger.bench.families --tiny")
    assert data["environment"]["peft"]

    md = (tmp_path / "families_e2e.md").read_text()
    assert md.count("\n| llama |") == 2 and md.count("\n| qwen3 |") == 2
