"""Sharded lm_head helpers: plain passthrough, a fake ZeRO-3 engine, single-process gloo DTensor / FSDP2."""
import enum
import os
import sys
import types

import pytest
import torch

import helpers
from helpers import assert_close, f64, randn
from swift_liger.fusions.loss_head import sharding
from swift_liger.ops.fused_linear_cross_entropy_kernel import (fused_linear_cross_entropy,
                                                                fused_linear_cross_entropy_reference)

N, H, V, CHUNK = 21, 32, 301, 8


def reference_grads(hidden, weight, bias, labels):
    leaves = [f64(t, requires_grad=True) if t is not None else None for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy_reference(leaves[0], leaves[1], labels.cpu(), leaves[2])
    loss.backward()
    return loss, [t.grad if t is not None else None for t in leaves]


def data(device, dtype=torch.float32):
    hidden = randn(N, H, dtype=dtype, device=device, requires_grad=True)
    labels = torch.randint(0, V, (N,), device=device)
    labels[::4] = -100
    return hidden, labels


def test_plain_passthrough(device):
    head = torch.nn.Linear(H, V, bias=True, device=device)
    with sharding.gathered_lm_head_weight(head) as w:
        assert w is head.weight
    with sharding.gathered_lm_head(head.weight) as (w, b):
        assert w is head.weight and b is None
    with sharding.gathered_lm_head(head) as (w, b):
        assert w is head.weight and b is head.bias
    with pytest.raises(TypeError, match="module_or_param"):
        with sharding.gathered_lm_head_weight("lm_head"):
            pass
    hidden, labels = data(device)
    loss = sharding.lm_head_cross_entropy(head, hidden, labels, chunk_size=CHUNK)
    ref, _ = reference_grads(hidden, head.weight, head.bias, labels)
    assert_close(loss, ref, torch.float32)


# --- fake ZeRO-3 ------------------------------------------------------------------------------------------------

class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def _gather(params):
    for p in params:
        p.data = p._full.clone()   # a fresh all-gather buffer, like ZeRO-3
        p.ds_status = ZeroParamStatus.AVAILABLE


def _release(params):
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


class FakeZero3:
    """Partition a module's params ZeRO-3 style; capture grads from an AccumulateGrad hook like stage 3 does."""

    def __init__(self, module, monkeypatch, module_hooks=False):
        self.gathers = 0
        self.grads = {}
        self.params = list(module.parameters())
        for i, p in enumerate(self.params):
            p.ds_id, p.ds_shape, p._full = i, tuple(p.shape), p.detach().clone()
            if p.requires_grad:   # stage 3 hooks trainable params only, while gathered
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._grad_hook(p))
                p._grad_acc = grad_acc
        _release(self.params)
        fake = types.ModuleType("deepspeed")
        fake.zero = types.SimpleNamespace(GatheredParameters=self._gathered_parameters)
        monkeypatch.setitem(sys.modules, "deepspeed", fake)
        if module_hooks:
            module.register_forward_pre_hook(lambda m, a: _gather(self.params))
            module.register_forward_hook(self._post_forward)

    def _grad_hook(self, p):
        def hook(*_):
            self.grads[p.ds_id] = p.grad.detach().clone()
            p.grad = None   # stage 3 moves the (reduced) grad into its partition
        return hook

    def _post_forward(self, module, args, output):
        # release now, fetch again when the output's gradient arrives (stage 3's pre-backward hook)
        _release(self.params)
        params = self.params

        class PreBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                _gather(params)
                return g

        return PreBackward.apply(output)

    def _gathered_parameters(self, params, modifier_rank=None):
        fake = self
        params = params if isinstance(params, (list, tuple)) else [params]

        class Ctx:
            def __enter__(self):
                fake.gathers += 1
                _gather(params)

            def __exit__(self, *exc):
                _release(params)

        return Ctx()


