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
