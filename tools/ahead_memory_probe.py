"""Where graph_layers' compile-ahead pass leaves memory behind (issue 27; GPU): a Qwen2-shaped model (hidden 1536,
4 layers, random init) under swift_liger with LoRA r16 and reentrant checkpointing, 3 training steps of 4 x 2048 tokens
in bf16 autocast; memory allocated / reserved after each step, then after freeing cuBLAS's workspaces, and what
graph_layers chose (captured graphs' private pools count as reserved).
python3 tools/ahead_memory_probe.py  (runs itself once per SWIFT_LIGER_COMPILE_AHEAD value, each in a process of
its own, and prints one JSON line per run)."""
import json
import os
import subprocess
import sys


def child():
    import torch   # lazy: the child's imports (the parent only starts processes)
    from peft import LoraConfig, get_peft_model   # lazy: as above
    from transformers import Qwen2Config, Qwen2ForCausalLM   # lazy: as above

    import swift_liger   # lazy: as above
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=4, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    swift_liger.apply(model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    gib = 2 ** -30
    rows = []
    for i in range(3):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rows.append({"step": i + 1, "alloc": round(torch.cuda.memory_allocated() * gib, 4),
                     "peak_alloc": round(torch.cuda.max_memory_allocated() * gib, 4),
                     "peak_reserved": round(torch.cuda.max_memory_reserved() * gib, 4)})
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    freed = (before - torch.cuda.memory_allocated()) / 2 ** 20
    graphs = (swift_liger.call_counts(model) or {}).get("graph_layers") or {}
    print(json.dumps({"ahead": os.environ.get("SWIFT_LIGER_COMPILE_AHEAD"), "steps": rows,
                      "cublas_workspaces_freed_mib": round(freed, 1),
                      "graph_layers": {k: graphs.get(k) for k in ("captures", "replays", "eager", "measured")}},
                     default=str), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child()
    else:
        for value in ("0", "1"):
            subprocess.run([sys.executable, __file__, "child"], env=dict(os.environ, SWIFT_LIGER_COMPILE_AHEAD=value),
                           check=False)
