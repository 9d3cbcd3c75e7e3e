"""Inference: one GEMM where a layer reads the same input through several projections (q/k/v of an attention,
gate/up of a split gated MLP). Decode at batch 1-32 multiplies a few rows by each weight, so each projection is its
own skinny GEMM: on the H200 the k/v products of Llama-3-8B ran at ~1.6 TB/s and cuBLAS adds a split-K reduction
launch to most of them (160 of the 689 kernels of a graphed decode step; docs/benchmarks/rolling_cache.md).

The group's weights (and biases) are copied once into one [sum(out), in] buffer and each projection's parameter is
re-pointed at its rows of it (``param.data = buffer[rows]``): values, shapes, dtypes and state_dict are unchanged
and no memory is added. The first member called under no_grad runs one ``F.linear`` over the buffer and keeps the
other members' column blocks for their calls with the same input tensor (same object, same version); each member
returns a column view of that product. Calls that autograd records, calls under torch.compile, inputs seen for the
first time by a non-leading member, and groups whose parameters were re-pointed elsewhere since (``.to()``, a state
dict loaded with assign) run their own projection as before. Revert gives every parameter its own storage again.
"""
from __future__ import annotations

from typing import List, Optional

from ..patching.families import ATTENTION_INPUTS as ATTENTION_GROUP
from .base import Fusion


class Group:
    """Projections sharing an input: members (nn.Linear), the fused weight/bias and the pending column blocks."""

    def __init__(self, members, weight, bias):
        self.members = members
        self.weight, self.bias = weight, bias
        self.sizes = [m.out_features for m in members]
        self.ptrs = [m.weight.data_ptr() for m in members]
        self.pending = None   # [input, its _version, [block or None per member], blocks left] from the last fused call

    def intact(self) -> bool:
        """Whether every member still reads its rows of the buffer; once not (.to(), a reload), the buffer is let
        go for good and the members project on their own."""
        if self.weight is None:
            return False
        for m, p in zip(self.members, self.ptrs):
            if m.weight.data_ptr() != p:
                self.weight = self.bias = self.pending = None
                return False
        return True

    def call(self, i: int, x):
        import torch
        import torch.nn.functional as F
        pending = self.pending
        # A member after the first: its block of the product the first one made from this very input (same object,
        # same version), checked before anything else (eager decode pays this Python per projection per layer).
        if pending is not None and pending[0] is x and pending[1] == x._version:
            out = pending[2][i]
            if out is not None:
                pending[2][i] = None
                pending[3] -= 1
                if pending[3] == 0:
                    self.pending = None
                return out
        m = self.members[i]
        if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad))
                or not self.intact() or x.dtype != self.weight.dtype or x.device != self.weight.device):
            return F.linear(x, m.weight, m.bias)
        blocks: List[Optional[object]] = list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        out, blocks[i] = blocks[i], None
        self.pending = [x, x._version, blocks, len(blocks) - 1]
        return out


GROUP_ATTR = "_swift_liger_fused_group"   # on each member: (its Group, its index)


def _forward(self, x):
    """A member's forward. The group is read from the instance (not a closure), so a deep copy of the model
    (a DPO reference model) calls its own copy, whose stale pointers send it down the unfused path."""
    group, i = self.__dict__[GROUP_ATTR]
    return group.call(i, x)


def _why_not(members) -> Optional[str]:
    import torch
    for m in members:
        if type(m) is not torch.nn.Linear:
            return f"{type(m).__name__} is not a plain torch.nn.Linear"
        w = m.weight
        if type(w) is not torch.nn.Parameter or hasattr(w, "ds_id") or w.is_meta or not w.is_contiguous():
            return "a weight is sharded, offloaded or not contiguous"
    first = members[0]
    if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
           or m.weight.device != first.weight.device for m in members):
        return "the projections differ in input size, dtype or device"
    if len({m.bias is None for m in members}) > 1:
        return "some projections have a bias and some not"
    if len({id(m.weight) for m in members}) < len(members):
        return "projections share a weight"
    return None


def _fuse(ctx, members) -> None:
    import torch
    # lazy: the spec loads without torch; the patch imports the toolkit when it runs
    from ..patching.state import foreign_forward, set_forward
    why = _why_not(members) or next((foreign_forward(m) for m in members if foreign_forward(m)), None)
    if why:
        ctx.report.skip("fused_projections", why, problem=False)
        return
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in members])
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        start = 0
        for m in members:
            n = m.out_features
            m.weight.data = weight[start:start + n]
            if bias is not None:
                m.bias.data = bias[start:start + n]
            start += n
    group = Group(members, weight, bias)
    for i, m in enumerate(members):
        ctx.state.set(m, GROUP_ATTR, (group, i))
        set_forward(ctx.state, m, _forward)
    ctx.state.on_restore(_unfuse, members)
    ctx.report.patched["fused_projections"] += 1


def _unfuse(members) -> None:
    """Each parameter back in storage of its own (same values)."""
    import torch
    with torch.no_grad():
        for m in members:
            m.weight.data = m.weight.data.clone()
            if m.bias is not None:
                m.bias.data = m.bias.data.clone()


def patch(ctx) -> None:
    for attn in ctx.of(ctx.family.attention):
        if all(hasattr(attn, n) for n in ATTENTION_GROUP):
            _fuse(ctx, [getattr(attn, n) for n in ATTENTION_GROUP])
    layout = ctx.family.mlp_layout
    if layout.gate is not None:   # packed MLPs (one gate_up_proj) are one GEMM already
        for mlp in ctx.of(ctx.family.mlp):
            if hasattr(mlp, layout.gate) and hasattr(mlp, layout.up):
                _fuse(ctx, [getattr(mlp, layout.gate), getattr(mlp, layout.up)])


FUSION = Fusion(key="fused_projections", default=False,
                help="Inference: one GEMM for q/k/v and one for gate/up under no_grad (their weights become row "
                     "blocks of one buffer: same values, no extra memory); calls autograd records run as before. "
                     "H200, Llama-3-8B, graph decode at batch 1: 4.94 against 5.62 ms/token.",
                applies_to="attention q_proj/k_proj/v_proj and split MLP gate_proj/up_proj (plain nn.Linear)",
                order=87, patch=patch, say_off=False)
