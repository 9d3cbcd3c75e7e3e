"""swift_liger without ms-swift: patch a model, wrap it with LoRA, train it with a plain transformers Trainer.

    python examples/plain_trainer.py                       # tiny offline model on CPU, ~1 minute
    python examples/plain_trainer.py --model Qwen/Qwen3-0.6B --steps 50   # any supported HF model, GPU if present

Order matters: `swift_liger.apply` goes on the freshly loaded model, before PEFT wraps it (LoRA layers added later
are picked up). `swift_liger.integration.metrics.attach` adds step_time(s), tokens/s and memory to the Trainer's
logs; it needs no ms-swift.
"""
import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

import swift_liger
from swift_liger.integration.metrics import attach
from swift_liger.testing import tiny


def load_rows(path, tokenizer, max_length):
    rows = []
    with open(path) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            rows.append({"input_ids": list(ids)[:max_length]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model id or dir (default: build the tiny offline model)")
    ap.add_argument("--data", default=None, help='JSONL of {"messages": [...]} (default: the tiny SFT set)')
    ap.add_argument("--out", default="runs/plain_trainer")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cross-entropy", default="fused_linear", choices=("fused_linear", "fused", "off"))
    args = ap.parse_args()

    if args.model is None:
        info = tiny.build(os.path.join(args.out, "tiny"))
        args.model, args.data = info["model"], args.data or info["sft"]
    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)

    report = swift_liger.apply(model, cross_entropy=args.cross_entropy)  # 1) patch the loaded model
    print(report)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)  # 2) then wrap it

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                               learning_rate=2e-3, logging_steps=1, report_to=[], save_strategy="no",
                               bf16=cuda, dataloader_num_workers=0),
        train_dataset=load_rows(args.data, tokenizer, 256),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),  # pads; labels = ids, pad -> -100
    )
    attach(trainer)  # 3) optional: step_time(s), tokens/s, peak memory (CUDA) or rss (CPU), MFU in every log line
    trainer.train()
    for row in trainer.state.log_history:
        if "loss" in row:
            print({k: row[k] for k in ("step", "loss", "step_time(s)", "tokens/s") if k in row})
    model.save_pretrained(os.path.join(args.out, "adapter"))  # a plain PEFT adapter: loads into unpatched models


if __name__ == "__main__":
    main()
