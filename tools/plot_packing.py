"""PNG plots of the packing benchmarks: python tools/plot_packing.py (reads docs/benchmarks/
swift_cli_qwen2_5_{1_5b,7b}_packing.json and attn_lab_h200_tuned.json, writes the .png beside them)."""
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks")


def packing(stem: str, title: str):
    d = json.load(open(os.path.join(DOCS, stem + ".json")))
    names = {"plain": "plain\n(padded)", "swift_liger": "--use_liger\n(padded)",
             "packing_attention_only": "--packing\n(our attention)", "swift_liger_packing": "--use_liger\n--packing"}
    runs = [(names[k], v["summary"]) for k, v in d["runs"].items()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([n for n, _ in runs], [s["tokens_per_s"] for _, s in runs], color="#4c72b0")
    a.set_ylabel("real tokens/s (median)")
    b.bar([n for n, _ in runs], [s["peak_allocated_gib"] for _, s in runs], color="#dd8452")
    b.set_ylabel("peak allocated GiB")
    fig.suptitle(f"swift sft LoRA, {title} shapes, rows of 64-8k tokens (H200)")
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, stem + ".png"), dpi=110)


def attention():
    d = json.load(open(os.path.join(DOCS, "attn_lab_h200_tuned.json")))
    rows = [r for r in d["results"] if "tflops" in r and r["impl"] != "sdpa_efficient"]
    heads = sorted({r["heads"] for r in rows}, key=lambda h: -int(h.split("/")[2]) * 0 + int(h.split("/")[0]))
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), sharey=True)
    for ax, h in zip(axes, heads):
        sub = [r for r in rows if r["heads"] == h]
        ax.bar([f"{r['layout']}\n{r['impl']}" for r in sub], [r["tflops"] for r in sub],
               color=["#55a868" if r["impl"] == "swift_liger" else "#8c8c8c" for r in sub])
        ax.set_title(f"heads {h} (Hq/Hkv/D), 8k tokens")
        ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    axes[0].set_ylabel("useful TFLOP/s, fwd+bwd")
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "attention_packed_h200.png"), dpi=110)


if __name__ == "__main__":
    packing("swift_cli_qwen2_5_1_5b_packing", "Qwen2.5-1.5B")
    packing("swift_cli_qwen2_5_7b_packing", "Qwen2.5-7B")
    attention()
