"""User mask_mod / score_mod (attention/mods.py) on the CPU: the reference (which runs the same @triton.jit
functions through Triton's interpreter) against the torch twins of mod_cases.py in float64, the checks that refuse
bad mods before any work, the planner's reasons, and the block mask. The Triton kernels' cases run under the
interpreter (mods_interpreter_check.py, driven from here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from feature_oracle import check_forward_and_grads
from flashmoe_science import flash_attention_science, flash_attention_varlen
from flashmoe_science.attention.api import describe_dispatch
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.hopper.backend import BACKWARD_FEATURES, FORWARD_FEATURES, missing
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.mods import FULL, PARTIAL, MaskMod, ScoreMod, block_mask, check_mods
from flashmoe_science.attention.problem import dense_problem
from helpers import randn
from interpreter_driver import interpreter_suite, run_marked_suite
from mod_cases import CASES, case, head_window, mod_oracle, prefix_lm, tanh_softcap, tanh_softcap_grad


@pytest.mark.parametrize("name", CASES)
def test_reference_runs_the_mods_like_their_torch_twins(name):
    batch, hq, hkv, lq, lk = 2, 4, 2, 23, 29
    q, k, v = randn(batch, hq, lq, 16, dtype=torch.float64), randn(batch, hkv, lk, 16, dtype=torch.float64), \
        randn(batch, hkv, lk, 16, dtype=torch.float64)
    mask_mod, score_mod, seen, twin = case(name, batch, hq, lq, lk)
    kwargs = dict(mask_mod=mask_mod, score_mod=score_mod)
    if name == "alibi_mod_and_window":
        kwargs["causal"] = True  # ANDed with the mask_mod (already causal: the same visibility)

    def run(q, k, v):
        return flash_attention_science(q, k, v, return_lse=True, **kwargs)

    def oracle(q, k, v, compute):
        return mod_oracle(q, k, v, seen, twin, dtype=compute)

    check_forward_and_grads(run, oracle, (q, k, v), torch.float64, ("dq", "dk", "dv"))


def test_mask_mod_ands_with_window():
    q, k, v = (randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    windows = torch.full((2,), 15, dtype=torch.int32)
    out = flash_attention_science(q, k, v, mask_mod=MaskMod(head_window, windows), window=(4, 0))
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    ref, _ = mod_oracle(q, k, v, ((j <= i) & (i - j <= 4)).expand(1, 2, 20, 20), None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_varlen_reference_indexes_each_sequence():
    """b is the sequence, q_idx / kv_idx positions within it."""
    lengths = [5, 0, 9, 12]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (randn(int(cu[-1]), 2, 8, dtype=torch.float64) for _ in range(3))
    prefix = torch.tensor([2, 0, 4, 7], dtype=torch.int32)
    out = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), mask_mod=MaskMod(prefix_lm, prefix))
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = ((j < prefix[b]) | (j <= i)).expand(1, 2, n, n)
        ref, _ = mod_oracle(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), seen, None)
        torch.testing.assert_close(out[rows], ref[0].transpose(0, 1), rtol=1e-12, atol=1e-12)


def test_block_mask_tiles():
    """Empty, partial and full tiles of a per-head window at 8 x 8 tiles, against the visibility they summarise."""
    batch, heads, lq, lk = 1, 2, 21, 21
    windows = torch.tensor([3, 17], dtype=torch.int32)
    mods = check_mods(MaskMod(head_window, windows), None, torch.empty(1))
    blocks = block_mask(mods, make_mask(False), None, batch, heads, lq, lk, 8, 8, "cpu")
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    for h in range(heads):
        seen = (j <= i) & (i - j <= int(windows[h])) & (i < lq) & (j < lk)
        tiles = seen.view(3, 8, 3, 8).permute(0, 2, 1, 3).reshape(3, 3, 64)
        want = torch.where(tiles.all(-1), FULL, torch.where(tiles.any(-1), PARTIAL, 0))
        assert torch.equal(blocks.states[0, h].long(), want)
        lists = blocks.by_query
        for row in range(3):
            partial = lists.partial[0, h, row, :lists.partial_counts[0, h, row]].tolist()
            full = lists.full[0, h, row, :lists.full_counts[0, h, row]].tolist()
            assert partial == [t for t in range(3) if want[row, t] == PARTIAL]
            assert full == [t for t in range(3) if want[row, t] == FULL]
    # remembered while the table lives unwritten; rebuilt once it is written
    assert block_mask(mods, make_mask(False), None, batch, heads, lq, lk, 8, 8, "cpu") is blocks
    windows[0] = 5
    assert block_mask(mods, make_mask(False), None, batch, heads, lq, lk, 8, 8, "cpu") is not blocks


def test_block_mask_tiles_of_rows_not_a_power_of_two():
    """Query tiles of 12 rows (as the 192-row tiles of three 64-row warpgroups): each tile's state summarises its
    own rows, none of the next tile's."""
    batch, heads, lq, lk = 1, 2, 30, 21
    windows = torch.tensor([3, 17], dtype=torch.int32)
    mods = check_mods(MaskMod(head_window, windows), None, torch.empty(1))
    blocks = block_mask(mods, make_mask(False), None, batch, heads, lq, lk, 12, 8, "cpu")
    i, j = torch.arange(36)[:, None], torch.arange(24)[None, :]
    for h in range(heads):
        seen = (j <= i) & (i - j <= int(windows[h])) & (i < lq) & (j < lk)
        tiles = seen.view(3, 12, 3, 8).permute(0, 2, 1, 3).reshape(3, 3, 96)
        want = torch.where(tiles.all(-1), FULL, torch.where(tiles.any(-1), PARTIAL, 0))
        assert torch.equal(blocks.states[0, h].long(), want)


