"""The MoE layer below the public functions: checked problem -> plan -> execute.

``fused_experts``/``fused_moe``/``moe_route`` (moe/api.py) and their ``torch.compile`` custom ops
(moe/ops.py) both call ``experts``, ``moe`` and ``route_checked`` here, so a call's checks run once
whichever way it comes. Each checks its inputs, plans the call once (``plan.plan_experts``: the layer family and
each expert GEMM's) and runs the plan: the PyTorch reference, the autograd function over the kernel layer (its
backward runs the forward's plan), or the inference path with its prepared calls.

An inference call whose signature ran before skips the checks, the planning and Triton's argument binding of its
launches (``PREPARED``: launch-bound on few tokens, docs/perf-notes.md). Bounded: each token count is a new
signature (prepared_cache.CACHE_MAX).
"""

from __future__ import annotations

import torch

from flashmoe_science.backends import Choice
from flashmoe_science.moe.checks import (check_experts, check_router_logits, check_routing_options, check_same_device,
                                         check_top_k, check_topk)
from flashmoe_science.moe.fp8 import Fp8ExpertsProblem, check_forward_only, check_fp8_experts, plan_fp8_experts, \
    run_fp8_experts
from flashmoe_science.moe.plan import TRITON_DTYPES, ExpertsProblem, KernelPlan, plan_experts
from flashmoe_science.moe.reference import fused_experts_reference
from flashmoe_science.moe.routing import route
from flashmoe_science.prepared_cache import prepared_table, remember, tensor_signature


