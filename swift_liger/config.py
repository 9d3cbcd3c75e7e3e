"""LigerConfig: which fusions the patcher applies. Shared by `swift_liger.apply` and the ms-swift plugin."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

CROSS_ENTROPY_MODES = ("fused_linear", "fused", "off")
BACKENDS = ("auto", "triton", "torch")   # SWIFT_LIGER_BACKEND


def backend_from_env() -> str:
    """SWIFT_LIGER_BACKEND, checked: auto (CUDA tensors run Triton, CPU tensors the PyTorch reference), triton or
    torch (the reference everywhere)."""
    value = os.environ.get("SWIFT_LIGER_BACKEND", "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"SWIFT_LIGER_BACKEND must be one of {', '.join(BACKENDS)}; got {value!r}")
    return value
ROLLING_CACHE_MODES = ("absolute", "streaming")
ROLLING_CACHE_KEYS = ("window", "sinks", "mode", "cuda_graph")


def check_rolling_cache(window, sinks=4, mode="absolute", cuda_graph=False, *, where="RollingKVCache") -> dict:
    """RollingKVCache settings, checked: window int >= 1, sinks int >= 0 and < window, mode absolute|streaming,
    cuda_graph bool. Returns them as a dict; errors start with `where`."""
    for name, value, minimum in (("window", window, 1), ("sinks", sinks, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    if sinks >= window:
        raise ValueError(f"{where}: sinks must be < window, got sinks={sinks}, window={window}")
    if mode not in ROLLING_CACHE_MODES:
        raise ValueError(f"{where}: mode must be one of {', '.join(ROLLING_CACHE_MODES)}, got {mode!r}")
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"{where}: cuda_graph must be true or false, got {cuda_graph!r}")
    return {"window": window, "sinks": sinks, "mode": mode, "cuda_graph": cuda_graph}


def closest(name: str, known) -> str:
    """' (did you mean X?)' for the nearest known name (a prefix of one counts), else ''."""
    import difflib
    known = list(known)
    prefixed = [k for k in known if k.startswith(name)]
    match = prefixed if len(prefixed) == 1 else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


@dataclass
class LigerConfig:
    """Switch per fusion.

    rms_norm:      swap every RMSNorm module's forward for the Triton RMSNorm.
    rope:          swap the rotary application (rotate-half) for the one-launch q+k kernel.
    swiglu:        swap the MLP activation (SwiGLU, or GeGLU for Gemma-style MLPs).
    cross_entropy: "fused_linear" (loss from hidden states, logits never materialised, training with labels only),
                   "fused" (Triton CE on materialised logits) or "off".
    qk_norm_rope:  Qwen3-style attention: fuse q_norm/k_norm with the rotation (needs rope=True).
    rolling_cache: {"window": int, "sinks": int} (optional "mode": "absolute"|"streaming", "cuda_graph": bool)
                   installs RollingKVCache for generation; None leaves caches alone.
    compile_layers: torch.compile each decoder layer of this instance (lazily, at its first call). Our ops are
                   custom ops, so a compiled layer keeps them as single nodes and compile fuses the rest; in the
                   8B LoRA loop this gave compile's speed at less memory than Liger-Kernel
                   (docs/benchmarks/e2e_llama3_8b_lora.md). Off by default: the first steps pay the compile time.
    lora_fusion:   in the patched MLPs and attentions (rope on), PEFT LoRA projections in their plain set-up (one
                   adapter, unmerged, vanilla LoRA on an nn.Linear) run through swift_liger.ops.lora_linear, which
                   keeps no fp32 or duplicate copies of their inputs and only a bit mask of the LoRA dropout (same
                   maths, same dropout distribution). `swift sft` Llama-3-8B LoRA at 8k on an H200: 8601 tok/s at
                   18.98 GiB against 7452 tok/s at 20.29 GiB without it (docs/benchmarks/swift_cli_llama3_8b_lora.md).
                   Without autocast (fp32 adapters on a bf16 model, a plain loop) the LoRA branch stays fp32 and
                   is recomputed from x in chunks: −0.87 GiB but 3% slower than Liger-Kernel in that 8B loop.
                   Other set-ups (QLoRA, DoRA, merged adapters, under torch.compile) run PEFT's forward.
    strict:        an unsupported model type is an error instead of a warning.
    """
    rms_norm: bool = True
    rope: bool = True
    swiglu: bool = True
    cross_entropy: str = "fused_linear"
    qk_norm_rope: bool = True
    rolling_cache: Optional[dict] = None
    compile_layers: bool = False
    lora_fusion: bool = True
    strict: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("rms_norm", "rope", "swiglu", "qk_norm_rope", "compile_layers", "lora_fusion", "strict"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"LigerConfig.{name} must be true or false, got {value!r}")
        if self.cross_entropy is False or self.cross_entropy is None:
            self.cross_entropy = "off"
        if self.cross_entropy is True:
            self.cross_entropy = "fused_linear"
        if self.cross_entropy not in CROSS_ENTROPY_MODES:
            raise ValueError(f"LigerConfig.cross_entropy must be one of {', '.join(CROSS_ENTROPY_MODES)}, "
                             f"got {self.cross_entropy!r}")
        if self.rolling_cache is not None:
            rc = self.rolling_cache
            if not isinstance(rc, Mapping) or set(rc) - set(ROLLING_CACHE_KEYS) or "window" not in rc:
                raise ValueError("LigerConfig.rolling_cache must be a mapping with keys window, sinks (and optional "
                                 f"mode, cuda_graph), got {rc!r}")
            check_rolling_cache(**rc, where="LigerConfig.rolling_cache")

    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LigerConfig":
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            hints = "".join(closest(k, cls.field_names()) for k in unknown[:1])
            raise ValueError(f"unknown swift_liger config key(s): {', '.join(unknown)}{hints}; "
                             f"known keys: {', '.join(cls.field_names())}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str) -> "LigerConfig":
        import yaml
        if not os.path.isfile(path):
            raise FileNotFoundError(f"liger_config: no such file {path!r}")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"liger_config {path!r} must hold a mapping of keys, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.field_names()}
