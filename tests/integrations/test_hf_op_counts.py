"""The work our transformers attention function issues around the kernels, per layer call: `OpCounts`
(tests/op_counts.py) counts the aten ops that are not views while the planner runs stand-ins for the GPU kernels
(same autograd Function, same buffers; the stand-ins compute with the counting paused). A full batch moves no data
besides the kernels' (no transposing copy, no cast, no repeated KV heads) either way; a padded batch gathers each of
q, k, v once into the packed rows and the output once back (and the same four gathers in the backward), whatever
layout transformers hands over: the projections' transposed views, or the (B, Hkv, L, D)-contiguous keys and values
of the DynamicCache that a training forward builds by default. Outputs and gradients against float64 SDPA."""

import collections

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from op_counts import OpCounts, stand_in_kernels  # noqa: E402
from test_hf import COMMON, batch, model_pair  # noqa: E402
from test_hf_host_reads import _sdpa_padded  # noqa: E402

from flashmoe_science.integrations import hf  # noqa: E402

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 3, 4, 2, 11, 16
# per layer call once the mask's row orders exist (the first layer of a forward builds them)
PADDED_FORWARD = {"index": 3, "index_select": 1, "masked_fill_": 1}  # q, k, v gathered; the output back
PADDED_BACKWARD = {"index_select": 4, "masked_fill_": 4}  # the same four, inverse
COPIES = ("clone", "copy_", "_to_copy", "contiguous", "cat", "repeat", "repeat_interleave", "expand_copy")


class _Causal:
    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


@pytest.fixture
def counts(monkeypatch):
    counts = OpCounts()
    stand_in_kernels(monkeypatch, counts)
    return counts


def _inputs(cache_layout: bool):
    """transformers' q, k, v (B, H, L, D), float64 leaves: the projections' view(B, L, H, D).transpose(1, 2) (RoPE
    keeps that layout); with `cache_layout` k and v (B, Hkv, L, D)-contiguous, as a DynamicCache's torch.cat makes
    them."""
    q = torch.randn(BATCH, LENGTH, HEADS, DIM, dtype=torch.float64).transpose(1, 2).requires_grad_()
    if cache_layout:
        kv = [torch.randn(BATCH, KV_HEADS, LENGTH, DIM, dtype=torch.float64) for _ in range(2)]
    else:
        kv = [torch.randn(BATCH, LENGTH, KV_HEADS, DIM, dtype=torch.float64).transpose(1, 2) for _ in range(2)]
    return (q, *(t.requires_grad_() for t in kv))


def _counted(counts, inputs, mask, **kwargs):
    """(output, gradients, forward work, backward work) of one call of our attention function."""
    counts.work.clear()
    with counts:
        out, _ = hf.flashmoe_science_attention(_Causal(), *inputs, mask, **kwargs)
    forward = collections.Counter(counts.work)
    grad = torch.randn_like(out)
    counts.work.clear()
    with counts:
        grads = torch.autograd.grad(out, inputs, grad)
    return out, grads, grad, (dict(forward), dict(counts.work))


def _check_against_sdpa(inputs, mask, out, grads, grad):
    q, k, v = inputs
    if mask is None:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    want = torch.nan_to_num(_sdpa_padded(q, k, v, mask, causal=True))
    torch.testing.assert_close(out, want)
    # the backward reads the forward's lse, float32 as the kernels keep it (problem.new_outputs)
    for got, expected in zip(grads, torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(got, torch.nan_to_num(expected), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cache_layout", [False, True])
def test_full_batch_moves_no_data_around_the_kernels(counts, cache_layout):
    inputs = _inputs(cache_layout)
    out, grads, grad, work = _counted(counts, inputs, None, scaling=DIM**-0.5)
    assert work == ({}, {})
    assert out.is_contiguous()  # (B, L, H, D): transformers' reshape to (B, L, H·D) is a view
    for t, g in zip(inputs, grads):
        assert g.stride() == t.stride()  # each gradient in its input's layout: no copy on the way back either
    _check_against_sdpa(inputs, None, out, grads, grad)


@pytest.mark.parametrize("cache_layout", [False, True])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batch_gathers_each_tensor_once(counts, cache_layout, padding):
    inputs = _inputs(cache_layout)
    ids, mask = batch(padding)
    mask = mask.bool()
    _counted(counts, inputs, mask, scaling=DIM**-0.5)  # the first layer builds the row orders
    out, grads, grad, work = _counted(counts, inputs, mask, scaling=DIM**-0.5)
    assert work == (PADDED_FORWARD, PADDED_BACKWARD)
    assert out.is_contiguous()
    for g in grads:  # token-major gradients: transformers' view back to (B, L, H·D) needs no copy
        assert g.transpose(1, 2).is_contiguous()
    _check_against_sdpa(inputs, mask, out, grads, grad)


def test_packed_positions_move_no_data_around_the_kernels(counts):
    q, k, v = (t[:1] for t in _inputs(cache_layout=False))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])
    _counted(counts, (q, k, v), None, position_ids=positions)  # the documents, read once per forward
    out, grads, grad, work = _counted(counts, (q, k, v), None, position_ids=positions)
    assert work == ({}, {})
    starts = (0, 4, 7, 11)
    want = torch.cat([F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True,
                                                     enable_gqa=True)
                      for a, b in zip(starts, starts[1:])], dim=2).transpose(1, 2)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_model_forward_copies_nothing_in_attention(counts, padding):
    """A Llama forward as transformers runs it (a DynamicCache in the training forward too): inside our attention
    function no copy, cast or repeated KV head, and per layer the gathers of a padded batch only."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def counted(*args, **kwargs):
        with counts:
            return hf.flashmoe_science_attention(*args, **kwargs)

    AttentionInterface.register("fmoe_science_op_counts", counted)
    AttentionMaskInterface.register("fmoe_science_op_counts", hf.padding_mask)
    _, ours, _ = model_pair("llama")
    ours.set_attn_implementation("fmoe_science_op_counts")
    ids, mask = batch(padding)
    ours(input_ids=ids, attention_mask=None if padding is None else mask)
    assert not [name for name in counts.work if name in COPIES]
    gathers = counts.work["index"] + counts.work["index_select"]
    assert gathers == (0 if padding is None else 4 * COMMON["num_hidden_layers"])
