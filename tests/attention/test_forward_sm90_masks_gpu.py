"""The Gluon sm_90 forward with windows, softcap, ALiBi and packed (varlen) batches, launched directly, against a
float64 reference built from the host view of the mask rules (mask.score_mods), with PyTorch's own bf16 error
(the same materialised attention in bf16) as the yardstick. Every output is NaN-poisoned first; rows past a packed
batch's last sequence must stay untouched (the ragged store).

Run on the H200: `PYTHONPATH=src python -m pytest -m gpu tests/attention/test_forward_sm90_masks_gpu.py`
(the `-k d64`, `-k d128`, `-k d256` slices compile independently and can run side by side).
"""

from __future__ import annotations

import pytest
import torch

from flashmoe_science.attention.mask import make_mask, score_mods
from flashmoe_science.attention.hopper.tiles import sm90_cross_item, sm90_forward_tiles, sm90_q_buffers
from flashmoe_science.attention.seqlen import VarlenBatch
from flashmoe_science.device import device_traits
from sm90_helpers import hopper_attention_module

pytestmark = pytest.mark.gpu

SENTINEL_ROWS = 40  # rows after a packed batch that no sequence owns


def _materialised(q, k, v, mask, scale, slopes, dtype):
    """Attention of one (1, H, L, D) sequence with the products in `dtype` (float64: the reference; bf16: what
    PyTorch's own bf16 attention rounds), the mask rules from mask.score_mods. Returns (out float64, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lq, lk = q.shape[2], k.shape[2]
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)).to(torch.float64) * scale
    s = score_mods(s, mask, lq, lk, slopes, None)  # causal is the window (left, 0): masked here too
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = p.to(dtype) @ v.to(dtype)
    return out.to(torch.float64), lse


def _check(out, lse, q, k, v, mask, scale, slopes):
    ref, ref_lse = _materialised(q, k, v, mask, scale, slopes, torch.float64)
    torch_out, _ = _materialised(q, k, v, mask, scale, slopes, q.dtype)
    assert torch.isfinite(out).all(), "NaN/inf (or an unwritten row) where the reference is finite"
    ours, theirs = (out.double() - ref).abs(), (torch_out - ref).abs()
    assert ours.pow(2).mean().sqrt() <= 2 * theirs.pow(2).mean().sqrt() + 1e-4
    assert ours.max() <= 2 * theirs.max() + 1e-3
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key: lse -inf, the others finite"
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 2e-2 if seen.any() else True
    assert (out[~seen] == 0).all()


def _plan(fwd_sm90, head_dim, mask, seqlen_q, two_stage=False):
    """The launch options the api plans for this mask (a right bound plans as causal does); two_stage: the
    non-causal plan's ring (two stages, two Q buffers where they fit, items not overlapped) whatever the mask."""
    right_bounded = mask.bounded_right and not two_stage
    tiles = sm90_forward_tiles(head_dim, right_bounded, seqlen_q)
    traits = device_traits(torch.device("cuda"))
    q_buffers = sm90_q_buffers(tiles, head_dim, True, traits)
    cross_item = sm90_cross_item(tiles, head_dim, right_bounded, True, q_buffers) and not two_stage
    return tiles, traits.sm_count, q_buffers, cross_item


def _slopes(batch, heads):
    return (torch.rand(batch, heads, device="cuda") * 0.3 + 0.01).float()


# (causal, window, softcap, alibi): every mask feature alone and combined
MASKS = {
    "window": (False, (100, 37), None, False),
    "left": (False, (257, -1), None, False),
    "right": (False, (-1, 5), None, False),
    "causal_window": (True, (300, -1), None, False),
    "softcap": (False, None, 5.0, False),
    "alibi": (False, None, None, True),
    "causal_alibi": (True, None, None, True),
    "window_alibi": (False, (100, 37), None, True),
    "causal_alibi_softcap": (True, None, 3.0, True),
    "all": (True, (200, -1), 4.0, True),
}
# d64 with the two-stage ring: 128-key tiles, so 192-row items on three consumer warpgroups (the causal plan at
# these short lengths takes 64-key tiles on two)
HEAD_DIM_MASKS = [("d128", 128, name, False) for name in MASKS] + [
    (f"d{d}", d, name, False) for d in (64, 256) for name in ("causal_window", "all")] + [
    ("d128", 128, name, True) for name in ("causal_window", "window")] + [
    ("d64", 64, name, True) for name in ("window", "causal_window", "softcap", "causal_alibi", "all")]


