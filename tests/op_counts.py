"""Counting the aten operations a code path issues around the attention kernels, on the CPU.

`OpCounts` (a TorchDispatchMode) counts every aten op that reaches the dispatcher, by name, and splits them into
views (the schema's result aliases an input without writing it: transposes, reshapes that need no copy, detach)
and the rest: the ops that launch work on a GPU (copies, gathers, fills, allocations). `stand_in_kernels` makes
the planner pick a stand-in for the GPU kernels on CPU tensors: a forward that is not differentiable by autograd
and allocates its outputs as the kernels' steps do (`problem.new_outputs`), and a backward that fills the gradient
buffers it is given, so the path around them (the autograd Function, the packed views, the layout of every
buffer) is the GPU's; the stand-ins fill their outputs from the PyTorch reference with the counting paused.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashmoe_science.attention import autograd, call, plan, reference
from flashmoe_science.attention.problem import new_outputs
from host_reads import Pausable

# The kernels' own buffers (outputs, gradients, the backward's row sums): allocations, no data moved.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})


def is_view(func) -> bool:
    """Whether an aten op returns an alias of an input that it does not write (a view: no work on the device)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounts(Pausable, TorchDispatchMode):
    """``with OpCounts() as counts: ...`` then ``counts.work`` (non-view ops but allocations, by name) and
    ``counts.views``."""

    def __init__(self):
        super().__init__()
        self.work: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.pause_depth:
            name = func._opname
            if is_view(func):
                self.views[name] += 1
            elif name not in ALLOCATIONS:
                self.work[name] += 1
        return func(*args, **(kwargs or {}))


class _Forward:
    backend = "stand_in"
    kernel = "stand_in.forward"
    differentiable = False
    tiles = None

    def __init__(self, counts: OpCounts):
        self.counts = counts

    def run(self, q, k, v, features, softmax_scale, out=None, lse=None):
        out, lse = new_outputs(q)
        with self.counts.paused(), torch.no_grad():
            want, want_lse = reference.attention_reference(q, k, v, features, softmax_scale)
            out.copy_(want)
            lse.copy_(want_lse)
        return out, lse

    def prepare(self, *args):
        return None


class _Backward:
    backend = "stand_in"
    kernel = "stand_in.backward"
    title = "the stand-in kernels"

    def __init__(self, counts: OpCounts):
        self.counts = counts

    def run(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, deterministic, need_dbias):
        with self.counts.paused():
            grads = reference.attention_backward_reference(q, k, v, out, lse, grad_out, features, softmax_scale)
            for buffer, grad in zip((dq, dk, dv), grads):
                if buffer is not None:
                    buffer.copy_(grad)
        return dq, dk, dv, None

    def prepare(self, *args):
        return None


class _Family:
    """A backend family that takes every call (first in the walk) and plans the stand-ins."""

    name = "stand_in"
    title = "the stand-in kernels"
    runs_kernels = False
    policy = ("", "", "")

    def __init__(self, counts: OpCounts):
        self.counts = counts
        self.backward = self

    def decline(self, question) -> None:
        return None

    def plan(self, question):
        return _Backward(self.counts) if isinstance(question, plan.BackwardQuestion) else _Forward(self.counts)


def stand_in_kernels(monkeypatch, counts: OpCounts) -> None:
    """The planner's walk starts with the stand-in kernels (pausing `counts` while they compute) for the rest of a
    test; the prepared-call caches are the test's own, so no stand-in outlives it."""
    monkeypatch.setattr(plan, "ATTENTION_BACKENDS", (_Family(counts), *plan.ATTENTION_BACKENDS))
    monkeypatch.setattr(call, "PREPARED", {})
    monkeypatch.setattr(call, "PREPARED_PACKED", {})
    monkeypatch.setattr(autograd, "BACKWARD_PLANS", {})
