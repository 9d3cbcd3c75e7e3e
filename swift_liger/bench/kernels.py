"""Benchmark cases for every op at the shapes the issues name (H200, bf16).

Peers, in one process: eager PyTorch (our `*_reference`, written the way Hugging Face eager code computes it),
`torch.compile` of that same eager code, Liger-Kernel (when importable) and Apple's Cut Cross-Entropy (loss head).
"""
from __future__ import annotations

import functools
from typing import Dict, List

import torch

from swift_liger.ops import cross_entropy_kernel as ce_ops
from swift_liger.ops import fp8_linear_op as fp8_op
from swift_liger.ops.fp8_linear_op import Fp8Weight, fp8_linear
from swift_liger.ops.lora_linear_op import lora_linear
from swift_liger.ops import fused_linear_cross_entropy_kernel as flce_ops
from swift_liger.ops import logprobs_op as logprobs_ops
from swift_liger.ops import qk_norm_rope_kernel as qk_ops
from swift_liger.ops import rms_norm_kernel as rms_ops
from swift_liger.ops import rope_kernel as rope_ops
from swift_liger.ops import swiglu_kernel as glu_ops

from .harness import Case

BF16 = torch.bfloat16
OURS = "swift_liger"
E = 2  # bytes per bf16 element


def _try_import(path):
    try:
        module, _, name = path.rpartition(".")
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception:
        return None


def _inner(t: torch.Tensor) -> torch.Tensor:
    """A non-leaf view of a benchmark input (no copy, no kernel): what an op inside a model receives."""
    return t.view_as(t)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _peers(eager, ours, liger=None, extra=None) -> Dict[str, callable]:
    impls = {"eager": eager, "torch.compile": lambda inp: _compiled(eager)(inp)}
    if liger is not None:
        impls["liger"] = liger
    impls.update(extra or {})
    impls[OURS] = ours
    return impls


def rms_norm_case(n: int, h: int, residual: bool = False, dtype: torch.dtype = BF16) -> Case:
    """RMSNorm over [n, h] (llama casting), optionally fused with the residual add before it (returns (y, s))."""
    liger_rms = _try_import("liger_kernel.transformers.functional.liger_rms_norm")
    liger_add = _try_import("liger_kernel.transformers.functional.liger_fused_add_rms_norm")

    def make():
        x = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(h, device="cuda", dtype=dtype)).requires_grad_()
        out = {"x": x, "w": w}
        if residual:
            out["r"] = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
        return out
    if residual:
        def eager(i):
            s = i["x"] + i["r"]
            return rms_ops.rms_norm_reference(s, i["w"], 1e-6), s
        ours = lambda i: rms_ops.rms_norm(i["x"], i["w"], 1e-6, residual=i["r"])
        liger = (lambda i: liger_add(i["x"], i["r"], i["w"], 1e-6, casting_mode="llama", in_place=False)) \
            if liger_add else None
        # fwd: read x, r, write y, s; bwd: read dy, ds, s, write dx (= dr, one tensor for both)
        nbytes, grads = 8 * n * h, 2 * n * h
    else:
        eager = lambda i: rms_ops.rms_norm_reference(i["x"], i["w"], 1e-6)
        ours = lambda i: rms_ops.rms_norm(i["x"], i["w"], 1e-6)
        liger = (lambda i: liger_rms(i["x"], i["w"], 1e-6, casting_mode="llama", in_place=False)) if liger_rms else None
        # fwd: read x, write y; bwd: read dy, x, write dx (+ rstd, w, dw negligible)
        nbytes, grads = 5 * n * h, n * h
    e = dtype.itemsize
    return Case("rms_norm_residual" if residual else "rms_norm",
                f"{n}x{h}" + ("" if dtype == BF16 else f" {str(dtype).replace('torch.', '')}"), make,
                _peers(eager, ours, liger), min_bytes=nbytes * e, grad_bytes=(grads + h) * e)


def rms_norm_cases() -> List[Case]:
    return [rms_norm_case(n, h) for n, h in [(16384, 4096), (16384, 8192), (65536, 128)]]


