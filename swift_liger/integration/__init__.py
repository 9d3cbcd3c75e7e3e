"""ms-swift plugin: `swift sft/pt/rlhf --use_liger` and per-step speed/memory metrics.

This package is imported from `swift_liger_hook.pth` at every interpreter start, so this file and `hook.py` must
stay import-free (no torch, no swift). The patches live in `swift_patches.py` and load only when ms-swift does.
"""
