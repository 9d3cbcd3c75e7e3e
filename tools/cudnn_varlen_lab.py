"""cuDNN's ragged (cumulative-sequence) attention against ours on packed rows: python3 tools/cudnn_varlen_lab.py
--out $OUT/cudnn_varlen.json (GPU). torch ships it as aten._cudnn_attention_forward / _backward with cum_seq_q/k
(the nested-tensor path; torch.nn.attention.varlen keeps it off). Per head spec and layout: agreement with ours
(outputs and every gradient, and both against a float32 reference at a short row), fwd+bwd time beside ours and
dense SDPA cuDNN, the first-call (graph build) time for a new number of documents / longest document, and whether
padding the document count with empty documents and rounding the longest length up keep the results."""
import argparse
import json
import time

import torch
from attn_lab import doc_lengths   # tools/ is the script's directory
from triton.testing import do_bench

A = torch.ops.aten


def _call(op, named):
    """Call an aten overload by its schema's argument names (the positional order moved between torch releases)."""
    schema = op.default._schema
    args, kwargs = [], {}
    for a in schema.arguments:
        if a.name not in named:
            if a.has_default_value():
                continue
            raise KeyError(f"{schema.name}: no value for {a.name}")
        (kwargs.__setitem__(a.name, named[a.name]) if a.kwarg_only else args.append(named[a.name]))
    return op(*args, **kwargs)


def cudnn_fwd(q, k, v, cu, max_s, scale):
    r = _call(A._cudnn_attention_forward, dict(
        query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=max_s, max_k=max_s,
        compute_log_sumexp=True, dropout_p=0.0, is_causal=True, return_debug_mask=False, scale=scale))
    return r[0], r[1], r[6], r[7]


def cudnn_bwd(go, q, k, v, out, lse, seed, offset, cu, max_s, scale):
    named = dict(grad_out=go, query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
                 philox_offset=offset, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu,
                 max_q=max_s, max_k=max_s, dropout_p=0.0, is_causal=True, scale=scale)
    return _call(A._cudnn_attention_backward, named)[:3]


