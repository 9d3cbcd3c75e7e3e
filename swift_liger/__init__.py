"""swift_liger: Triton kernels and an ms-swift plugin for faster, leaner LLM fine-tuning.

`swift_liger.ops` holds the kernels; `swift_liger.apply(model, config)` / `swift_liger.revert(model)` patch one
loaded Hugging Face model instance. The names below load on first use, so `import swift_liger` (the ms-swift
start-up hook) imports nothing else.
"""
__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "apply": "patcher", "revert": "patcher", "call_counts": "patcher",
    "LigerConfig": "config",
    "PatchReport": "report",
    "get_report": "patching.state", "is_patched": "patching.state",
    "keep_logits": "fusions.loss_head.handle",
    "quantize_lora_bases": "patching.fp8",
    "ACTIVATIONS": "patching.families", "FAMILIES": "patching.families", "Family": "patching.families",
    "family_for": "patching.families", "register_family": "patching.families",
}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib   # lazy: the package root stays free of torch until a patch-API name is used
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'swift_liger' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