def glu_case(op: str, n: int, i_: int) -> Case:
    """SwiGLU (silu(a) * b) or GeGLU (gelu_tanh(a) * b) over two [n, i_] inputs."""
    liger = _try_import(f"liger_kernel.transformers.functional.liger_{op}")
    reference, fused = getattr(glu_ops, f"{op}_reference"), getattr(glu_ops, op)

    def make():
        return {"a": torch.randn(n, i_, device="cuda", dtype=BF16, requires_grad=True),
                "b": torch.randn(n, i_, device="cuda", dtype=BF16, requires_grad=True)}
    # fwd: read a, b, write c; bwd: read dc, a, b, write da, db. "in-place": d_a / d_b overwrite a / b (Liger's
    # way; what the swiglu fusion does with the MLP's own projections), not a peer. It gets views of the leaves,
    # as the fusion gets projection outputs: handed a leaf itself, autograd copies the gradient it returns into
    # the leaf's .grad (a full extra pass and allocation no MLP pays)
    inplace = {f"{OURS} inplace": lambda i: fused(_inner(i["a"]), _inner(i["b"]), inplace_backward=True)}
    return Case(op, f"{n}x{i_}", make,
                _peers(lambda i: reference(i["a"], i["b"]), lambda i: fused(i["a"], i["b"]),
                       (lambda i: liger(i["a"], i["b"])) if liger else None, inplace),
                min_bytes=8 * n * i_ * E, grad_bytes=2 * n * i_ * E)


def swiglu_cases() -> List[Case]:
    return [glu_case("swiglu", 16384, 14336), glu_case("swiglu", 8192, 11008), glu_case("geglu", 16384, 14336)]


def _rope_inputs(b, t, hq, hkv, d):
    # q/k arrive as transposed views of the [B, T, H, D] projections, exactly as HF attention passes them.
    q = torch.randn(b, t, hq, d, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, t, hkv, d, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    freqs = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)[None].expand(b, t, d)
    return q, k, emb.cos().to(BF16), emb.sin().to(BF16)


def _layout(b, t, hq, hkv, d) -> str:
    return f"B{b} T{t} q{hq}/kv{hkv} D{d}"


def rope_case(b: int, t: int, hq: int, hkv: int, d: int) -> Case:
    """RoPE on q [b, hq, t, d] and k [b, hkv, t, d] (transposed views of the projections), cos/sin [b, t, d]."""
    liger_rope = _try_import("liger_kernel.transformers.functional.liger_rope")

    def make():
        q, k, cos, sin = _rope_inputs(b, t, hq, hkv, d)
        return {"q": q, "k": k, "cos": cos, "sin": sin}
    nbytes = 4 * b * t * (hq + hkv) * d * E + 2 * b * t * d * E
    # "in-place": q/k and their incoming gradients rotated in their own memory (Liger's way), not a peer; views
    # of the leaves stand for the projection outputs an attention layer rotates (see glu_case)
    inplace = {f"{OURS} inplace": lambda i: rope_ops.apply_rope(_inner(i["q"]), _inner(i["k"]), i["cos"], i["sin"],
                                                           inplace=True)}
    return Case("rope", _layout(b, t, hq, hkv, d), make,
                _peers(lambda i: rope_ops.apply_rope_reference(i["q"], i["k"], i["cos"], i["sin"]),
                       lambda i: rope_ops.apply_rope(i["q"], i["k"], i["cos"], i["sin"]),
                       (lambda i: liger_rope(i["q"], i["k"], i["cos"], i["sin"])) if liger_rope else None,
                       inplace),
                min_bytes=nbytes, grad_bytes=b * t * (hq + hkv) * d * E)


def rope_cases() -> List[Case]:
    return [rope_case(1, 16384, 32, 8, 128), rope_case(4, 4096, 32, 8, 128)]