def _plain(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@triton.jit
def _three(b, h, q_idx):
    return q_idx >= 0


@triton.jit
def _reads(b, h, q_idx, kv_idx, table):
    return tl.load(table + q_idx) > 0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_mod=_plain), TypeError, "mask_mod must be a @triton.jit function"),
    (dict(mask_mod=_three), TypeError, r"mask_mod must take \(b, h, q_idx, kv_idx\)"),
    (dict(mask_mod=MaskMod(_reads)), TypeError, "mask_mod must take .* 0 captured"),
    (dict(mask_mod=MaskMod(_reads, [1, 2])), TypeError, "captured argument 0 must be a torch.Tensor"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4, device="meta"))), ValueError, "on q's device"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4, dtype=torch.complex64))), ValueError, "bool, an integer"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4, 2).t())), ValueError, "must be contiguous"),
    (dict(score_mod=tanh_softcap), ValueError, "score_mod has no derivative"),
    (dict(score_mod=ScoreMod(tanh_softcap, grad=tanh_softcap_grad), softcap=2.0), ValueError, "softcap"),
    (dict(score_mod=ScoreMod(tanh_softcap, grad=_three)), TypeError, "score_mod's grad must take"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4)), softcap=2.0), ValueError, "mask_mod does not combine with softcap"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4)), alibi_slopes=torch.ones(2)), ValueError, "mask_mod does not combine"),
    (dict(mask_mod=MaskMod(_reads, torch.ones(4)), attn_bias=torch.zeros(1, 2, 8, 8, dtype=torch.float64)), ValueError,
     "mask_mod does not combine"),
])
def test_bad_mods_get_one_line(kwargs, error, match):
    q, k, v = (randn(1, 2, 8, 8, dtype=torch.float64).requires_grad_() for _ in range(3))
    with pytest.raises(error, match=match):
        flash_attention_science(q, k, v, **kwargs)


def test_forward_only_score_mod_without_gradients():
    q, k, v = (randn(1, 2, 8, 8, dtype=torch.float64) for _ in range(3))
    out = flash_attention_science(q, k, v, score_mod=tanh_softcap)
    ref, _ = mod_oracle(q, k, v, None, lambda s: 4.0 * torch.tanh(s / 4.0))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_mods_are_refused_with_a_paged_cache():
    q = randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="not with block_table"):
        flash_attention_varlen(q, q, q, cu, cu, 4, 4, mask_mod=head_window,
                               seqused_k=torch.tensor([4], dtype=torch.int32))


def test_the_sm90_family_declares_its_mods_and_the_feature_words_say_so():
    """The Gluon forward and backward declare mask_mod and score_mod."""
    q = randn(1, 2, 8, 16, dtype=torch.float64)
    problem, _ = dense_problem(q, q, q, mask_mod=MaskMod(head_window, torch.ones(2, dtype=torch.int32)),
                               score_mod=ScoreMod(tanh_softcap, grad=tanh_softcap_grad))
    names = problem.feature_names()
    assert {"mask_mod", "score_mod"} <= names
    assert missing(names, FORWARD_FEATURES) == []
    assert missing(names, BACKWARD_FEATURES) == []
    assert not problem.features.is_plain and CallFeatures().mods is None
    reason = describe_dispatch(q, q, q, mask_mod=MaskMod(head_window, torch.ones(2, dtype=torch.int32))).reason
    assert "mask_mod" in reason


def test_a_compiled_call_with_mods_graph_breaks_and_runs_eagerly():
    q, k, v = (randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    windows = torch.full((2,), 3, dtype=torch.int32)

    def f(q, k, v):
        return flash_attention_science(q, k, v, mask_mod=MaskMod(head_window, windows)) * 2

    torch._dynamo.reset()
    out = torch.compile(f, backend="eager")(q, k, v)
    torch.testing.assert_close(out, f(q, k, v), rtol=0, atol=0)


@pytest.mark.slow
@interpreter_suite(Path(__file__).with_name("mods_interpreter_check.py"), timeout=300)
def test_triton_kernels_with_mods_under_the_interpreter(request):
    run_marked_suite(request)
