"""cuDNN's ragged attention as torch 2.11 exposes it (aten._cudnn_attention_forward / _backward with cum_seq_q/k),
probed on the GPU: python3 tools/cudnn_ragged_probe.py. Prints which attn_bias the explicit backward takes (None, an
empty 1-D or 4-D tensor), whether autograd through the aten forward gives correct gradients (three documents of
100 / 200 / 212 tokens, 4 query / 2 KV heads, head dim 64, against a float32 per-document reference), and the host
and total time of four forward calls at 8192 tokens, 28 / 4 heads, head dim 128 (a plan built per call shows as
tens of ms of host time). Results: docs/benchmarks/cudnn_ragged_h100.md."""
import time
import traceback

import torch

A = torch.ops.aten
T, H, HK, D = 512, 4, 2, 64
cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")


def mk(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def err(x, y):
    return float((x.detach().float() - y).abs().max() / y.abs().max())


q, k, v = mk(T, H, D), mk(T, HK, D), mk(T, HK, D)
r = A._cudnn_attention_forward(q, k, v, None, cu, cu, 212, 212, True, 0.0, True, False, scale=0.125)
o, lse, seed, off = r[0], r[1], r[6], r[7]
go = torch.randn_like(o)
# which attn_bias the explicit backward takes
for name, bias in (("None", None), ("empty1d", torch.empty(0, device="cuda")),
                   ("empty4d", torch.empty(0, 0, 0, 0, device="cuda"))):
    try:
        g = A._cudnn_attention_backward(go, q, k, v, o, lse, seed, off, bias, cu, cu, 212, 212, 0.0, True,
                                        scale=0.125)
        print(name, "OK", [tuple(x.shape) for x in g])
    except Exception as e:  # noqa: BLE001  the refusal is the result
        print(name, "ERR", type(e).__name__, str(e)[:200])
# autograd through the aten forward against a float32 per-document reference (GQA: each KV head serves 2 queries)
try:
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    r = A._cudnn_attention_forward(qq, kk, vv, None, cu, cu, 212, 212, True, 0.0, True, False, scale=0.125)
    r[0].backward(go)
    print("autograd OK", qq.grad.shape, kk.grad.shape)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs = []
    for a, b in ((0, 100), (100, 300), (300, 512)):
        s = (qf[a:b].transpose(0, 1) @ kf[a:b].repeat_interleave(2, 1).permute(1, 2, 0)) * 0.125
        n = b - a
        keep = torch.ones(n, n, device="cuda", dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
        outs.append((s.softmax(-1) @ vf[a:b].repeat_interleave(2, 1).transpose(0, 1)).transpose(0, 1))
    of = torch.cat(outs)
    of.backward(go.float())
    print("err out", err(r[0], of), "dq", err(qq.grad, qf.grad), "dk", err(kk.grad, kf.grad),
          "dv", err(vv.grad, vf.grad))
except Exception as e:  # noqa: BLE001
    print("autograd ERR", type(e).__name__, str(e)[:300])
    traceback.print_exc(limit=4)
# host time per forward call at 7B heads, 8k tokens (a plan built per call shows as tens of ms)
q8, k8, v8 = mk(8192, 28, 128), mk(8192, 4, 128), mk(8192, 4, 128)
cu8 = torch.tensor([0, 1000, 3000, 8192], dtype=torch.int32, device="cuda")
for i in range(4):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = A._cudnn_attention_forward(q8, k8, v8, None, cu8, cu8, 5192, 5192, True, 0.0, True, False, scale=0.088)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print("fwd call", i, "host ms %.2f total ms %.2f" % ((t1 - t0) * 1e3, (t2 - t0) * 1e3))
