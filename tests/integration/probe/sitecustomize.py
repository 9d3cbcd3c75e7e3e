"""Test probe, imported at interpreter start when this directory is on PYTHONPATH (the rlhf CLI tests put it there).

Counts every nn.Linear forward whose output has SWIFT_LIGER_PROBE_VOCAB features, i.e. every [rows, V] logits tensor
an lm_head materialises, independently of swift_liger's own counters, and writes the count and the largest row
count to SWIFT_LIGER_PROBE_OUT.<pid>.json at exit (`swift rlhf` trains in a child process of the CLI launcher).
SWIFT_LIGER_PROBE_MIN_POSITIONS=N counts only heads applied to N or more positions per row ([rows, positions, H]
inputs): GRPO's rollouts sample from one position per row each decode step (generate's logits_to_keep=1), its
training passes score every completion position.
"""
import atexit
import json
import os

_VOCAB = int(os.environ.get("SWIFT_LIGER_PROBE_VOCAB", "0"))
_OUT = os.environ.get("SWIFT_LIGER_PROBE_OUT")
_MIN_POSITIONS = int(os.environ.get("SWIFT_LIGER_PROBE_MIN_POSITIONS", "0"))

if _VOCAB and _OUT:
    import torch

    _seen = {"lm_head_logits": 0, "max_rows": 0}
    _forward = torch.nn.Linear.forward

    def forward(self, x):
        if self.out_features == _VOCAB and (not _MIN_POSITIONS or (x.dim() >= 3 and x.shape[-2] >= _MIN_POSITIONS)):
            _seen["lm_head_logits"] += 1
            _seen["max_rows"] = max(_seen["max_rows"], x.numel() // max(1, x.shape[-1]))
        return _forward(self, x)

    torch.nn.Linear.forward = forward

    @atexit.register
    def _write():
        with open(f"{_OUT}.{os.getpid()}.json", "w") as f:
            json.dump(_seen, f)