@pytest.mark.parametrize("ids,head_dim,mask_name,two_stage", HEAD_DIM_MASKS,
                         ids=[f"{a}-{c}" + ("-two_stage" if t else "") for a, _, c, t in HEAD_DIM_MASKS])
@pytest.mark.parametrize("lq,lk", [(700, 700), (333, 650)], ids=["square", "cross"])
def test_dense_masks(ids, head_dim, mask_name, two_stage, lq, lk):
    fwd_sm90 = hopper_attention_module("fwd_sm90")
    causal, window, softcap, alibi = MASKS[mask_name]
    mask = make_mask(causal, window, softcap)
    b, hq, hkv, scale = 2, 4, 2, head_dim**-0.5
    q = torch.randn(b, hq, lq, head_dim, device="cuda").bfloat16()
    k, v = (torch.randn(b, hkv, lk, head_dim, device="cuda").bfloat16() for _ in range(2))
    slopes = _slopes(b, hq) if alibi else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    tiles, num_ctas, q_buffers, cross_item = _plan(fwd_sm90, head_dim, mask, lq, two_stage)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, scale, tiles, num_ctas, q_buffers, cross_item,
                                    mask=mask, alibi_slopes=slopes)
    for i in range(b):
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1], mask, scale,
               None if slopes is None else slopes[i:i + 1])


