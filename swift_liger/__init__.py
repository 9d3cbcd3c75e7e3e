"""swift_liger: Triton kernels and an ms-swift plugin for faster, leaner LLM fine-tuning.

`swift_liger.ops` holds the kernels; `swift_liger.apply(model, config)` / `swift_liger.revert(model)` patch one
loaded Hugging Face model instance.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("apply", "revert", "LigerConfig"):
        from . import models
        return getattr(models, name)
    raise AttributeError(f"module 'swift_liger' has no attribute {name!r}")
