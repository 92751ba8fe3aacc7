"""The MoE calls as ``torch.library`` custom ops, for ``torch.compile`` (``custom_ops`` describes the scheme):
``moe_route`` and ``moe_route_backward``; ``fused_experts_forward`` -> (out, residuals for the backward) and
``fused_experts_backward``; and, for calls that record no gradient, ``fused_moe_inference`` /
``fused_experts_inference`` (no residuals saved; the few-token decode kernel with its fused routing). ``moe.api``
calls them while compiling."""

from __future__ import annotations

import torch
from torch import Tensor

from flashmoe_science.custom_ops import NAMESPACE, custom_op, empty_like_fake, laid_out_like, on_device
from flashmoe_science.moe import execute as moe_execute
from flashmoe_science.moe import routing
from flashmoe_science.moe.checks import (check_experts, check_router_logits, check_routing_options, check_top_k,
                                         check_topk)
from flashmoe_science.moe.dispatch import ExpertSort, max_row_tiles
from flashmoe_science.moe.plan import ExpertsProblem, plan_experts
from flashmoe_science.moe.reference import fused_experts_reference, fused_experts_reference_backward


# ------------------------------------------------------------------------------------------------------ routing
@custom_op(f"{NAMESPACE}::moe_route", mutates_args=())
def moe_route(router_logits: Tensor, top_k: int, renormalize: bool, scoring: str) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return moe_execute.route_checked(router_logits, top_k, renormalize, scoring)


@moe_route.register_fake
def _moe_route_fake(router_logits, top_k, renormalize, scoring):
    check_router_logits(router_logits)
    check_top_k(top_k, router_logits.shape[1])
    check_routing_options(renormalize, scoring)
    shape = (router_logits.shape[0], top_k)
    weights_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    return router_logits.new_empty(shape, dtype=weights_dtype), router_logits.new_empty(shape, dtype=torch.int64)


@custom_op(f"{NAMESPACE}::moe_route_backward", mutates_args=())
def moe_route_backward(grad_weights: Tensor, router_logits: Tensor, topk_ids: Tensor, renormalize: bool,
                       scoring: str) -> Tensor:
    if routing.routes_in_triton(router_logits):
        from flashmoe_science.moe import triton_routing

        return triton_routing.route_backward(router_logits, topk_ids, grad_weights, renormalize, scoring == "sigmoid")
    grad_logits = routing.route_reference_backward(router_logits, topk_ids, grad_weights, renormalize, scoring)
    return laid_out_like(grad_logits, router_logits)


@moe_route_backward.register_fake
def _moe_route_backward_fake(grad_weights, router_logits, topk_ids, renormalize, scoring):
    return empty_like_fake(router_logits)


def _route_setup_context(ctx, inputs, output):
    router_logits, _, renormalize, scoring = inputs
    _, topk_ids = output
    ctx.save_for_backward(router_logits, topk_ids)
    ctx.options = (renormalize, scoring)
    ctx.mark_non_differentiable(topk_ids)


def _route_autograd_backward(ctx, grad_weights, grad_ids):
    router_logits, topk_ids = ctx.saved_tensors
    return moe_route_backward(grad_weights, router_logits, topk_ids, *ctx.options), None, None, None


moe_route.register_autograd(_route_autograd_backward, setup_context=_route_setup_context)


# ------------------------------------------------------------------------------------------------------ experts
# The kernel layer's residuals, in this order: its expert sort's five tensors, then the SwiGLU pre-activations
# (gate_up) and output (h) by sorted row. The reference keeps none (its backward recomputes): empty tensors.
# The backward op plans the call again (a custom op passes tensors, not the forward's plan): the same planner on
# the same tensors, so the same plan.
_SORT_FIELDS = ("sorted_pair_ids", "pair_row", "tile_expert", "expert_counts", "expert_row_start")


