"""Shared helpers for the MoE tests: inputs, the same-dtype PyTorch baseline, the error budget."""

import torch
import torch.nn.functional as F

from flashmoe_science.moe.dispatch import sort_pairs_by_expert
from flashmoe_science.moe.reference import fused_experts_reference


def make_experts(num_tokens, d_model, d_ff, num_experts, dtype, device="cpu"):
    """Random x (T, d), w1 (E, 2F, d), w2 (E, d, F) scaled so every stage is O(1)."""
    x = torch.randn(num_tokens, d_model, device=device).to(dtype)
    w1 = (torch.randn(num_experts, 2 * d_ff, d_model, device=device) / d_model**0.5).to(dtype)
    w2 = (torch.randn(num_experts, d_model, d_ff, device=device) / d_ff**0.5).to(dtype)
    return x, w1, w2


def torch_loop_same_dtype(x, w1, w2, topk_weights, topk_ids):
    """What a user gets from PyTorch ops in x.dtype (a per-expert loop): the baseline for the error budget."""
    d_ff = w1.shape[1] // 2
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in range(w1.shape[0]):
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        x_e = x[token_idx]
        h = F.silu(x_e @ w1[expert, :d_ff].T) * (x_e @ w1[expert, d_ff:].T)
        y = (h @ w2[expert].T) * weights[token_idx, slot_idx].unsqueeze(-1)
        out = out.index_add(0, token_idx, y)
    return out


def reference64(x, w1, w2, topk_weights, topk_ids):
    return fused_experts_reference(x.double(), w1.double(), w2.double(), topk_weights.double(), topk_ids)


def assert_within_budget(name, ours, torch_same_dtype, ref64):
    """Our error vs float64 <= 2 x PyTorch's same-dtype error + a slack of a few ulps at the output's scale.

    The slack covers small cases where PyTorch happens to round (almost) exactly. In half precision the error is
    dominated by rounding of stored intermediates and one ulp suffices; in fp32 it is summation order alone,
    so a different but equally good order can land a few ulps away: 8 ulps (still ~1e-6 relative).
    """
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    finite = torch.isfinite(ref64)
    assert not torch.isnan(ours.double()[finite]).any(), f"{name}: NaN where the reference is finite"
    if ref64.numel() == 0:
        return
    ours_err = (ours.double() - ref64).abs().max().item()
    torch_err = (torch_same_dtype.double() - ref64).abs().max().item()
    ulps = 8.0 if ours.dtype == torch.float32 else 1.0
    slack = ulps * torch.finfo(ours.dtype).eps * ref64.abs().max().item() + 1e-12
    assert ours_err <= 2 * torch_err + slack, (
        f"{name}: max error {ours_err:.3e} exceeds 2 x PyTorch {ours.dtype} error {torch_err:.3e} + {slack:.1e}"
    )


def weight_gradient_operands(counts, M, N, block_m, dtype, device="cpu"):
    """A weight-gradient GEMM's inputs: a sort whose expert e holds counts[e] rows, sorted-row operands a (rows, M)
    and b (rows, N) whose padding rows are NaN (a kernel must mask them out), and the float64 reference
    out[e] = a_e^T b_e. Returns (sort, a, b, reference)."""
    num_experts = len(counts)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel())][:, None].to(device)  # top_k = 1
    sort = sort_pairs_by_expert(ids, num_experts, block_m)
    assert sort.expert_counts.tolist() == list(counts)
    num_rows = sort.tile_expert.numel() * block_m
    a = torch.full((num_rows, M), float("nan"), dtype=dtype, device=device)
    b = torch.full((num_rows, N), float("nan"), dtype=dtype, device=device)
    ref = torch.zeros(num_experts, M, N, dtype=torch.float64, device=device)
    for expert, count in enumerate(counts):
        start = int(sort.expert_row_start[expert])
        rows = slice(start, start + count)
        a[rows] = torch.randn(count, M, device=device).to(dtype)
        b[rows] = torch.randn(count, N, device=device).to(dtype)
        ref[expert] = a[rows].double().T @ b[rows].double()
    return sort, a, b, ref


# every kernel entry a GEMM runner of moe/gemms.py or moe/hopper/backend.py may call, by the module it is looked up in
_TRITON_GEMM_LAUNCHES = ("up_swiglu_launch", "down_forward_launch", "dh_launch", "swiglu_backward_launch",
                         "dx_launch", "dw1_launch", "dw2_launch")
_GLUON_KERNELS = {"dx_sm90": ("down_sm90", "dh_swiglu_sm90", "dx_sm90"), "wgrad_sm90": ("wgrad_sm90",)}


def spy_on_gemm_kernels(monkeypatch, gluon=False) -> set:
    """The names (``triton_gemm.dx_launch``, ``dx_sm90.dx_sm90``, ...) of the GEMM kernels the layer calls from now
    on, as ``describe_moe`` writes them, collected into the returned set."""
    from flashmoe_science.moe import gemms

    ran = set()

    def spy(module, name, function):
        def called(*args, **kwargs):
            ran.add(f"{module}.{name}")
            return function(*args, **kwargs)
        return called

    for name in _TRITON_GEMM_LAUNCHES:
        monkeypatch.setattr(gemms, name, spy("triton_gemm", name, getattr(gemms, name)))
    if gluon:
        from flashmoe_science.moe.hopper import dx_sm90, wgrad_sm90

        for module in (dx_sm90, wgrad_sm90):
            short = module.__name__.rsplit(".", 1)[1]
            for name in _GLUON_KERNELS[short]:
                monkeypatch.setattr(module, name, spy(short, name, getattr(module, name)))
    return ran


def described_kernels(description: str) -> set:
    """The GEMM kernels a ``describe_moe`` text says run (the names ``spy_on_gemm_kernels`` collects)."""
    import re

    return set(re.findall(r"\b(?:triton_gemm|dx_sm90|wgrad_sm90)\.\w+", description))
