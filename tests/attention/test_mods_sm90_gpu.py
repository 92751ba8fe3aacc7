"""The sm_90 Gluon forward and backward with a user mask_mod on a Hopper GPU: every mask of bench/mask_mods.py at
odd shapes (lengths off the tiles, GQA; packed batches with a length-1 and an empty sequence) against the float64
oracle of their torch twins (out, lse, and dQ, dK, dV through autograd), and the forward against the Triton mod
forward within bf16 error."""

from __future__ import annotations

import pytest
import torch

from feature_oracle import assert_within_rule, check_forward_and_grads
from flashmoe_science import flash_attention_science, flash_attention_varlen
from flashmoe_science.bench.mask_mods import mask_cases
from helpers import randn
from mod_cases import mod_oracle
from sm90_helpers import hopper_attention_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NAMES = ("document window", "prefix-LM", "head windows", "neighbour list")
BATCH, HEADS, KV_HEADS = 2, 8, 2  # within the masks' tables (bench.mask_mods: 4 rows, 16 heads); GQA 4


def _case(name, length):
    hopper_attention_module("fwd_sm90")  # skips off Hopper
    return next(case for case in mask_cases(length, "cuda") if case[0] == name)


def _seen(flex, lq, lk, batch=BATCH):
    """The twin's visibility (BATCH, HEADS, lq, lk), on the host."""
    q = torch.arange(lq, device="cuda")[:, None]
    kv = torch.arange(lk, device="cuda")[None, :]
    return torch.stack([torch.stack([flex(b, h, q, kv) for h in range(HEADS)]) for b in range(batch)]).cpu()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_dense_against_float64_and_the_triton_forward(name, head_dim, causal):
    lq = lk = 1000  # not a multiple of any tile
    _, mod, flex, _ = _case(name, lk)
    q = randn(BATCH, HEADS, lq, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    out, lse = flash_attention_science(q, k, v, causal=causal, mask_mod=mod, return_lse=True, backend="hopper")
    seen = _seen(flex, lq, lk)
    if causal:
        seen = seen & torch.ones(lq, lk, dtype=torch.bool).tril()
    _check_dense(out, lse, q, k, v, seen, None)
    triton_out = flash_attention_science(q, k, v, causal=causal, mask_mod=mod, backend="triton")
    torch.testing.assert_close(out, triton_out, rtol=2e-2, atol=2e-2)


def _check_dense(out, lse, q, k, v, seen, twin):
    """out and lse of a dense bf16 call against the float64 oracle of `seen` and the score twin."""
    ref, ref_lse = mod_oracle(q.cpu(), k.cpu(), v.cpu(), seen, twin)
    same, _ = mod_oracle(q.cpu(), k.cpu(), v.cpu(), seen, twin, dtype=torch.bfloat16)
    assert_within_rule("out", out.cpu().double(), ref, same.double(), torch.bfloat16)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu()[finite].double(), ref_lse[finite], rtol=0, atol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_varlen_against_float64_and_the_triton_forward(name, head_dim):
    lengths = [700, 0, 1, 517]  # b indexes the masks' per-row tables (4 rows)
    _, mod, flex, _ = _case(name, max(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = randn(total, HEADS, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(total, KV_HEADS, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    args = (cu.cuda(), cu.cuda(), max(lengths), max(lengths))
    out, lse = flash_attention_varlen(q, k, v, *args, mask_mod=mod, return_lse=True, backend="hopper")
    triton_out = flash_attention_varlen(q, k, v, *args, mask_mod=mod, backend="triton")
    torch.testing.assert_close(out, triton_out, rtol=2e-2, atol=2e-2)
    seen = _seen(flex, max(lengths), max(lengths), len(lengths))
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        q4, k4, v4 = (t[rows].transpose(0, 1)[None].cpu() for t in (q, k, v))
        ref, ref_lse = mod_oracle(q4, k4, v4, seen[b:b + 1, :, :n, :n], None)
        same, _ = mod_oracle(q4, k4, v4, seen[b:b + 1, :, :n, :n], None, dtype=torch.bfloat16)
        ours = out[rows].transpose(0, 1)[None].cpu().double()
        assert_within_rule(f"out of sequence {b}", ours, ref, same.double(), torch.bfloat16)
        ours_lse = lse[:, rows].cpu()[None]
        assert torch.equal(torch.isneginf(ours_lse), torch.isneginf(ref_lse))


# The backward (backend="hopper" runs the Gluon one pass, or raises): its gradients against float64 autograd of the
# torch twin's visibility. lq != lk aligns causal bottom-right, and lq > lk leaves its first rows seeing no key
# (zero gradients, only in the block mask's partial tiles).
SHAPES = {"square": (1000, 1000), "long_keys": (777, 1000), "dead_rows": (1000, 640)}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_dense_backward_against_float64(name, head_dim, shape, causal):
    lq, lk = SHAPES[shape]
    _, mod, flex, _ = _case(name, max(lq, lk))
    q = randn(BATCH, HEADS, lq, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    seen = _seen(flex, lq, lk)
    if causal:
        seen = seen & torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)

    def run(q, k, v):
        return flash_attention_science(q, k, v, causal=causal, mask_mod=mod, return_lse=True, backend="hopper")

    def oracle(q, k, v, dtype):
        return mod_oracle(q, k, v, seen, None, dtype=dtype)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_varlen_backward_against_float64(name, head_dim, causal):
    lengths = [700, 0, 1, 517]
    _, mod, flex, _ = _case(name, max(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = randn(total, HEADS, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(total, KV_HEADS, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    seen = _seen(flex, max(lengths), max(lengths), len(lengths))
    if causal:
        seen = seen & torch.ones(max(lengths), max(lengths), dtype=torch.bool).tril()

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu.cuda(), cu.cuda(), max(lengths), max(lengths), causal=causal,
                                      mask_mod=mod, return_lse=True, backend="hopper")

    oracle = _packed_oracle(lengths, cu, lambda b, n: (seen[b:b + 1, :, :n, :n], None))
    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


def _packed_oracle(lengths, cu, masks):
    """`oracle(q, k, v, dtype) -> (out (total, H, D), lse (H, total))` of a packed batch through mod_oracle one
    sequence at a time; `masks(b, n)`: sequence b's (visibility, score twin) at its n positions."""
    def oracle(q, k, v, dtype):
        outs, lses = [], []
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            rows = slice(int(cu[b]), int(cu[b + 1]))
            out, lse = mod_oracle(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), *masks(b, n), dtype=dtype)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)
    return oracle


@pytest.mark.parametrize("name", ["prefix-LM", "document window"])
def test_auto_chooses_by_the_partial_tiles_and_its_gradients_hold(name):
    """Under auto a mask of few partial tiles (prefix-LM over 2048 rows: 12%) runs the Gluon forward, a mask of many
    (document window: 82%) the Triton one (hopper/backend.mod_forward_refusal), and both the Gluon backward (D=128):
    either way out, lse and dQ, dK, dV against float64."""
    from flashmoe_science.attention.api import describe_dispatch

    lq = lk = 2048
    _, mod, flex, _ = _case(name, lk)
    q = randn(BATCH, HEADS, lq, 128, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, 128, dtype=torch.bfloat16).cuda() for _ in range(2))
    dispatch = describe_dispatch(q, k, v, mask_mod=mod)
    assert (dispatch.backend, dispatch.backward_backend) == (("hopper", "hopper") if name == "prefix-LM"
                                                             else ("triton", "hopper")), dispatch
    seen = _seen(flex, lq, lk)

    def run(q, k, v):
        return flash_attention_science(q, k, v, mask_mod=mod, return_lse=True)

    def oracle(q, k, v, dtype):
        return mod_oracle(q, k, v, seen, None, dtype=dtype)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


# score_mod in the Gluon forward and backward: a softcap written as a mod (every tile, no mask), and
# ALiBi from a per-head slope table beside a per-head window mask_mod (the score on every visited tile, the mask on
# the partial ones), dense at odd lengths with GQA, and packed with an empty and a length-1 sequence
SCORE_CASES = ("softcap_mod", "alibi_mod_and_window")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_mod_forward_against_float64_and_the_triton_forward(name, head_dim, causal):
    from mod_cases import case

    hopper_attention_module("fwd_sm90")
    lq, lk = 1000, 1000
    mask_mod, score_mod, seen, twin = case(name, BATCH, HEADS, lq, lk, "cuda")
    q = randn(BATCH, HEADS, lq, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    out, lse = flash_attention_science(q, k, v, causal=causal, mask_mod=mask_mod, score_mod=score_mod,
                                       return_lse=True, backend="hopper")
    if causal:
        tril = torch.ones(lq, lk, dtype=torch.bool).tril()
        seen = tril if seen is None else seen & tril
    _check_dense(out, lse, q, k, v, seen, twin)
    triton_out = flash_attention_science(q, k, v, causal=causal, mask_mod=mask_mod, score_mod=score_mod,
                                         backend="triton")
    torch.testing.assert_close(out, triton_out, rtol=2e-2, atol=2e-2)


def _packed_score_case(name, head_dim):
    """A packed batch with an empty and a length-1 sequence and the named score case's mods over its longest:
    (lengths, mask_mod, score_mod, cu_seqlens on the host, q, k, v)."""
    from mod_cases import case

    lengths = [700, 0, 1, 517]
    mask_mod, score_mod, _, _ = case(name, len(lengths), HEADS, max(lengths), max(lengths), "cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(int(cu[-1]), HEADS, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(int(cu[-1]), KV_HEADS, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))
    return lengths, mask_mod, score_mod, cu, q, k, v


def _packed_score_oracle(name, lengths, cu, causal):
    """`_packed_oracle` of the named score case (its seeded tables at each sequence's positions)."""
    from mod_cases import case

    def masks(b, n):
        _, _, seen, twin = case(name, 1, HEADS, n, n)
        if causal:
            tril = torch.ones(n, n, dtype=torch.bool).tril()
            seen = tril if seen is None else seen & tril
        return seen, twin
    return _packed_oracle(lengths, cu, masks)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_mod_varlen_forward_against_float64(name, head_dim):
    hopper_attention_module("fwd_sm90")
    lengths, mask_mod, score_mod, cu, q, k, v = _packed_score_case(name, head_dim)
    longest = max(lengths)
    out, lse = flash_attention_varlen(q, k, v, cu.cuda(), cu.cuda(), longest, longest, mask_mod=mask_mod,
                                      score_mod=score_mod, return_lse=True, backend="hopper")
    oracle = _packed_score_oracle(name, lengths, cu, causal=False)
    ref, ref_lse = oracle(q.cpu(), k.cpu(), v.cpu(), torch.float64)
    same, _ = oracle(q.cpu(), k.cpu(), v.cpu(), torch.bfloat16)
    assert_within_rule("out", out.cpu().double(), ref, same.double(), torch.bfloat16)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], rtol=0, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ["square", "long_keys"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_mod_backward_against_float64(name, head_dim, shape, causal):
    """out, lse and dQ, dK, dV of the Gluon forward and one-pass backward with a score_mod (backend='hopper' runs
    both or raises) against float64 autograd of the torch twins."""
    from mod_cases import case

    hopper_attention_module("bwd_sm90")
    lq, lk = SHAPES[shape]
    mask_mod, score_mod, seen, twin = case(name, BATCH, HEADS, lq, lk, "cuda")
    if causal:
        tril = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        seen = tril if seen is None else seen & tril
    q = randn(BATCH, HEADS, lq, head_dim, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, head_dim, dtype=torch.bfloat16).cuda() for _ in range(2))

    def run(q, k, v):
        return flash_attention_science(q, k, v, causal=causal, mask_mod=mask_mod, score_mod=score_mod,
                                       return_lse=True, backend="hopper")

    def oracle(q, k, v, dtype):
        return mod_oracle(q, k, v, seen, twin, dtype=dtype)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


@pytest.mark.parametrize("name", SCORE_CASES)
def test_auto_pairs_the_triton_score_mod_forward_with_the_gluon_backward(name):
    """Under auto a score_mod at D=128 runs the Triton forward and the Gluon backward (each the faster measured):
    the backward reads the Triton forward's lse, so out, lse and dQ, dK, dV against float64."""
    from flashmoe_science.attention.api import describe_dispatch
    from mod_cases import case

    hopper_attention_module("bwd_sm90")
    lq, lk = SHAPES["long_keys"]
    mask_mod, score_mod, seen, twin = case(name, BATCH, HEADS, lq, lk, "cuda")
    q = randn(BATCH, HEADS, lq, 128, dtype=torch.bfloat16).cuda()
    k, v = (randn(BATCH, KV_HEADS, lk, 128, dtype=torch.bfloat16).cuda() for _ in range(2))
    dispatch = describe_dispatch(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    assert (dispatch.backend, dispatch.backward_backend) == ("triton", "hopper"), dispatch

    def run(q, k, v):
        return flash_attention_science(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)

    def oracle(q, k, v, dtype):
        return mod_oracle(q, k, v, seen, twin, dtype=dtype)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_mod_varlen_backward_against_float64(name, head_dim):
    """The same for a packed causal batch with an empty and a length-1 sequence."""
    hopper_attention_module("bwd_sm90")
    lengths, mask_mod, score_mod, cu, q, k, v = _packed_score_case(name, head_dim)
    longest = max(lengths)

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu.cuda(), cu.cuda(), longest, longest, causal=True,
                                      mask_mod=mask_mod, score_mod=score_mod, return_lse=True, backend="hopper")

    oracle = _packed_score_oracle(name, lengths, cu, causal=True)
    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))