@pytest.mark.parametrize("strategy", ["accumulate", "recompute"])
def test_zero3_gathered_context(device, monkeypatch, strategy):
    head = torch.nn.Linear(H, V, bias=True, device=device)
    zero = FakeZero3(head, monkeypatch)
    hidden, labels = data(device)
    # the op must never see the partitioned [0] weight
    with pytest.raises(ValueError, match="gathered_lm_head_weight"):
        fused_linear_cross_entropy(hidden, head.weight, labels)
    with sharding.gathered_lm_head(head) as (w, b):
        assert w.shape == (V, H) and b.shape == (V,)
        loss = fused_linear_cross_entropy(hidden, w, labels, b, chunk_size=CHUNK, dw_strategy=strategy)
    # trainable: stays gathered until its AccumulateGrad ran (ZeRO-3's reduce hook first), then released
    assert zero.gathers == 1 and head.weight.shape == (V, H)
    loss.backward()
    assert head.weight.shape == (0,) and head.bias.shape == (0,)
    ref, (gh, gw, gb) = reference_grads(hidden, head.weight._full, head.bias._full, labels)
    assert_close(loss, ref, torch.float32)
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(zero.grads[0], gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")
    assert_close(zero.grads[1], gb, torch.float32, slack=helpers.REDUCTION_SLACK, name="bias")


def test_zero3_frozen_head_released_at_exit(device, monkeypatch):
    head = torch.nn.Linear(H, V, bias=False, device=device).requires_grad_(False)
    zero = FakeZero3(head, monkeypatch)
    hidden, labels = data(device)
    with sharding.gathered_lm_head_weight(head) as w:
        loss = fused_linear_cross_entropy(hidden, w, labels, chunk_size=CHUNK)
    assert zero.gathers == 1 and head.weight.shape == (0,)   # backward needs no weight: released at once
    loss.backward()
    ref, (gh, _, _) = reference_grads(hidden, head.weight._full, None, labels)
    assert_close(hidden.grad, gh, torch.float32, name="hidden")


def test_zero3_available_and_module_forward(device, monkeypatch):
    head = torch.nn.Linear(H, V, bias=False, device=device)
    zero = FakeZero3(head, monkeypatch, module_hooks=True)
    _gather(zero.params)
    with sharding.gathered_lm_head_weight(head) as w:   # already gathered by the engine: the param itself
        assert w is head.weight
    assert zero.gathers == 0
    _release(zero.params)
    hidden, labels = data(device)
    # Through the module's forward: hooks gather, release, and re-gather for the recompute pass in backward.
    loss = sharding.lm_head_cross_entropy(head, hidden, labels, chunk_size=CHUNK, dw_strategy="recompute")
    assert zero.gathers == 0 and head.weight.shape == (0,)
    loss.backward()
    ref, (gh, gw, _) = reference_grads(hidden, head.weight._full, None, labels)
    assert_close(loss, ref, torch.float32)
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(zero.grads[0], gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")


def test_call_through_module_restores_forward(device):
    head = torch.nn.Linear(H, V, bias=False, device=device)
    marker = lambda x: x  # noqa: E731
    head.forward = marker
    out = sharding.call_through_module(head, lambda w, b, x: x @ w.t(), torch.ones(2, H, device=device))
    assert out.shape == (2, V) and head.forward is marker
    del head.forward
    sharding.call_through_module(head, lambda w, b: None)
    assert "forward" not in head.__dict__


# --- single-process gloo DTensor / FSDP2 --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.device_mesh import init_device_mesh
    created = False
    if not dist.is_initialized():
        backend = "nccl" if os.environ.get("SWIFT_LIGER_TEST_GPU") == "1" else "gloo"
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    if dist.get_world_size() != 1:
        pytest.skip("needs a single-process group")
    device_type = "cuda" if os.environ.get("SWIFT_LIGER_TEST_GPU") == "1" else "cpu"
    yield init_device_mesh(device_type, (1,)), tensor_mod
    if created:
        dist.destroy_process_group()


def test_dtensor_full_tensor(device, mesh):
    mesh, tensor_mod = mesh
    w_full = randn(V, H, device=device, scale=H ** -0.5)
    weight = torch.nn.Parameter(tensor_mod.distribute_tensor(w_full, mesh, [tensor_mod.Shard(0)]))
    hidden, labels = data(device)
    with sharding.gathered_lm_head_weight(weight) as w:
        assert not sharding.is_dtensor(w) and w.shape == (V, H)
        loss = fused_linear_cross_entropy(hidden, w, labels, chunk_size=CHUNK, dw_strategy="recompute")
    loss.backward()
    assert sharding.is_dtensor(weight.grad)
    ref, (gh, gw, _) = reference_grads(hidden, w_full, None, labels)
    assert_close(loss, ref, torch.float32)
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(weight.grad.full_tensor(), gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")


def fsdp2_head(device, mesh):
    """An lm_head that is its own FSDP2 unit, and a copy of its full weight."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip("FSDP2 unavailable")
    head = torch.nn.Linear(H, V, bias=False, device=device)
    w_full = head.weight.detach().clone()
    fully_shard(head, mesh=mesh[0])
    return head, w_full


def test_fsdp2_head_unit(device, mesh):
    head, w_full = fsdp2_head(device, mesh)
    assert sharding.is_fsdp_module(head) and sharding.is_dtensor(head.weight)
    hidden, labels = data(device)
    seen = []

    def spy(w, b, h, y):
        seen.append(sharding.is_dtensor(w) or w.shape != (V, H))
        return fused_linear_cross_entropy(h, w, y, b, chunk_size=CHUNK, dw_strategy="recompute")

    loss = sharding.call_through_module(head, spy, hidden, labels)
    assert seen == [False]   # fn ran on the unsharded plain weight
    loss.backward()
    ref, (gh, gw, _) = reference_grads(hidden, w_full, None, labels)
    assert_close(loss, ref, torch.float32)
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(head.weight.grad.full_tensor(), gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")
    # the convenience wrapper takes the same route
    hidden.grad = None
    head.weight.grad = None
    loss2 = sharding.lm_head_cross_entropy(head, hidden, labels, chunk_size=CHUNK)
    loss2.backward()
    assert_close(loss2, ref, torch.float32)
    assert_close(head.weight.grad.full_tensor(), gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")


# --- the log-prob head (preference trainers) on sharded heads -------------------------------------------------------

def _logprob_reference(hidden, weight, labels, grad):
    """float64 log p of the labels and the grads of sum(grad * logp)."""
    h, w = f64(hidden, requires_grad=True), f64(weight, requires_grad=True)
    y = labels.cpu()
    logp = torch.log_softmax(h @ w.t(), -1).gather(-1, y.clamp_min(0)[:, None]).squeeze(-1)
    logp = torch.where(y != -100, logp, 0.0)
    (logp * grad.cpu().double()).sum().backward()
    return logp, h.grad, w.grad


def test_zero3_logprobs_through_module_hooks(device, monkeypatch):
    """A partitioned trainable head (full fine-tuning under ZeRO-3): gathered by the engine's hooks around the op,
    re-gathered for the backward's dW recompute, dW handed to ZeRO-3's AccumulateGrad hook."""
    head = torch.nn.Linear(H, V, bias=False, device=device)
    zero = FakeZero3(head, monkeypatch, module_hooks=True)
    hidden, labels = data(device)
    g = randn(N, device=device)
    logps = sharding.lm_head_logprobs(head, hidden, labels, chunk_size=CHUNK)
    assert zero.gathers == 0 and head.weight.shape == (0,)   # released after the forward
    (logps * g).sum().backward()
    ref, gh, gw = _logprob_reference(hidden, head.weight._full, labels, g)
    assert_close(logps, ref, torch.float32, name="logps")
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(zero.grads[0], gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")


def test_fsdp2_logprobs_head_unit(device, mesh):
    head, w_full = fsdp2_head(device, mesh)
    hidden, labels = data(device)
    g = randn(N, device=device)
    out = sharding.lm_head_logprobs(head, hidden, labels, chunk_size=CHUNK, return_logit_sum=True)
    (out.logps * g).sum().backward()
    ref, gh, gw = _logprob_reference(hidden, w_full, labels, g)
    assert_close(out.logps, ref, torch.float32, name="logps")
    assert_close(out.logit_sum, (hidden.detach().double().cpu() @ w_full.double().cpu().t()).sum(-1), torch.float32,
                 slack=helpers.REDUCTION_SLACK, name="logit_sum")
    assert_close(hidden.grad, gh, torch.float32, name="hidden")
    assert_close(head.weight.grad.full_tensor(), gw, torch.float32, slack=helpers.REDUCTION_SLACK, name="weight")