def _residuals_fake(x, w1, w2, topk_ids, backend) -> list[Tensor]:
    """Tensors shaped as ``fused_experts_forward``'s residuals (every size follows from the shapes, none from the
    ids: dispatch.sort_buffers, layer.forward_buffers)."""
    plan = plan_experts(ExpertsProblem(x, w1, w2, topk_ids.shape[1], backend, training=True), gemms=False)
    if plan.plan is None:
        return _no_residuals(x)
    block_m, (num_tokens, top_k), num_experts = plan.plan.tiles.block_m, topk_ids.shape, w1.shape[0]
    num_tiles = max_row_tiles(num_tokens * top_k, num_experts, block_m)
    sizes = ((num_tiles * block_m,), (num_tokens * top_k,), (num_tiles,), (num_experts,), (num_experts,))
    sort = [x.new_empty(size, dtype=torch.int32) for size in sizes]
    rows, two_d_ff = num_tiles * block_m, w1.shape[1]
    return [*sort, x.new_empty((rows, two_d_ff)), x.new_empty((rows, two_d_ff // 2))]


def _no_residuals(x) -> list[Tensor]:
    return [x.new_empty((0,)) for _ in range(len(_SORT_FIELDS) + 2)]


# out, then the residuals (a fixed count: a list output would reach the backward as one gradient)
_EXPERTS_OUTPUTS = tuple[(Tensor,) * (1 + len(_SORT_FIELDS) + 2)]


@custom_op(f"{NAMESPACE}::fused_experts_forward", mutates_args=())
def fused_experts_forward(x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                          backend: str) -> _EXPERTS_OUTPUTS:
    """(out, *residuals): ``fused_experts`` for a call that records gradients, keeping what its backward needs."""
    plan = moe_execute.plan_experts_call(x, w1, w2, topk_weights, topk_ids, backend, training=True)
    if plan.plan is None:
        with torch.no_grad():
            return (fused_experts_reference(x, w1, w2, topk_weights, topk_ids), *_no_residuals(x))
    from flashmoe_science.moe import layer

    with on_device(x):
        out, saved = layer.moe_forward(x, w1, w2, topk_weights.float().contiguous(), topk_ids, plan.plan,
                                       save_for_backward=True)
    rows, two_d_ff = saved.sort.tile_expert.numel() * saved.plan.tiles.block_m, w1.shape[1]
    gate_up = saved.gate_up if saved.gate_up is not None else x.new_empty((rows, two_d_ff))  # None: no tokens
    h = saved.h if saved.h is not None else x.new_empty((rows, two_d_ff // 2))
    return (out, *(getattr(saved.sort, name) for name in _SORT_FIELDS), gate_up, h)


@fused_experts_forward.register_fake
def _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend):
    num_tokens, _, _, _ = check_experts(x, w1, w2)
    check_topk(topk_weights, topk_ids, num_tokens, x)
    return (x.new_empty(x.shape), *_residuals_fake(x, w1, w2, topk_ids, backend))


@custom_op(f"{NAMESPACE}::fused_experts_backward", mutates_args=())
def fused_experts_backward(grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                           topk_ids: Tensor, residuals: list[Tensor], backend: str) -> list[Tensor]:
    """[dx, dw1, dw2, dweights] of ``fused_experts_forward``."""
    plan = plan_experts(ExpertsProblem(x, w1, w2, topk_ids.shape[1], backend, training=True))
    if plan.plan is None:
        grads = fused_experts_reference_backward(grad_out, x, w1, w2, topk_weights, topk_ids)
        return [laid_out_like(g, t) for g, t in zip(grads, (x, w1, w2, topk_weights))]
    from flashmoe_science.moe import layer

    *sort_tensors, gate_up, h = residuals
    sort = ExpertSort(*sort_tensors, plan.plan.tiles.block_m, topk_ids.shape[1], topk_ids.numel())
    saved = layer.SavedForBackward(sort, plan.plan, gate_up, h)
    with on_device(x):
        dx, dw1, dw2, dweights = layer.moe_backward(grad_out, x, w1, w2, topk_weights.float().contiguous(), saved)
    return [dx, dw1, dw2, laid_out_like(dweights.to(topk_weights.dtype), topk_weights)]


@fused_experts_backward.register_fake
def _fused_experts_backward_fake(grad_out, x, w1, w2, topk_weights, topk_ids, residuals, backend):
    return [empty_like_fake(x), empty_like_fake(w1), empty_like_fake(w2), empty_like_fake(topk_weights)]


def _experts_setup_context(ctx, inputs, output):
    x, w1, w2, topk_weights, topk_ids, backend = inputs
    ctx.save_for_backward(x, w1, w2, topk_weights, topk_ids, *output[1:])
    ctx.backend = backend
    ctx.mark_non_differentiable(*output[1:])


def _experts_autograd_backward(ctx, grad_out, *grad_residuals):
    x, w1, w2, topk_weights, topk_ids, *residuals = ctx.saved_tensors
    dx, dw1, dw2, dweights = fused_experts_backward(grad_out, x, w1, w2, topk_weights, topk_ids, residuals,
                                                    ctx.backend)
    return dx, dw1, dw2, dweights, None, None


fused_experts_forward.register_autograd(_experts_autograd_backward, setup_context=_experts_setup_context)


@custom_op(f"{NAMESPACE}::fused_experts_inference", mutates_args=())
def fused_experts_inference(x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                            backend: str) -> Tensor:
    with torch.no_grad(), on_device(x):
        return moe_execute.experts(x, w1, w2, topk_weights, topk_ids, backend)


@fused_experts_inference.register_fake
def _fused_experts_inference_fake(x, w1, w2, topk_weights, topk_ids, backend):
    return _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend)[0]


@custom_op(f"{NAMESPACE}::fused_moe_inference", mutates_args=())
def fused_moe_inference(x: Tensor, w1: Tensor, w2: Tensor, router_logits: Tensor, top_k: int, renormalize: bool,
                        scoring: str, backend: str) -> Tensor:
    with torch.no_grad(), on_device(x):
        return moe_execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)


@fused_moe_inference.register_fake
def _fused_moe_inference_fake(x, w1, w2, router_logits, top_k, renormalize, scoring, backend):
    num_tokens, _, num_experts, _ = check_experts(x, w1, w2)
    check_router_logits(router_logits, num_tokens, num_experts)
    check_top_k(top_k, num_experts)
    check_routing_options(renormalize, scoring)
    return x.new_empty(x.shape)