def qk_norm_rope_case(b: int, t: int, hq: int, hkv: int, d: int) -> Case:
    """Per-head RMSNorm of q and k (weights [d]) then RoPE, as Qwen3 attention runs it."""
    liger_rope = _try_import("liger_kernel.transformers.functional.liger_rope")
    liger_rms = _try_import("liger_kernel.transformers.functional.liger_rms_norm")

    def make():
        q, k, cos, sin = _rope_inputs(b, t, hq, hkv, d)
        return {"q": q, "k": k, "cos": cos, "sin": sin,
                "wq": (1 + 0.1 * torch.randn(d, device="cuda", dtype=BF16)).requires_grad_(),
                "wk": (1 + 0.1 * torch.randn(d, device="cuda", dtype=BF16)).requires_grad_()}

    def liger(i):
        qn = liger_rms(i["q"], i["wq"], 1e-6, casting_mode="llama", in_place=False)
        kn = liger_rms(i["k"], i["wk"], 1e-6, casting_mode="llama", in_place=False)
        return liger_rope(qn, kn, i["cos"], i["sin"])
    # fwd reads q,k and writes them; bwd must read the input again (norm) and the grad, and write dx: 5 passes
    nbytes = 5 * b * t * (hq + hkv) * d * E + 2 * b * t * d * E
    return Case("qk_norm_rope", _layout(b, t, hq, hkv, d), make,
                _peers(lambda i: qk_ops.qk_norm_rope_reference(i["q"], i["k"], i["wq"], i["wk"], i["cos"], i["sin"]),
                       lambda i: qk_ops.qk_norm_rope(i["q"], i["k"], i["wq"], i["wk"], i["cos"], i["sin"]),
                       liger if (liger_rope and liger_rms) else None),
                min_bytes=nbytes, grad_bytes=b * t * (hq + hkv) * d * E)


def qk_norm_rope_cases() -> List[Case]:
    return [qk_norm_rope_case(1, 16384, 32, 8, 128)]


def cross_entropy_case(n: int, v: int) -> Case:
    """Mean cross-entropy of bf16 logits [n, v] (every 7th label ignored)."""
    liger_ce = _try_import("liger_kernel.transformers.functional.liger_cross_entropy")

    def make():
        logits = torch.randn(n, v, device="cuda", dtype=BF16).mul_(2).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::7] = -100
        return {"logits": logits, "labels": labels}
    # "in-place": dlogits overwrite the logits (Liger's way), not a peer; a view stands for the lm_head output
    inplace = {f"{OURS} inplace": lambda i: ce_ops.cross_entropy(_inner(i["logits"]), i["labels"],
                                                              inplace_backward=True)}
    return Case("cross_entropy", f"{n}x{v}", make,
                _peers(lambda i: ce_ops.cross_entropy_reference(i["logits"], i["labels"]),
                       lambda i: ce_ops.cross_entropy(i["logits"], i["labels"]),
                       (lambda i: liger_ce(i["logits"], i["labels"])) if liger_ce else None, inplace),
                min_bytes=3 * n * v * E, grad_bytes=n * v * E)


def cross_entropy_cases() -> List[Case]:
    return [cross_entropy_case(8192, 128256)]


def flce_case(n: int, h: int, v: int, train_w: bool, strategies=("accumulate",)) -> Case:
    """Linear + cross-entropy from hidden states [n, h] and a head [v, h], frozen or trainable; with a trainable
    head, our op also runs with each dW strategy in `strategies` ("swift_liger <strategy>", not a peer)."""
    liger_flce = _try_import("liger_kernel.transformers.functional.liger_fused_linear_cross_entropy")
    cce = _try_import("cut_cross_entropy.linear_cross_entropy")

    def make():
        hid = (torch.randn(n, h, device="cuda", dtype=BF16) * 0.5).requires_grad_()
        w = (torch.randn(v, h, device="cuda", dtype=BF16) * 0.02).requires_grad_(train_w)
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::9] = -100
        return {"h": hid, "w": w, "labels": labels}
    extra = {}
    for strategy in strategies if train_w else ():
        extra[f"{OURS} {strategy}"] = lambda i, st=strategy: flce_ops.fused_linear_cross_entropy(
            i["h"], i["w"], i["labels"], dw_strategy=st)
    if cce is not None:
        extra["cce"] = lambda i: cce(i["h"], i["w"], i["labels"])
    gemms = 3 if train_w else 2
    return Case("fused_linear_ce", f"N{n} H{h} V{v} W {'trainable' if train_w else 'frozen'}", make,
                _peers(lambda i: flce_ops.fused_linear_cross_entropy_reference(i["h"], i["w"], i["labels"]),
                       lambda i: flce_ops.fused_linear_cross_entropy(i["h"], i["w"], i["labels"]),
                       (lambda i: liger_flce(i["h"], i["w"], i["labels"])) if liger_flce else None, extra),
                min_flops=gemms * 2 * n * h * v, grad_bytes=(n * h + (v * h if train_w else 0)) * E)