class FusedExperts(torch.autograd.Function):
    """The kernel layer's forward and backward; the token sort and the plan are made once and reused by the
    backward."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_weights, topk_ids, plan: KernelPlan):
        from flashmoe_science.moe import layer

        weights32 = topk_weights.float().contiguous()
        out, saved = layer.moe_forward(x, w1, w2, weights32, topk_ids, plan, save_for_backward=True)
        ctx.saved_sort = saved
        ctx.weights_dtype = topk_weights.dtype
        ctx.save_for_backward(x, w1, w2, weights32)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from flashmoe_science.moe import layer

        x, w1, w2, weights32 = ctx.saved_tensors
        need_dx, need_dw1, need_dw2, need_dweights = ctx.needs_input_grad[:4]
        dx, dw1, dw2, dweights = layer.moe_backward(
            grad_out, x, w1, w2, weights32, ctx.saved_sort, need_dx=need_dx, need_dw1=need_dw1, need_dw2=need_dw2)
        return dx, dw1, dw2, dweights.to(ctx.weights_dtype) if need_dweights else None, None, None


def records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------- checked entries
def route_checked(router_logits, top_k, renormalize, scoring):
    """``moe_route`` after its checks."""
    check_router_logits(router_logits)
    check_top_k(top_k, router_logits.shape[1])
    check_routing_options(renormalize, scoring)
    return route(router_logits, top_k, renormalize, scoring)


def plan_experts_call(x, w1, w2, topk_weights, topk_ids, backend: str, training: bool | None = None) -> Choice:
    """The checks of a ``fused_experts`` call, then its plan (``training``: default, whether autograd records it)."""
    num_tokens, _, _, _ = check_experts(x, w1, w2)
    check_topk(topk_weights, topk_ids, num_tokens, x)
    if training is None:
        training = records_grad(x, w1, w2, topk_weights)
    return plan_experts(ExpertsProblem(x, w1, w2, topk_ids.shape[1], backend, training))


def experts(x, w1, w2, topk_weights, topk_ids, backend: str):
    """``fused_experts`` on the current device: prepared call, or checks, plan and run."""
    key = experts_key(x, w1, w2, topk_weights, topk_ids, backend)
    prepared = PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks and plan as then
        return prepared(x, w1, w2, topk_weights.float().contiguous(), topk_ids)
    plan = plan_experts_call(x, w1, w2, topk_weights, topk_ids, backend)
    return run_experts(plan, x, w1, w2, topk_weights, topk_ids, key)


def moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend: str):
    """``fused_moe`` on the current device: prepared call, or checks, plan, routing and run."""
    key = moe_key(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    prepared = PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks and plan as then
        return prepared(x, w1, w2, router_logits)

    num_tokens, _, num_experts, _ = check_experts(x, w1, w2)
    check_router_logits(router_logits, num_tokens, num_experts)
    check_same_device("router_logits", router_logits, x)
    check_top_k(top_k, num_experts)
    check_routing_options(renormalize, scoring)
    # before the routing work: a bad backend fails first
    plan = plan_experts(ExpertsProblem(x, w1, w2, top_k, backend, records_grad(x, w1, w2, router_logits)))
    if plan.plan is not None and plan.plan.decode and router_logits.dtype in TRITON_DTYPES:
        from flashmoe_science.moe import triton_decode

        # the routing inside the one decode launch
        out, launch = triton_decode.decode_forward(x, w1, w2, router_logits, None, top_k, route=True,
                                                   renormalize=renormalize, sigmoid=scoring == "sigmoid")
        _remember(key, x, lambda: triton_decode.PreparedDecode(launch))
        return out
    topk_weights, topk_ids = route(router_logits, top_k, renormalize, scoring)  # well-formed by construction
    return run_experts(plan, x, w1, w2, topk_weights, topk_ids, key,
                       wrap_prepared=lambda forward: RoutedForward(forward, top_k, renormalize, scoring))


def run_experts(plan: Choice, x, w1, w2, topk_weights, topk_ids, key: tuple | None = None,
                wrap_prepared=lambda prepared: prepared):
    """The experts on checked inputs, as ``plan`` (``plan_experts``') says. An inference call with a prepared-call
    ``key`` leaves its launches in ``PREPARED`` for the next call of its signature (``wrap_prepared`` wraps a batched
    forward's PreparedForward for a fused_moe key: the routing runs first)."""
    kernels = plan.plan
    if kernels is None:
        return fused_experts_reference(x, w1, w2, topk_weights, topk_ids)
    if kernels.trains:
        return FusedExperts.apply(x, w1, w2, topk_weights, topk_ids, kernels)
    from flashmoe_science.moe import layer, triton_decode

    # Inference: skip autograd's bookkeeping, a measurable share of host time on few tokens.
    weights32 = topk_weights.float().contiguous()
    if kernels.decode:
        out, launch = triton_decode.decode_forward(x, w1, w2, weights32, topk_ids, topk_ids.shape[1])
        _remember(key, x, lambda: triton_decode.PreparedDecode(launch))
        return out
    out, _ = layer.moe_forward(x, w1, w2, weights32, topk_ids, kernels)
    _remember(key, x, lambda: wrap_prepared(layer.prepare_forward(x, w1, w2, weights32, topk_ids, kernels)))
    return out


def _check_fp8_weights(x, w1, w1_scale, w2, w2_scale) -> tuple[int, int, int, int]:
    if w1_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w1_scale and w2_scale (one was None)")
    return check_fp8_experts(x, w1, w1_scale, w2, w2_scale)


def experts_fp8(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, backend: str):
    """``fused_experts`` with FP8 experts: checks (forward only), plan, run."""
    num_tokens, _, _, _ = _check_fp8_weights(x, w1, w1_scale, w2, w2_scale)
    check_topk(topk_weights, topk_ids, num_tokens, x)
    check_forward_only(x, w1, w2, w1_scale, w2_scale, topk_weights)
    plan = plan_fp8_experts(Fp8ExpertsProblem(x, w1, w1_scale, w2, w2_scale, topk_ids.shape[1], backend))
    return run_fp8_experts(plan, x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids)


def moe_fp8(x, w1, w1_scale, w2, w2_scale, router_logits, top_k, renormalize, scoring, backend: str):
    """``fused_moe`` with FP8 experts: checks (forward only), plan, routing, run."""
    num_tokens, _, num_experts, _ = _check_fp8_weights(x, w1, w1_scale, w2, w2_scale)
    check_router_logits(router_logits, num_tokens, num_experts)
    check_same_device("router_logits", router_logits, x)
    check_top_k(top_k, num_experts)
    check_routing_options(renormalize, scoring)
    check_forward_only(x, w1, w2, w1_scale, w2_scale, router_logits)
    plan = plan_fp8_experts(Fp8ExpertsProblem(x, w1, w1_scale, w2, w2_scale, top_k, backend))
    topk_weights, topk_ids = route(router_logits, top_k, renormalize, scoring)
    return run_fp8_experts(plan, x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids)


# ------------------------------------------------------------------------------------------ prepared calls
PREPARED: dict[tuple, object] = prepared_table("MoE calls")


def _remember(key: tuple | None, x, make_prepared) -> None:
    """Keep ``make_prepared()`` under ``key`` for the next call of its signature (compiled kernels only: not under
    the interpreter)."""
    if key is None or not x.is_cuda or x.shape[0] == 0:
        return
    remember(PREPARED, key, make_prepared())


class RoutedForward:
    """A fused_moe key's prepared call on the batched path: the routing, then the PreparedForward."""

    __slots__ = ("forward", "top_k", "renormalize", "scoring")

    def __init__(self, forward, top_k: int, renormalize: bool, scoring: str):
        self.forward, self.top_k, self.renormalize, self.scoring = forward, top_k, renormalize, scoring

    def __call__(self, x, w1, w2, router_logits):
        # the routing's outputs (dtypes, (T, k) shapes, fresh allocations) follow from the logits' signature
        topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize, self.scoring)
        return self.forward(x, w1, w2, topk_weights.float().contiguous(), topk_ids)


def _signatures(*tensors) -> tuple | None:
    """Each tensor's shape, strides, dtype, device and 16-byte alignment (all that the checks, the plan and the
    kernels' specialisation read from it), or None where one is not a tensor or autograd records the call."""
    grad_enabled = torch.is_grad_enabled()
    key = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (grad_enabled and t.requires_grad):
            return None
        key.append(tensor_signature(t))
    return tuple(key)


def experts_key(x, w1, w2, topk_weights, topk_ids, backend) -> tuple | None:
    """A ``fused_experts`` call's prepared-call key, or None where it must take the full path (autograd, or a
    backend that is no str)."""
    if backend.__class__ is not str:
        return None
    signatures = _signatures(x, w1, w2, topk_weights, topk_ids)
    return None if signatures is None else ("experts", backend, *signatures)


def moe_key(x, w1, w2, router_logits, top_k, renormalize, scoring, backend) -> tuple | None:
    """A ``fused_moe`` call's prepared-call key, or None where it must take the full path: autograd, or arguments
    of types whose equality would hide a failing check (True == 1)."""
    if (top_k.__class__ is not int or renormalize.__class__ is not bool or scoring.__class__ is not str
            or backend.__class__ is not str):
        return None
    signatures = _signatures(x, w1, w2, router_logits)
    return None if signatures is None else ("moe", top_k, renormalize, scoring, backend, *signatures)
