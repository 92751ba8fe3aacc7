"""The Megatron modules' Triton paths under TRITON_INTERPRET=1 against their reference backend: the core attention on
Megatron's ``[s, b, heads, d]`` tensors (strided views into a fused QKV buffer, as Megatron's attention splits it)
and on a packed ``thd`` batch, and the experts on rows grouped by expert. Run by test_megatron.py."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("megatron")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from flashmoe_science.integrations.megatron import FlashCoreAttention  # noqa: E402
from flashmoe_science.moe import grouped_experts  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _config(**changes):
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             attention_dropout=0.0, **changes)


def _pair(**changes):
    return [FlashCoreAttention(_config(**changes), 1, AttnMaskType.causal, "self", backend=backend)
            for backend in ("triton", "reference")]


def _close(ours, theirs, inputs, tolerance=5e-5):
    torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=tolerance)
    grad = torch.randn_like(ours)
    for g, w in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(theirs, inputs, grad)):
        torch.testing.assert_close(g, w, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("window", [None, (6, 0)])
def test_dense_attention_on_fused_qkv_views(window):
    s, b, groups, per_group, d = 20, 2, 2, 2, 16
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, requires_grad=True)
    q, k, v = torch.split(mixed, [per_group * d, d, d], dim=3)
    q = q.reshape(s, b, groups * per_group, d)  # Megatron's query reshape; key and value stay strided views
    triton, reference = _pair(window_size=window)
    _close(triton(q, k, v, None), reference(q, k, v, None), (mixed,))


def test_packed_attention():
    lengths = [7, 1, 12]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 16, requires_grad=True)
    k, v = torch.randn(20, 2, 16, requires_grad=True), torch.randn(20, 2, 16, requires_grad=True)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    triton, reference = _pair()
    _close(triton(q, k, v, None, packed_seq_params=params), reference(q, k, v, None, packed_seq_params=params),
           (q, k, v))


def test_grouped_experts_triton():
    x = torch.randn(13, 32, requires_grad=True)
    w1 = (0.1 * torch.randn(4, 48, 32)).requires_grad_()
    w2 = (0.1 * torch.randn(4, 32, 24)).requires_grad_()
    probs = torch.rand(13, requires_grad=True)
    counts = torch.tensor([4, 0, 6, 3])
    ours = grouped_experts(x, w1, w2, counts, probs, backend="triton")
    theirs = grouped_experts(x, w1, w2, counts, probs, backend="reference")
    _close(ours, theirs, (x, w1, w2, probs))