def flce_cases() -> List[Case]:
    return [flce_case(8192, 4096, 128256, True), flce_case(8192, 4096, 128256, False),
            flce_case(32768, 4096, 128256, True)]


def logprobs_cases() -> List[Case]:
    """Per-token log p of the labels from hidden states (a DPO pair: [2, T, H]), W frozen (LoRA) and trainable.
    eager = lm_head logits in bf16, then trl's selective_log_softmax on them (its per-row bf16 path; inside ms-swift
    the trainer gets accelerate's fp32 copy of the logits and takes the fp32 path, with more memory);
    torch.compile = our fp32 reference (logits.float(), log_softmax, gather) compiled."""
    selective = _try_import("trl.trainer.utils.selective_log_softmax")
    cases = []
    for (h, v), train_w in [((3584, 152064), False), ((3584, 152064), True), ((4096, 128256), False)]:
        b, t = 2, 4096

        def make(h=h, v=v, train_w=train_w):
            hid = (torch.randn(b, t, h, device="cuda", dtype=BF16) * 0.5).requires_grad_()
            w = (torch.randn(v, h, device="cuda", dtype=BF16) * 0.02).requires_grad_(train_w)
            labels = torch.randint(0, v, (b, t), device="cuda")
            labels[:, : t // 4] = -100   # the prompt
            return {"h": hid, "w": w, "labels": labels}

        def stock(i):
            logits = torch.nn.functional.linear(i["h"], i["w"])
            mask = i["labels"] != -100
            logps = selective(logits, i["labels"].clamp_min(0))
            return torch.where(mask, logps.float(), 0.0)   # fp32 like ours: the peers share output grads

        reference = lambda i: logprobs_ops.fused_linear_logprobs_reference(i["h"], i["w"], i["labels"])
        impls = {"eager": stock if selective is not None else reference,
                 "torch.compile": lambda i, f=reference: _compiled(f)(i),
                 "swift_liger": lambda i: logprobs_ops.fused_linear_logprobs(i["h"], i["w"], i["labels"])}
        n = b * t
        cases.append(Case("logprobs", f"2x{t} H{h} V{v} W {'trainable' if train_w else 'frozen'}", make, impls,
                          min_flops=(3 if train_w else 2) * 2 * n * h * v,
                          grad_bytes=(n * h + (v * h if train_w else 0)) * E))
    return cases


def grpo_logprobs_cases() -> List[Case]:
    """GRPO's pass over the completions: per-token log p at the sampling temperature plus the entropies the trainer
    asks for with --log_entropy / --top_entropy_quantile, W frozen (LoRA). eager = ms-swift's
    _get_logps_via_local_forward: the logits as the trainer sees them (accelerate's fp32 copy), div_(temperature),
    trl's selective_log_softmax and entropy_from_logits (row by row); torch.compile = our fp32 reference compiled;
    swift_liger = fused_linear_logprobs(return_entropy=True). Outputs: log p (differentiated) and entropy (compared)."""
    selective = _try_import("trl.trainer.utils.selective_log_softmax")
    entropy_from_logits = _try_import("trl.trainer.utils.entropy_from_logits")
    temp = 0.9
    cases = []
    for (h, v), (b, t) in [((1536, 151936), (8, 2048)), ((3584, 152064), (8, 2048))]:

        def make(h=h, v=v, b=b, t=t):
            hid = (torch.randn(b, t, h, device="cuda", dtype=BF16) * 0.5).requires_grad_()
            w = torch.randn(v, h, device="cuda", dtype=BF16) * 0.02
            return {"h": hid, "w": w, "labels": torch.randint(0, v, (b, t), device="cuda")}

        def stock(i):
            logits = torch.nn.functional.linear(i["h"], i["w"]).float()
            logits.div_(temp)
            logps = selective(logits, i["labels"])
            with torch.no_grad():   # ms-swift keeps its graph alive until the loss is formed, never backpropagates it
                ent = entropy_from_logits(logits)
            return logps, ent

        def reference(i):
            out = logprobs_ops.fused_linear_logprobs_reference(i["h"], i["w"], i["labels"], temperature=temp,
                                                               return_entropy=True)
            return out.logps, out.entropy

        def ours(i):
            out = logprobs_ops.fused_linear_logprobs(i["h"], i["w"], i["labels"], temperature=temp,
                                                     return_entropy=True)
            return out.logps, out.entropy

        impls = {"eager": stock if selective is not None and entropy_from_logits is not None else reference,
                 "torch.compile": lambda i, f=reference: _compiled(f)(i), "swift_liger": ours}
        n = b * t
        cases.append(Case("grpo_logprobs", f"{b}x{t} H{h} V{v} T{temp} +entropy", make, impls,
                          min_flops=2 * 2 * n * h * v, grad_bytes=n * h * E))
    return cases


class _Fp8TorchQuant(torch.autograd.Function):
    """fp8_linear with its operands quantized by torch ops (quantize_rows_torch) instead of the Triton kernel: what
    the kernel saves, measured."""

    @staticmethod
    def forward(ctx, x, w8):
        ctx.w8 = w8
        xq, sx = fp8_op.quantize_rows_torch(x)
        return fp8_op._scaled_mm(xq, w8.q.t(), sx, w8.scale.view(1, -1), x.dtype)

    @staticmethod
    def backward(ctx, g):
        w8 = ctx.w8
        gq, sg = fp8_op.quantize_rows_torch(g, fold=w8.scale)
        return fp8_op._scaled_mm(gq, w8.q.t().contiguous().t(), sg, w8.ones, g.dtype), None


def fp8_linear_case(n: int, k: int, out: int, r: int = 16) -> Case:
    """A frozen projection x [n, k] @ W[out, k]^T, forward and input gradient: bf16 F.linear (eager, compiled) vs
    ops.fp8_linear on an FP8 copy of W (and the same with torch-op quantization); and the LoRA projection (rank r)
    over either base ("lora bf16" / "lora fp8", not peers: the adapters add their rank-r GEMMs and weight
    gradients). Predicted at N8192 K3584 O18944 (2.2 TFLOP fwd+dx): bf16 ~3.2 ms at 700 TFLOP/s, FP8 GEMMs ~1.7 ms
    at 1300, plus quantizing x and g (0.18 G elements: ~0.6 ms with torch ops at ~13 B/element, ~0.25 ms with the
    kernel at ~5) and the per-call W transpose (68 MB: ~0.03 ms)."""
    def make():
        x = (torch.randn(n, k, device="cuda", dtype=BF16)).requires_grad_()
        w = torch.randn(out, k, device="cuda", dtype=BF16) * 0.02
        a = (torch.randn(r, k, device="cuda", dtype=BF16) * 0.02).requires_grad_()
        b = (torch.randn(out, r, device="cuda", dtype=BF16) * 0.02).requires_grad_()
        return {"x": x, "w": w, "w8": Fp8Weight.quantize(w), "a": a, "b": b}
    extra = {"fp8 torch-quant": lambda i: _Fp8TorchQuant.apply(i["x"], i["w8"]),
             "lora bf16": lambda i: lora_linear(i["x"], None, i["w"], None, i["a"], i["b"], 2.0),
             "lora fp8": lambda i: lora_linear(i["x"], None, i["w8"], None, i["a"], i["b"], 2.0)}
    return Case("fp8_linear", f"N{n} K{k} O{out}", make,
                _peers(lambda i: torch.nn.functional.linear(i["x"], i["w"]), lambda i: fp8_linear(i["x"], i["w8"]),
                       None, extra),
                min_flops=2 * 2 * n * k * out, grad_bytes=n * k * E)


def fp8_linear_cases() -> List[Case]:
    # Qwen2.5-7B's LoRA projections at 8192 tokens: q/o, k/v, gate/up, down
    return [fp8_linear_case(8192, 3584, 3584), fp8_linear_case(8192, 3584, 512),
            fp8_linear_case(8192, 3584, 18944), fp8_linear_case(8192, 18944, 3584),
            fp8_linear_case(2048, 1536, 8960)]   # Qwen2.5-1.5B's gate/up at 2048 tokens: the small end


SUITES = {
    "kernels": [rms_norm_cases, swiglu_cases, rope_cases, cross_entropy_cases],
    "loss_head": [flce_cases],
    "logprobs": [logprobs_cases, grpo_logprobs_cases],
    "attention": [qk_norm_rope_cases],
    "fp8_linear": [fp8_linear_cases],
}


# The committed sweep (python -m swift_liger.bench.sweep): issue 12's grid, fwd+bwd, bf16.
SWEEP_TOKENS = (1024, 4096, 16384, 65536)
SWEEP_HIDDEN = (1024, 1536, 2048, 3584, 4096, 5120, 8192)
SWEEP_GLU_TOKENS = 16384
SWEEP_INTERMEDIATE = (4864, 8960, 11008, 14336, 18944, 28672)
SWEEP_ROPE_TOKENS = 16384
SWEEP_HEADS = ((8, 8), (16, 8), (28, 4), (32, 8), (40, 8), (64, 8))
SWEEP_HEAD_DIMS = (64, 128, 256)
SWEEP_CE_TOKENS = 8192
SWEEP_HEADS_HV = {   # (hidden, vocab) of the loss heads; tokens per case: 8192, Qwen2.5-1.5B 16384 (issue 12's shape)
    "Llama-3": (4096, 128256), "Qwen2.5-1.5B": (1536, 151936), "Qwen2.5-32B": (5120, 152064),
    "Gemma-2-9B": (3584, 256000), "Mistral-7B": (4096, 32768)}


def sweep_groups() -> Dict[str, List[tuple]]:
    """op -> [(shape key, factory)], each list headed by the shape issue 12 sets a target at."""
    def first(items, head):
        return [x for x in items if x[0] == head] + [x for x in items if x[0] != head]
    groups: Dict[str, List[tuple]] = {}
    for residual in (False, True):
        op = "rms_norm_residual" if residual else "rms_norm"
        groups[op] = first([(f"{n}x{h}", functools.partial(rms_norm_case, n, h, residual))
                            for n in SWEEP_TOKENS for h in SWEEP_HIDDEN], "16384x4096")
    for op in ("swiglu", "geglu"):
        groups[op] = first([(f"{SWEEP_GLU_TOKENS}x{i}", functools.partial(glu_case, op, SWEEP_GLU_TOKENS, i))
                            for i in SWEEP_INTERMEDIATE], f"{SWEEP_GLU_TOKENS}x14336")
    for op, factory in (("rope", rope_case), ("qk_norm_rope", qk_norm_rope_case)):
        groups[op] = first([(_layout(1, SWEEP_ROPE_TOKENS, hq, hkv, d),
                             functools.partial(factory, 1, SWEEP_ROPE_TOKENS, hq, hkv, d))
                            for hq, hkv in SWEEP_HEADS for d in SWEEP_HEAD_DIMS],
                           _layout(1, SWEEP_ROPE_TOKENS, 32, 8, 128))
    groups["cross_entropy"] = [(f"{SWEEP_CE_TOKENS}x{v} ({name})", functools.partial(cross_entropy_case,
                                                                                     SWEEP_CE_TOKENS, v))
                               for name, (_, v) in SWEEP_HEADS_HV.items()]
    flce = []
    for name, (h, v) in SWEEP_HEADS_HV.items():
        n = 16384 if name == "Qwen2.5-1.5B" else SWEEP_CE_TOKENS
        for train_w in (True, False):
            flce.append((f"N{n} H{h} V{v} W {'trainable' if train_w else 'frozen'} ({name})",
                         functools.partial(flce_case, n, h, v, train_w, ("accumulate_lowp",))))
    groups["fused_linear_ce"] = flce
    return groups
