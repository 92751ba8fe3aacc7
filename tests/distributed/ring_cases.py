"""Ring-attention cases run in every rank of a gloo group (see dist_spawn.py): the sharded result against the
single-process one on the full sequence, outputs and gradients, float32 inputs vs a float64 dense oracle."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.distributed import (ring_attention, ring_attention_varlen, zigzag_positions, zigzag_shard,
                                          zigzag_unshard)



def tolerance() -> tuple[float, float]:
    """(atol, rtol) of float32 against float64: a few float32 ulps of the partial results and their merge on the CPU;
    on the GPU the kernels' float32 products are 3xTF32 and Triton float32 dots."""
    return (1e-4, 1e-3) if torch.get_default_device().type == "cuda" else (2e-5, 1e-4)


def dense_attention(q, k, v, causal, window, scale=None):
    """Materialised float64 attention on global positions: the oracle (a row that sees nothing gives zeros)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    i = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
    j = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    seen = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=q.device)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    scores = scores.masked_fill(~seen, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def check_close(name, got, expected):
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
    atol, rtol = tolerance()
    err = (got.double() - expected).abs().max().item() if got.numel() else 0.0
    if not torch.allclose(got.double(), expected, atol=atol, rtol=rtol):
        raise AssertionError(f"{name}: max abs error {err:.3g} (atol {atol}, rtol {rtol})")


def _compare(rank, world_size, *, seqlen, heads=(4, 4), causal, window=None, batch=2, head_dim=16, group=None,
             kv_exchange="allgather", grad_exchange="ring"):
    hq, hkv = heads
    q = torch.randn(batch, hq, seqlen, head_dim)
    k = torch.randn(batch, hkv, seqlen, head_dim)
    v = torch.randn(batch, hkv, seqlen, head_dim)
    grad = torch.randn(batch, hq, seqlen, head_dim)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = dense_attention(*full, causal, window)
    expected.backward(grad.double())
    local = [zigzag_shard(t, group).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, causal=causal, window=window, kv_exchange=kv_exchange,
                         grad_exchange=grad_exchange)
    out.backward(zigzag_shard(grad, group))
    check_close("out", out, zigzag_shard(expected.detach(), group))
    for name, t, ref in zip(("dq", "dk", "dv"), local, full):
        check_close(name, t.grad, zigzag_shard(ref.grad, group))


def ring_causal(rank, world_size):
    _compare(rank, world_size, seqlen=8 * world_size, causal=True)


def ring_noncausal_gqa(rank, world_size):
    _compare(rank, world_size, seqlen=6 * world_size, heads=(4, 2), causal=False)


def ring_ragged_causal(rank, world_size):
    # L not a multiple of 2W: chunks of unequal length, ranks of unequal length
    _compare(rank, world_size, seqlen=8 * world_size + 3, causal=True, heads=(2, 1))


def ring_exchange_around_the_ring(rank, world_size):
    # the forward's other exchange: K/V shards passed around the ring (double-buffered receives)
    _compare(rank, world_size, seqlen=8 * world_size, causal=True, kv_exchange="ring")
    _compare(rank, world_size, seqlen=8 * world_size + 3, causal=True, heads=(2, 1), kv_exchange="ring")
    _compare(rank, world_size, seqlen=10 * world_size, causal=False, window=(3, 7), heads=(2, 2), kv_exchange="ring")


def ring_gathered_backward(rank, world_size):
    # the backward's other exchange: K/V all-gathered, dK/dV accumulated in the gathered layout and reduce-scattered
    _compare(rank, world_size, seqlen=8 * world_size, causal=True, grad_exchange="allgather")
    _compare(rank, world_size, seqlen=8 * world_size + 3, causal=True, heads=(2, 1), grad_exchange="allgather")
    _compare(rank, world_size, seqlen=10 * world_size, causal=False, window=(3, 7), heads=(2, 2),
             kv_exchange="ring", grad_exchange="allgather")
    _compare(rank, world_size, seqlen=3, causal=True, batch=1, grad_exchange="allgather")  # ranks with no rows


def ring_tiny_sequence(rank, world_size):
    # fewer positions than chunks: some ranks hold one chunk or none
    _compare(rank, world_size, seqlen=3, causal=True, batch=1)


def ring_sliding_window(rank, world_size):
    _compare(rank, world_size, seqlen=10 * world_size + 1, causal=True, window=(5, -1))
    _compare(rank, world_size, seqlen=10 * world_size, causal=False, window=(3, 7), heads=(2, 2))
    _compare(rank, world_size, seqlen=7 * world_size, causal=False, window=(0, 2), heads=(2, 2))


def ring_return_lse_and_layout(rank, world_size):
    # (B, L, H, D) buffers viewed as (B, H, L, D); lse equals the single-process one
    q, k, v = (torch.randn(2, 6 * world_size, 4, 32) for _ in range(3))
    out, lse = ring_attention(*(zigzag_shard(t, dim=1).transpose(1, 2) for t in (q, k, v)), causal=True,
                              return_lse=True)
    ref_out, ref_lse = flash_attention_science(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, return_lse=True)
    gathered = zigzag_unshard(out)  # a collective: before any check can raise
    check_close("out", out.double(), zigzag_shard(ref_out.double(), dim=-2))
    check_close("lse", lse.double(), zigzag_shard(ref_lse.double(), dim=-1))
    check_close("unshard", gathered.double(), ref_out.double())
    positions = zigzag_positions(6 * world_size, world_size, rank)
    if not torch.equal(zigzag_shard(torch.arange(6 * world_size), dim=0), positions):
        raise AssertionError("zigzag_positions disagrees with zigzag_shard")


def ring_group_of_one(rank, world_size):
    # every rank in its own group: the local kernel, no communication
    groups = [dist.new_group([r]) for r in range(world_size)]
    _compare(rank, world_size, seqlen=9, causal=True, group=groups[rank])


def ring_bf16_error_within_twice_single(rank, world_size):
    # the quality bar: the ring's bf16 error against float64 at most ~2x that of one process's bf16 attention
    full = [torch.randn(1, 4, 48 * world_size + 5, 64, dtype=torch.float64) for _ in range(3)]
    grad = torch.randn_like(full[0])
    oracle = [t.clone().requires_grad_() for t in full]
    dense_attention(*oracle, True, None).backward(grad)
    single = [t.bfloat16().requires_grad_() for t in full]
    flash_attention_science(*single, causal=True).backward(grad.bfloat16())
    local = [zigzag_shard(t.bfloat16()).requires_grad_() for t in full]
    out = ring_attention(*local, causal=True)
    out.backward(zigzag_shard(grad.bfloat16()))
    expected_out = zigzag_shard(dense_attention(*full, True, None))
    single_out = zigzag_shard(flash_attention_science(*(t.bfloat16() for t in full), causal=True))
    pairs = [("out", out, single_out, expected_out)] + [
        (name, t.grad, zigzag_shard(s.grad), zigzag_shard(o.grad))
        for name, t, s, o in zip(("dq", "dk", "dv"), local, single, oracle)]
    for name, ours, theirs, expected in pairs:
        ours_err = (ours.double() - expected).abs().max().item()
        single_err = (theirs.double() - expected).abs().max().item()
        if ours_err > 2 * single_err + 1e-3:
            raise AssertionError(f"{name}: ring bf16 error {ours_err:.3g} > 2 x single-process {single_err:.3g}")


def _compare_varlen(rank, world_size, seqlens, *, causal, window=None, heads=(4, 2), head_dim=16, group=None,
                    grad_exchange="ring"):
    bounds = [0]
    for length in seqlens:
        bounds.append(bounds[-1] + length)
    hq, hkv = heads
    q = torch.randn(bounds[-1], hq, head_dim)
    k, v = torch.randn(bounds[-1], hkv, head_dim), torch.randn(bounds[-1], hkv, head_dim)
    grad = torch.randn_like(q)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = torch.cat([  # each sequence on its own, (L, H, D) <-> (H, L, D)
        dense_attention(*(t[a:b].transpose(0, 1) for t in full), causal, window).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])])
    expected.backward(grad.double())
    local = [zigzag_shard(t, group, dim=0, cu_seqlens=bounds).requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention_varlen(*local, torch.tensor(bounds), group, causal=causal, window=window,
                                     return_lse=True, grad_exchange=grad_exchange)
    out.backward(zigzag_shard(grad, group, dim=0, cu_seqlens=bounds))
    gathered = zigzag_unshard(out.detach(), group, dim=0, cu_seqlens=bounds)  # a collective: before any check
    if lse.shape != (hq, out.shape[0]):
        raise AssertionError(f"lse shape {tuple(lse.shape)}, expected {(hq, out.shape[0])}")
    check_close("out", out, zigzag_shard(expected.detach(), group, dim=0, cu_seqlens=bounds))
    check_close("unshard", gathered, expected.detach())
    for name, t, ref in zip(("dq", "dk", "dv"), local, full):
        check_close(name, t.grad, zigzag_shard(ref.grad, group, dim=0, cu_seqlens=bounds))


def ring_varlen(rank, world_size):
    # sequences shorter than the ring (empty chunks), of odd length, and a long one; causal, windowed, plain
    seqlens = [13, 3, 8 * world_size + 1, 1]
    _compare_varlen(rank, world_size, seqlens, causal=True)
    _compare_varlen(rank, world_size, seqlens, causal=True, window=(4, -1))
    _compare_varlen(rank, world_size, seqlens, causal=False, window=(2, 3), heads=(2, 2))
    _compare_varlen(rank, world_size, [5, 0, 7], causal=False)
    _compare_varlen(rank, world_size, seqlens, causal=True, grad_exchange="allgather")


def ring_varlen_group_of_one(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]
    _compare_varlen(rank, world_size, [9, 4], causal=True, group=groups[rank])


def _expect_error(fn, *fragments):
    try:
        fn()
    except (ValueError, TypeError) as error:
        if not all(f in str(error) for f in fragments):
            raise AssertionError(f"error {error!r} lacks {fragments}") from error
        return
    raise AssertionError(f"no error raised (expected one mentioning {fragments})")


def ring_bad_input(rank, world_size):
    q = torch.randn(1, 4, 6 + rank, 16)  # rank-dependent lengths: not a zig-zag split
    _expect_error(lambda: ring_attention(q, q, q, causal=True), "zig-zag split")
    heads = torch.randn(1, 2 + 2 * rank, 6, 16)  # ranks disagree on the head count
    _expect_error(lambda: ring_attention(heads, heads, heads), "disagree")
    q3, k2 = torch.randn(1, 3, 6, 16), torch.randn(1, 2, 6, 16)
    _expect_error(lambda: ring_attention(q3, k2, k2), "multiple of k's head count")
    _expect_error(lambda: ring_attention(q3, q3[..., :4, :], q3[..., :4, :]), "same positions")
    _expect_error(lambda: ring_attention(q3, q3, q3, window=(-2, 0)), "window")
    _expect_error(lambda: ring_attention(q3, q3, q3, kv_exchange="p2p"), "kv_exchange")
    _expect_error(lambda: ring_attention(q3, q3, q3, grad_exchange="p2p"), "grad_exchange")
    packed = torch.randn(6, 2, 16)  # 12 tokens in two sequences whose split depends on the rank
    _expect_error(lambda: ring_attention_varlen(packed, packed, packed, [0, 4 + rank, 12]), "disagree")


CASES = [name for name, value in list(globals().items())
         if name.startswith("ring_") and getattr(value, "__module__", None) == __name__]  # not the imported API
