"""A packed batch's persistent sm_90 kernels compile once whatever the batch: no argument that changes from one
batch to the next is one Triton specialises on (divisibility by 16, equality to 1). No GPU needed: the arguments
are what the launches would pass, over meta tensors."""

import pytest
import torch

from flashmoe_science.attention.features import CallFeatures, Varlen
from flashmoe_science.attention.hopper import bwd_common, bwd_dq_sm90, bwd_sm90, bwd_sm90_hdim256, fwd_sm90
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.seqlen import PACKED_TOTALS, PER_BATCH_ARGS

KERNELS = [fwd_sm90.attention_forward_sm90_kernel, fwd_sm90.attention_forward_sm90_varlen_kernel,
           bwd_sm90.attention_backward_sm90_kernel,
           bwd_dq_sm90.attention_backward_dq_sm90_kernel, bwd_sm90_hdim256.attention_backward_sm90_hdim256_kernel]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_per_batch_arguments_are_unspecialised(kernel):
    assert set(PER_BATCH_ARGS) <= set(kernel.arg_names)
    assert set(PER_BATCH_ARGS) <= set(kernel.do_not_specialize)


def test_packed_forward_launches_take_the_totals_unspecialised():
    """A serving engine's steps pack a new total of queries and keys each: the packed forward compiles once per tile
    shape, not once per class of totals; dense launches keep their specialised build."""
    assert set(PACKED_TOTALS) <= set(fwd_sm90.attention_forward_sm90_varlen_kernel.do_not_specialize)
    assert not set(PACKED_TOTALS) & set(fwd_sm90.attention_forward_sm90_kernel.do_not_specialize)
    assert fwd_sm90._kernel(None) is fwd_sm90.attention_forward_sm90_kernel


@pytest.mark.parametrize("over_queries", [False, True])
def test_backward_kernels_take_the_packed_totals_not_the_longest_lengths(over_queries):
    q = torch.empty(1, 4, 1000, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, 1200, 128, dtype=torch.bfloat16, device="meta")
    seen = set()
    for num_seqs, longest_q, longest_k in ((3, 400, 500), (16, 64, 80), (7, 1000, 1200)):
        cu_q = torch.empty(num_seqs + 1, dtype=torch.int32, device="meta")
        cu_k = torch.empty(num_seqs + 1, dtype=torch.int32, device="meta")
        features = CallFeatures(mask=make_mask(True, None, None), alibi_slopes=None, attn_bias=None,
                                varlen=Varlen(cu_q, cu_k, longest_q, longest_k))
        tail, _, (programs, seqlen_q, seqlen_k, _) = bwd_common.feature_args(features, 0.1, q, k, 128, over_queries)
        assert (seqlen_q, seqlen_k) == (1000, 1200)
        assert tail[4] == num_seqs  # num_seqs: unspecialised by the kernels
        longest = longest_q if over_queries else longest_k
        assert programs >= -(-longest // 128)  # the grid still covers the longest sequence's tiles
        seen.add((seqlen_q, seqlen_k))
    assert len(seen) == 1


def test_triton_forward_takes_the_packed_totals_and_sizes_its_grid_by_the_longest():
    from flashmoe_science.attention.triton import fwd as triton_fwd
    from flashmoe_science.attention.tiles import AttentionTiles

    q = torch.empty(1, 4, 1000, 64, dtype=torch.float16, device="meta")
    k = v = torch.empty(1, 2, 1200, 64, dtype=torch.float16, device="meta")
    out, lse = torch.empty_like(q), torch.empty(4, 1000, device="meta")
    tiles = AttentionTiles(64, 64, 4, 2)
    for num_seqs, longest_q, longest_k in ((3, 400, 500), (16, 64, 80)):
        cu = torch.empty(num_seqs + 1, dtype=torch.int32, device="meta")
        features = CallFeatures(mask=make_mask(True, None, None), alibi_slopes=None, attn_bias=None,
                                varlen=Varlen(cu, cu, longest_q, longest_k))
        common, strides = triton_fwd._scalar_args(q, k, v, out, features, 0.1, tiles)
        grid, bound, _ = triton_fwd._launch(q, k, v, out, lse, features, tiles, common, strides)
        assert (bound["seqlen_q"], bound["seqlen_k"]) == (1000, 1200)
        assert grid == (-(-longest_q // 64), num_seqs * 4)


def test_causal_packed_bands_only_where_long_sequences_outgrow_l2():
    from flashmoe_science.attention.hopper.tiles import SM90_L2_BYTES, sm90_varlen_band

    mha_16k = 16384 * 16 * 128 * 2 * 2  # K and V, bf16, 16 heads of 128
    assert mha_16k > SM90_L2_BYTES
    assert sm90_varlen_band(mha_16k, 16384, 16) == 4  # 16 x 1024
    assert sm90_varlen_band(mha_16k // 4, 16384, 16, group=4) == 1  # GQA 16/4, 32 MiB: in L2
    assert sm90_varlen_band(16384 * 8 * 128 * 2 * 2, 16384, 16, group=4) == 1  # GQA 32/8, 64 MiB: outgrows L2, one
    assert sm90_varlen_band(mha_16k, 16384, 49) == 1  # a long tail: mean 334 rows
    assert sm90_varlen_band(8192 * 8 * 128 * 2 * 2, 8192, 4) == 1  # GQA 8 kv heads: 32 MiB, in L2
