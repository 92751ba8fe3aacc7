"""The MoE layer on a handful of tokens in one Triton launch: no sort, no (T·k, F) intermediate, no second GEMM.

On one token a layer reads top_k experts' weights once and does almost no arithmetic, so its time is bytes over
bandwidth plus what stands between kernels. The batched path (sort, GEMM1, GEMM2: ``triton_gemm``) pays five to
seven launches and their gaps for it; at Qwen3-30B-A3B shapes (75 MB of weights, 17.6 µs at 4.3 TB/s) the gaps
cost as much as the reading (docs/perf-notes.md). Here one program per (token, slot, F slice):

1. the slot's expert and weight: from ``topk_ids``/``topk_weights``, or (``ROUTE``) recomputed from the router
   logits by every program of the token, with the routing kernel's own helpers (``triton_routing._scores``,
   ``_top_k``): E scores cost less than a launch;
2. gate and up for its ``BLOCK_F`` rows of w1[e] against x[token], h = silu(gate) * up rounded to the input
   dtype as the batched path's h is;
3. its partial output ``weight * h @ w2[e][:, F slice]^T`` (d values) added with float32 atomics into the token's
   row of a zeroed accumulator;
4. the token's last program to arrive (an acq_rel counter per token) converts that row to the output dtype.

Every weight byte is read by exactly one program, and a token's T·k·slices programs run concurrently, so the
kernel streams the weights once at close to memory bandwidth. Tokens that share an expert read its weights again
(from L2 when their programs are close in time), so the path is for a few tokens only (``decode_applies``).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashmoe_science.device import check_interpreter_operands, dot_precision
from flashmoe_science.moe.launch import Launch
from flashmoe_science.moe.triton_gemm import _gate_up_columns
from flashmoe_science.moe.triton_routing import MAX_EXPERTS, _scores, _top_k

# The decode path takes layers with at most this many tokens. H200, benchmarks/tools/sweep_moe_decode_tiles.py, CUDA-graph
# medians, decode vs the batched path: Qwen3-30B-A3B T=1 37.5 vs 45.3 us, T=2 60.5 vs 68.6, T=4 99.1 vs 100.9;
# Mixtral-8x7B T=1 189 vs 192, T=2 344 vs 354, T=4 659 vs 356 (tokens sharing an expert read its weights again)
MAX_DECODE_TOKENS = 2


def decode_applies(num_tokens: int, num_experts: int) -> bool:
    """Whether ``decode_forward`` takes a layer of this many tokens and experts."""
    return 0 < num_tokens <= MAX_DECODE_TOKENS and num_experts <= MAX_EXPERTS


@triton.jit
def _decode_moe_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    acc_ptr,
    arrivals_ptr,
    routing_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    d_model,
    d_ff,
    stride_xt,
    stride_xd,
    stride_w1e,
    stride_w1f,
    stride_w1d,
    stride_w2e,
    stride_w2d,
    stride_w2f,
    stride_ot,
    stride_rt,
    stride_rk,
    stride_it,
    stride_ik,
    TOP_K: tl.constexpr,
    ROUTE: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """routing_ptr: the router logits (T, E) with ROUTE, else the routing weights (T, k) (ids_ptr: their ids).
    acc (T, d) float32 and arrivals (T,) int32 must be zero."""
    slices = tl.cdiv(d_ff, BLOCK_F)
    pid = tl.program_id(0)
    token = pid // (TOP_K * slices)
    slot = (pid // slices) % TOP_K
    f_slice = pid % slices

    if ROUTE:
        experts = tl.arange(0, E_POW2)
        scores, valid = _scores(routing_ptr, token + tl.arange(0, 1), experts, num_tokens, num_experts, stride_rt,
                                stride_rk, SIGMOID)
        weights, ids = _top_k(scores, valid, experts, TOP_K, K_POW2, RENORMALIZE)
        mine = tl.arange(0, K_POW2)[None, :] == slot
        weight = tl.sum(tl.where(mine, weights, 0.0))
        expert = tl.sum(tl.where(mine, ids, 0))
    else:
        weight = tl.load(routing_ptr + token * stride_rt + slot * stride_rk).to(tl.float32)
        expert = tl.load(ids_ptr + token * stride_it + slot * stride_ik).to(tl.int32)

    row = token.to(tl.int64)
    if (expert >= 0) & (expert < num_experts):  # ids outside [0, E) are dropped slots
        # Both products on the tensor cores with x as row 0 of a 16-row tile (the smallest MMA; the other rows are
        # masked, so they cost no memory traffic): the loads then feed tl.dot, which Triton pipelines through
        # shared memory (num_stages), and a weight element costs a share of one MMA instead of a convert and an FMA
        # per element. A CUDA-core GEMV took 254 registers at 12% occupancy and streamed 2.2 TB/s.
        tile_rows = tl.arange(0, 16)
        x_row = tile_rows[:, None] == 0
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + row * stride_xt + ks[None, :] * stride_xd
        w_ptrs, f_valid = _gate_up_columns(w1_ptr + expert.to(tl.int64) * stride_w1e, f_slice, ks, d_ff,
                                           stride_w1f, stride_w1d, BLOCK_F)
        acc = tl.zeros([16, 2 * BLOCK_F], dtype=tl.float32)
        for k0 in range(0, d_model, BLOCK_K):
            k_valid = (k0 + ks) < d_model
            a = tl.load(x_ptrs, mask=x_row & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & f_valid[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xd
            w_ptrs += BLOCK_K * stride_w1d
        gate, up = tl.split(tl.reshape(acc, [16, BLOCK_F, 2]))
        h = (gate * tl.sigmoid(gate) * up).to(w2_ptr.dtype.element_ty)  # rounded as the batched path's h; past F: 0

        # weight * h @ w2[e][:, F slice]^T, BLOCK_D outputs at a time, added into the token's accumulator row
        fs = f_slice * BLOCK_F + tl.arange(0, BLOCK_F)
        ds = tl.arange(0, BLOCK_D)
        w2_ptrs = w2_ptr + expert.to(tl.int64) * stride_w2e + fs[:, None] * stride_w2f + ds[None, :] * stride_w2d
        acc_ptrs = acc_ptr + row * d_model + tile_rows[:, None] * 0 + ds[None, :]
        for d0 in range(0, d_model, BLOCK_D):
            d_valid = (d0 + ds) < d_model
            w = tl.load(w2_ptrs, mask=(fs < d_ff)[:, None] & d_valid[None, :], other=0.0)
            part = tl.dot(h, w, input_precision=DOT_PRECISION) * weight
            tl.atomic_add(acc_ptrs, part, mask=x_row & d_valid[None, :], sem="relaxed")
            w2_ptrs += BLOCK_D * stride_w2d
            acc_ptrs += BLOCK_D

    # the token's last program converts its row: every program's atomics happen before its arrival (the barrier
    # orders the CTA's threads, the acq_rel atomic publishes them), and the last arrival acquires them all
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
    if arrived == TOP_K * slices - 1:
        ds = tl.arange(0, BLOCK_D)
        for d0 in range(0, d_model, BLOCK_D):
            d_valid = (d0 + ds) < d_model
            total = tl.load(acc_ptr + row * d_model + d0 + ds, mask=d_valid, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + row * stride_ot + d0 + ds, total.to(out_ptr.dtype.element_ty), mask=d_valid)


class DecodeConfig(NamedTuple):
    block_f: int  # F rows per program (its slice of gate, up and w2's columns)
    block_k: int  # d columns per step of the gate/up product
    block_d: int  # d rows per step of the w2 product (and of the final conversion)
    num_warps: int
    num_stages: int


def decode_config(itemsize: int = 2) -> DecodeConfig:
    """H200, benchmarks/tools/sweep_moe_decode_tiles.py: 64-row F slices (128 contiguous bytes of each w2 row per load),
    128-wide K steps, 4 stages were the best or within 3% of it at Qwen3-30B-A3B and Mixtral-8x7B shapes, T = 1 and
    2. float32 operands halve the slice so that a stage still fits shared memory."""
    return DecodeConfig(block_f=64 if itemsize <= 2 else 32, block_k=128, block_d=256, num_warps=4, num_stages=4)


def decode_launch(x, w1, w2, out, acc, arrivals, routing, ids, top_k: int, route: bool, renormalize: bool,
                  sigmoid: bool, config: DecodeConfig) -> Launch:
    """The decode kernel's launch (see ``decode_forward``); ``ids`` is ignored (pass ``routing``) when ``route``."""
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    args = (x, w1, w2, out, acc, arrivals, routing, ids, num_tokens, num_experts, d_model, d_ff,
            x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), w2.stride(0), w2.stride(1),
            w2.stride(2), out.stride(0), routing.stride(0), routing.stride(1), ids.stride(0), ids.stride(1))
    meta = dict(TOP_K=top_k, ROUTE=route, K_POW2=triton.next_power_of_2(top_k),
                E_POW2=triton.next_power_of_2(num_experts), SIGMOID=sigmoid, RENORMALIZE=renormalize,
                BLOCK_F=config.block_f, BLOCK_K=config.block_k, BLOCK_D=config.block_d, **dot_precision(x),
                num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (num_tokens * top_k * triton.cdiv(d_ff, config.block_f),)
    return Launch(_decode_moe_kernel, grid, args, meta)


def decode_buffers(x):
    """The output (T, d) in x's dtype, and the kernel's zeroed float32 accumulator (T, d) and int32 arrival
    counters (T,), both carved from one allocation (one fill kernel)."""
    num_tokens, d_model = x.shape
    workspace = torch.zeros(num_tokens * (d_model + 1), dtype=torch.float32, device=x.device)
    acc = workspace[:num_tokens * d_model].view(num_tokens, d_model)
    arrivals = workspace[num_tokens * d_model:].view(torch.int32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), acc, arrivals


def decode_forward(x, w1, w2, routing, ids, top_k: int, *, route: bool = False, renormalize: bool = True,
                   sigmoid: bool = False, config: DecodeConfig | None = None):
    """The MoE layer on already-checked tensors: x (T, d), w1 (E, 2F, d), w2 (E, d, F); either ``routing`` = the
    routing weights (T, top_k) with ``ids`` (T, top_k), or, with ``route``, ``routing`` = the router logits (T, E)
    (``ids`` unused) routed as ``routing.route`` routes them (``renormalize``, ``sigmoid``). Returns
    ``(out, launch)``: out (T, d) in x.dtype, and the Launch that made it (``PreparedDecode`` repeats it)."""
    check_interpreter_operands("x", x)
    if config is None:
        config = decode_config(w1.element_size())
    out, acc, arrivals = decode_buffers(x)
    launch = decode_launch(x, w1, w2, out, acc, arrivals, routing, routing if route else ids, top_k, route,
                           renormalize, sigmoid, config)
    launch()
    return out, launch


class PreparedDecode:
    """``decode_forward`` for one call signature: fresh buffers and one PreparedLaunch per call.
    ``prepared(x, w1, w2, routing[, ids])`` with the arguments of the call it was prepared from."""

    __slots__ = ("launch",)

    def __init__(self, launch: Launch):
        self.launch = launch.prepare()

    def __call__(self, x, w1, w2, routing, ids=None):
        out, acc, arrivals = decode_buffers(x)
        self.launch(x, w1, w2, out, acc, arrivals, routing, routing if ids is None else ids)
        return out