@pytest.mark.parametrize("head_dim", [160, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rescale_skips_follow_maxima_that_move_late(head_dim, causal):
    """At head dims padding to 256 a warp branches past O's rescale where none of its rows' maxima moved
    (tiles.sm90_forward_skip_rescale): scores that grow along the keys, and a few keys late in the sequence with
    large logits, move the maxima of some warps' rows in tiles where the other warps skip, and the output and lse
    are the reference's."""
    fwd_sm90 = hopper_attention_module("fwd_sm90")
    lq = lk = 1500
    mask = make_mask(causal, None, None)
    b, hq, hkv, scale = 1, 4, 2, head_dim**-0.5
    g = torch.Generator(device="cuda").manual_seed(7)
    q = (torch.randn(b, hq, lq, head_dim, device="cuda", generator=g) * 2).bfloat16()
    ramp = torch.linspace(0.2, 3.0, lk, device="cuda").view(1, 1, lk, 1)
    k = torch.randn(b, hkv, lk, head_dim, device="cuda", generator=g) * ramp
    k[:, :, 900::97] *= 6  # late keys whose logits pass every earlier max
    k = k.bfloat16()
    v = torch.randn(b, hkv, lk, head_dim, device="cuda", generator=g).bfloat16()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    tiles, num_ctas, q_buffers, cross_item = _plan(fwd_sm90, head_dim, mask, lq)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, scale, tiles, num_ctas, q_buffers, cross_item,
                                    mask=mask)
    _check(out, lse, q, k, v, mask, scale, None)


def _packed(lengths, heads, head_dim):
    """A packed (total + SENTINEL_ROWS, H, D) tensor and its cumulative lengths (int32)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    x = torch.randn(int(cu[-1]) + SENTINEL_ROWS, heads, head_dim, device="cuda").bfloat16()
    return x, cu.cuda()


VARLEN_CASES = [("d128", 128, name, False) for name in ("plain", "causal", "causal_window", "softcap", "causal_alibi",
                                                       "all")] + [
    (f"d{d}", d, name, False) for d in (64, 256) for name in ("causal", "all")] + [("d128", 128, "causal", True)] + [
    ("d64", 64, name, False) for name in ("plain", "softcap")] + [("d64", 64, name, True) for name in ("causal", "all")]
VARLEN_MASKS = {"plain": (False, None, None, False), "causal": (True, None, None, False), **MASKS}


@pytest.mark.parametrize("ids,head_dim,mask_name,two_stage", VARLEN_CASES,
                         ids=[f"{a}-{c}" + ("-two_stage" if t else "") for a, _, c, t in VARLEN_CASES])
@pytest.mark.parametrize("gqa", [1, 2], ids=["mha", "gqa"])
def test_varlen(ids, head_dim, mask_name, two_stage, gqa):
    """Ragged batches: lengths 0, 1, odd, one tile, > 4 tiles; keys of other lengths than the queries (cross), a
    sequence with queries but no keys. Each sequence against its own dense reference; LSE packed (H, total_q)."""
    fwd_sm90 = hopper_attention_module("fwd_sm90")
    causal, window, softcap, alibi = VARLEN_MASKS[mask_name]
    mask = make_mask(causal, window, softcap)
    lengths_q = [0, 1, 77, 128, 129, 601, 0, 300, 5]
    lengths_k = [3, 1, 77, 200, 129, 601, 9, 0, 5]
    hq, hkv, scale = 4, 4 // gqa, head_dim**-0.5
    q_packed, cu_q = _packed(lengths_q, hq, head_dim)
    k_packed, cu_k = _packed(lengths_k, hkv, head_dim)
    v_packed = torch.randn_like(k_packed)
    total_q = int(cu_q[-1])
    # (1, H, rows, D) views; the kernel sees only the first total rows
    as4d = lambda t, n: t[:n].permute(1, 0, 2).unsqueeze(0)  # noqa: E731
    q, k, v = as4d(q_packed, total_q), as4d(k_packed, int(cu_k[-1])), as4d(v_packed, int(cu_k[-1]))
    out_packed = torch.full_like(q_packed, float("nan"))
    out = as4d(out_packed, total_q)
    lse = torch.full((hq, total_q), float("nan"), device="cuda")
    slopes = _slopes(len(lengths_q), hq) if alibi else None
    tiles, num_ctas, q_buffers, cross_item = _plan(fwd_sm90, head_dim, mask, max(lengths_q), two_stage)
    batch = VarlenBatch.of(cu_q, cu_k, tiles.block_m, q.shape[2], mask.plain_causal)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse.unsqueeze(0), causal, scale, tiles, num_ctas, q_buffers,
                                    cross_item, mask=mask, alibi_slopes=slopes, varlen=batch)
    assert torch.isnan(out_packed[total_q:]).all(), "a store ran past the last sequence"
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b]) + lq)
        keys = slice(int(cu_k[b]), int(cu_k[b]) + lk)
        seq = lambda t, r: t[r].permute(1, 0, 2).unsqueeze(0)  # noqa: E731
        if lk == 0:
            assert (out_packed[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
            continue
        _check(seq(out_packed, rows), lse[:, rows].unsqueeze(0), seq(q_packed, rows), seq(k_packed, keys),
               seq(v_packed, keys), mask, scale, None if slopes is None else slopes[b:b + 1])


@pytest.mark.parametrize("mask_name", ["causal", "all"])
def test_api_keeps_hopper_d128(mask_name):
    """The front doors on Hopper: backend='auto' runs the sm_90 kernel for windows, softcap, ALiBi and a packed
    batch, and the packed output equals each sequence's own dense call (which the dense tests check)."""
    hopper_attention_module("fwd_sm90")
    from flashmoe_science import flash_attention_science, flash_attention_varlen
    from flashmoe_science.attention.api import describe_dispatch
    from flashmoe_science.attention.varlen import describe_varlen_dispatch

    causal, window, softcap, alibi = VARLEN_MASKS[mask_name]
    lengths = [1, 300, 0, 513]
    q_packed, cu = _packed(lengths, 4, 128)
    k_packed, v_packed = torch.randn_like(q_packed), torch.randn_like(q_packed)
    total = int(cu[-1])
    q, k, v = q_packed[:total], k_packed[:total], v_packed[:total]
    slopes = (torch.rand(4, device="cuda") * 0.2).float() if alibi else None
    kwargs = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    plan = describe_varlen_dispatch(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)
    assert plan.backend == "hopper", plan.reason
    out, lse = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), return_lse=True, **kwargs)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b]) + n)
        seq = lambda t: t[rows].transpose(0, 1).unsqueeze(0)  # noqa: E731
        assert describe_dispatch(seq(q), seq(k), seq(v), **kwargs).backend == "hopper"
        dense, dense_lse = flash_attention_science(seq(q), seq(k), seq(v), return_lse=True, **kwargs)
        # equal up to rounding: a short sequence alone may plan other key tiles (sm90_forward_tiles)
        torch.testing.assert_close(out[rows], dense[0].transpose(0, 1), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[:, rows], dense_lse[0], atol=1e-3, rtol=0)