class Ragged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_s, scale):
        out, lse, seed, offset = cudnn_fwd(q, k, v, cu, max_s, scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.args = (max_s, scale)
        return out

    @staticmethod
    def backward(ctx, go):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        dq, dk, dv = cudnn_bwd(go.contiguous(), q, k, v, out, lse, seed, offset, cu, *ctx.args)
        return dq, dk, dv, None, None, None


def cu_of(lengths, dev, pad_docs=0):
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if pad_docs:
        cu = torch.cat([cu, cu[-1:].repeat(pad_docs)])
    return cu.to(dev)


def err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cudnn_varlen.json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", default="28/4/128,14/2/64,32/8/128,16/8/256")
    args = ap.parse_args()
    from swift_liger.ops import varlen_attention_kernel as vk
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "fwd_schema": str(A._cudnn_attention_forward.default._schema),
            "bwd_schema": str(A._cudnn_attention_backward.default._schema)}
    print(json.dumps(info, indent=1), flush=True)
    results = []

    def save():
        with open(args.out, "w") as f:
            json.dump(dict(info, results=results), f, indent=1)

    dev = "cuda"
    # against a float32 reference at a short row (odd lengths, GQA)
    for spec in args.heads.split(","):
        hq, hkv, d = map(int, spec.split("/"))
        lengths = [1, 7, 130, 255, 64, 600, 3, 988]
        Ts = sum(lengths)
        torch.manual_seed(1)
        q, k, v = (torch.randn(Ts, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for h in (hq, hkv, hkv))
        go = torch.randn(Ts, hq, d, device=dev, dtype=torch.bfloat16)
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)[None]
        rec = {"heads": spec, "reference_lengths": lengths}
        try:
            o = Ragged.apply(q, k, v, cu_of(lengths, dev), max(lengths), d ** -0.5)
            o.backward(go)
            got = [o.detach(), q.grad, k.grad, v.grad]
            # the same values laid out head-major ([H, T, D] memory seen as [T, H, D])
            qh, kh, vh = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v))
            try:
                oh = Ragged.apply(qh, kh, vh, cu_of(lengths, dev), max(lengths), d ** -0.5)
                oh.backward(go)
                rec["head_major_vs_token_major"] = {n: err(a, b) for n, a, b in zip(
                    ("out", "dq", "dk", "dv"), (oh.detach(), qh.grad, kh.grad, vh.grad), got)}
                rec["head_major_out_strides"] = list(oh.stride())
            except Exception as e:  # noqa: BLE001
                rec["head_major_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            qf, kf, vf = (t.detach().float().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
            ref = vk.varlen_attention_reference(qf, kf, vf, seg, scale=d ** -0.5)[0]
            ref.backward(go.float())
            want = [ref.detach(), qf.grad[0].transpose(0, 1), kf.grad[0].transpose(0, 1), vf.grad[0].transpose(0, 1)]
            rec["vs_fp32_reference"] = {n: err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(rec), flush=True)
        results.append(rec)
        save()
    T, dev = args.tokens, "cuda"
    for spec in args.heads.split(","):
        hq, hkv, d = map(int, spec.split("/"))
        scale = d ** -0.5
        torch.manual_seed(0)
        # [T, H, D] token-major, as q/k/v leave the projections (transformers hands [1, H, T, D] views of these)
        q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
        for layout, lengths in (("dense", [T]), ("packed0", doc_lengths(T, 0)), ("packed1", doc_lengths(T, 1))):
            r = {"heads": spec, "layout": layout, "docs": len(lengths), "tokens": T}
            cu = cu_of(lengths, dev)
            max_s = max(lengths)
            seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)[None]
            bounds = vk.doc_bounds(seg.to(torch.int32))
            pairs = sum(n * (n + 1) // 2 for n in lengths)
            useful = 3.5 * 4 * d * hq * pairs

            def ours():
                return vk.varlen_attention_unchecked(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     v.transpose(0, 1)[None], bounds, scale)[0]

            def ragged():
                return Ragged.apply(q, k, v, cu, max_s, scale)

            def grads(fn):
                for t in (q, k, v):
                    t.grad = None
                o = fn()
                o.backward(go)
                return o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                grads(ragged)
                torch.cuda.synchronize()
                r["first_call_s"] = time.perf_counter() - t0
                a, b = grads(ours), grads(ragged)
                r["vs_ours"] = {n: err(y, x) for n, x, y in zip(("out", "dq", "dk", "dv"), a, b)}
                r["ragged_ms"] = do_bench(lambda: grads(ragged), warmup=20, rep=200)
                r["ragged_fwd_ms"] = do_bench(ragged, warmup=20, rep=100)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    ragged()
                r["ragged_fwd_host_ms"] = (time.perf_counter() - t0) * 100   # host time per call (plan builds)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  the refusal is the result
                r["ragged_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            r["ours_ms"] = do_bench(lambda: grads(ours), warmup=20, rep=200)
            r["ours_fwd_ms"] = do_bench(ours, warmup=20, rep=100)
            if layout == "dense":
                qd, kd, vd = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
                god = go.transpose(0, 1)[None]

                def sdpa():
                    for t in (qd, kd, vd):
                        t.grad = None
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = F.scaled_dot_product_attention(qd, kd.repeat_interleave(hq // hkv, 1),
                                                           vd.repeat_interleave(hq // hkv, 1), is_causal=True)
                    o.backward(god)
                try:
                    r["sdpa_cudnn_ms"] = do_bench(sdpa, warmup=20, rep=200)
                except Exception as e:  # noqa: BLE001
                    r["sdpa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for key in ("ragged_ms", "ours_ms", "sdpa_cudnn_ms"):
                if key in r:
                    r[key.replace("_ms", "_tflops")] = useful / r[key] / 1e9
            print(json.dumps(r), flush=True)
            results.append(r)
            save()
        # graph builds: new (docs, longest) keys, then the same keys padded / rounded up
        if "ragged_error" in results[-1]:
            continue
        builds = []
        for seed in range(2, 7):
            lengths = doc_lengths(T, seed)
            cu, max_s = cu_of(lengths, dev), max(lengths)
            out = {"seed": seed, "docs": len(lengths), "max_s": max_s}
            for name, c, m in (("exact", cu, max_s),
                               ("docs64_pow2", cu_of(lengths, dev, 64 - len(lengths) if len(lengths) < 64 else 0),
                                1 << (max_s - 1).bit_length()),
                               ("docs64_T", cu_of(lengths, dev, 64 - len(lengths) if len(lengths) < 64 else 0), T)):
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = Ragged.apply(q, k, v, c, m, scale)
                    o.backward(go)
                    torch.cuda.synchronize()
                    out[name + "_first_s"] = time.perf_counter() - t0
                    ref = Ragged.apply(q, k, v, cu, max_s, scale).detach()
                    out[name + "_out_err"] = err(o.detach(), ref)
                    out[name + "_ms"] = do_bench(lambda: Ragged.apply(q, k, v, c, m, scale).backward(go),
                                                 warmup=5, rep=60)
                except Exception as e:  # noqa: BLE001
                    out[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(out), flush=True)
            builds.append(out)
        results.append({"heads": spec, "graph_builds": builds})
        save()


if __name__ == "__main__":
    main()
