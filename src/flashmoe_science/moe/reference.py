"""The MoE expert computation in plain PyTorch: the CPU path and the test oracle.

Semantics shared by every backend, for a token t routed to experts ``topk_ids[t, j]`` with weights
``topk_weights[t, j]``::

    gate, up = x[t] @ w1[e, :F].T, x[t] @ w1[e, F:].T
    out[t]   = sum_j topk_weights[t, j] * (silu(gate) * up) @ w2[e].T      with e = topk_ids[t, j]

An id outside ``[0, E)`` (for example -1) marks a dropped slot that contributes nothing; this is how
expert-parallel callers mask experts that live on another rank.
"""

import torch
import torch.nn.functional as F


def fused_experts_reference(x, w1, w2, topk_weights, topk_ids):
    """Loop over experts; computes in float32 (float64 for float64 inputs) and returns ``x.dtype``.

    Differentiable with respect to x, w1, w2 and topk_weights through ordinary autograd.
    """
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    out = x.new_zeros(x.shape, dtype=compute_dtype)
    weights = topk_weights.to(compute_dtype)
    for expert in range(num_experts):
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        x_e = x[token_idx].to(compute_dtype)
        w1_e = w1[expert].to(compute_dtype)
        gate = x_e @ w1_e[:d_ff].T
        up = x_e @ w1_e[d_ff:].T
        y_e = (F.silu(gate) * up) @ w2[expert].to(compute_dtype).T
        y_e = y_e * weights[token_idx, slot_idx].unsqueeze(-1)
        out = out.index_add(0, token_idx, y_e)
    return out.to(x.dtype)


def fused_experts_reference_backward(grad_out, x, w1, w2, topk_weights, topk_ids):
    """(dx, dw1, dw2, dtopk_weights) of ``fused_experts_reference`` without autograd (for callers where it is off,
    such as a custom op's implementation); the same loop over experts, in the same compute dtype."""
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    dout = grad_out.to(compute_dtype)
    dx = torch.zeros(x.shape, dtype=compute_dtype, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=compute_dtype, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=compute_dtype, device=x.device)
    dweights = torch.zeros(topk_weights.shape, dtype=compute_dtype, device=x.device)
    weights = topk_weights.to(compute_dtype)
    for expert in range(num_experts):
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        x_e, w1_e, w2_e = x[token_idx].to(compute_dtype), w1[expert].to(compute_dtype), w2[expert].to(compute_dtype)
        gate, up = x_e @ w1_e[:d_ff].T, x_e @ w1_e[d_ff:].T
        sig = torch.sigmoid(gate)
        act = gate * sig * up  # silu(gate) * up
        dout_e = dout[token_idx]
        dweights[token_idx, slot_idx] = (dout_e * (act @ w2_e.T)).sum(dim=-1)
        dy = dout_e * weights[token_idx, slot_idx].unsqueeze(-1)
        dw2[expert] = dy.T @ act
        dact = dy @ w2_e
        dgate = dact * up * sig * (1 + gate * (1 - sig))  # d silu(g) / dg = sig(g) (1 + g (1 - sig(g)))
        dgate_up = torch.cat((dgate, dact * gate * sig), dim=-1)
        dw1[expert] = dgate_up.T @ x_e
        dx = dx.index_add(0, token_idx, dgate_up @ w1_e)
    return dx.to(x.dtype), dw1.to(w1.dtype), dw2.to(w2.dtype), dweights.to(topk_weights.dtype)
