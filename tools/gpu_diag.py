"""GPU check of rope / qk_norm_rope at benchmark shapes: each output and gradient vs a float64 reference."""
import torch

from swift_liger.ops import qk_norm_rope_kernel as qk
from swift_liger.ops import rope_kernel as rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(t, dtype, hq=32, hkv=8, d=128, layout="bthd"):
    g = torch.Generator(device=DEV).manual_seed(t)
    if layout == "bthd":
        q = torch.randn(1, t, hq, d, device=DEV, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(1, t, hkv, d, device=DEV, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(1, hq, t, d, device=DEV, generator=g).to(dtype)
        k = torch.randn(1, hkv, t, d, device=DEV, generator=g).to(dtype)
    ang = torch.rand(1, t, d, device=DEV, generator=g) * 6.28
    wq = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
    wk = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
    return q, k, ang.cos().to(dtype), ang.sin().to(dtype), wq, wk


def run(mod, fn, t, dtype, layout, grad_layout):
    q, k, cos, sin, wq, wk = inputs(t, dtype, layout=layout)
    extra = (wq, wk) if fn == "qk_norm_rope" else ()
    res = {}
    for impl in ("ref", "ours"):
        if impl == "ref":
            leaves = [x.detach().double().requires_grad_() for x in (q, k) + extra]
            f = getattr(mod, fn + "_reference")
            args = leaves[:2] + [cos.double(), sin.double()] if not extra else \
                leaves[:2] + leaves[2:] + [cos.double(), sin.double()]
        else:
            leaves = [x.detach().clone().requires_grad_() if layout != "bthd" or x.dim() == 1 else
                      x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k) + extra]
            f = getattr(mod, fn)
            args = leaves[:2] + ([cos, sin] if not extra else leaves[2:] + [cos, sin])
        oq, ok = f(*args)
        if impl == "ref":
            gq, gk = torch.randn_like(oq), torch.randn_like(ok)
            if grad_layout == "bthd":
                gq = gq.transpose(1, 2).contiguous().transpose(1, 2)
                gk = gk.transpose(1, 2).contiguous().transpose(1, 2)
        torch.autograd.backward([oq, ok], [gq.to(oq.dtype), gk.to(ok.dtype)])
        res[impl] = [oq, ok] + [x.grad for x in leaves]
    errs = [((a.double() - b.double()).norm() / a.double().norm()).item() for a, b in zip(res["ref"], res["ours"])]
    print(f"{fn:13s} T={t:6d} {str(dtype):15s} in={layout} grad={grad_layout}: " +
          " ".join(f"{e:.1e}" for e in errs), flush=True)


for fn, mod in (("apply_rope", rope), ("qk_norm_rope", qk)):
    for t in ((13, 1000, 16384) if DEV == "cuda" else (13,)):
        for dtype in (torch.float32, torch.bfloat16):
            for layout, gl in (("bthd", "bhtd"), ("bhtd", "bhtd"), ("bthd", "bthd")):
                try:
                    run(mod, fn, t, dtype, layout, gl)
                except Exception as exc:
                    print(fn, t, dtype, layout, gl, "failed", type(exc).__name__, str(exc)[:200], flush=True)
