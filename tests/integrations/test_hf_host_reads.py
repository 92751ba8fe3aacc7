"""The padded and packed paths of attn_implementation=hf.ATTN_IMPLEMENTATION read nothing on the host per layer:
`HostReads` (tests/host_reads.py) records every operation that would synchronise a CUDA device while our attention
function and the model's backward run, with the PyTorch reference's own per-sequence loop (the CPU's stand-in for
the kernels) paused; the row orders and document bounds are built once per forward. Outputs and gradients of the
padded path against float64 SDPA with the padding mask."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from host_reads import HostReads, pausing  # noqa: E402
from test_hf import COMMON, batch, model_pair  # noqa: E402

from flashmoe_science.attention import documents, padded, reference  # noqa: E402
from flashmoe_science.integrations import hf  # noqa: E402

COUNTED = "fmoe_science_counted"


@pytest.fixture
def reads(monkeypatch):
    """A HostReads that counts inside our attention function (registered as COUNTED) and pauses inside the
    reference's loop over sequences."""
    reads = HostReads()
    for name in ("attention_reference", "attention_backward_reference"):
        monkeypatch.setattr(reference, name, pausing(reads, getattr(reference, name)))

    def counted(*args, **kwargs):
        with reads:
            return hf.flashmoe_science_attention(*args, **kwargs)

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(COUNTED, counted)
    AttentionMaskInterface.register(COUNTED, hf.padding_mask)
    return reads


def _counted_model(name="llama"):
    sdpa, ours, _ = model_pair(name)
    ours.set_attn_implementation(COUNTED)
    return sdpa, ours


def _counting(monkeypatch, module, name):
    calls = []
    function = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batch_reads_nothing_per_layer(reads, monkeypatch, padding):
    sdpa, ours = _counted_model()
    built = _counting(monkeypatch, padded, "row_order")
    ids, mask = batch(padding)
    logits = ours(input_ids=ids, attention_mask=mask).logits
    loss = (logits * mask[..., None]).square().mean()  # no boolean index: its backward would read the mask
    with reads:
        loss.backward()
    assert reads.seen == []
    assert built == ["row_order"]  # once per forward, shared by both layers
    torch.testing.assert_close((logits * mask[..., None]).detach(),
                               sdpa(input_ids=ids, attention_mask=mask).logits * mask[..., None],
                               atol=2e-5, rtol=2e-5)


def test_generation_with_padding_reads_nothing_in_attention(reads):
    sdpa, ours = _counted_model()
    ids, mask = batch("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
    assert reads.seen == []


def test_packed_positions_read_once_per_forward(reads, monkeypatch):
    sdpa, ours = _counted_model()
    built = _counting(monkeypatch, documents, "_packed_documents")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 11))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    got = ours(input_ids=ids, position_ids=positions).logits
    assert built == ["_packed_documents"]
    assert reads.seen == ["tolist"]  # the documents' count and longest length, read together, once
    want = torch.cat((sdpa(input_ids=ids[:, :4]).logits, sdpa(input_ids=ids[:, 4:]).logits), dim=1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _sdpa_padded(q, k, v, mask, causal):
    """float64 SDPA over the padded batch: key j visible from query i (the last Lq of Lk positions) where j is real
    (and, causal, j <= i's position); rows of padding queries zero."""
    length_q, length_k = q.shape[2], k.shape[2]
    visible = mask[:, None, None, :].expand(-1, 1, length_q, -1)
    if causal:
        positions = torch.arange(length_k - length_q, length_k)
        visible = visible & (torch.arange(length_k)[None, :] <= positions[:, None])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    real_q = mask[:, -length_q:]
    return (out * real_q[:, None, :, None]).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length_q", [13, 4])
def test_padded_attention_matches_sdpa(causal, length_q):
    batch_size, heads, kv_heads, length_k, dim = 4, 4, 2, 13, 8
    lengths = [13, 0, 6, 9]  # an empty row too
    mask = torch.arange(length_k)[None, :] >= (length_k - torch.tensor(lengths))[:, None]  # left padded
    q = torch.randn(batch_size, heads, length_q, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch_size, kv_heads, length_k, dim, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    real_q = mask[:, -length_q:]

    class Module:
        is_causal = causal

    got, _ = hf.flashmoe_science_attention(Module(), q, k, v, mask)
    want = _sdpa_padded(q, k, v, mask, causal)
    # an empty row's queries see no key: both give zeros (ours by the rule, sdpa's NaN rows are masked here)
    want = torch.nan_to_num(want) * real_q[..., None, None]
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, torch.nan_to_num(want_grad))
    assert not got_grads[0].transpose(1, 2)[~real_q].any()  # padding queries get no gradient


def test_row_order_is_a_permutation_with_real_tokens_first():
    mask = torch.rand(5, 7) > 0.4
    rows = padded.row_order(mask)
    flat = mask.reshape(-1)
    total = int(flat.sum())
    assert torch.equal(rows.order.sort().values, torch.arange(35))
    assert torch.equal(rows.order[rows.inverse], torch.arange(35))
    assert torch.equal(rows.order[:total], flat.nonzero().squeeze(1))  # real tokens, in token order
    assert torch.equal(rows.cu_seqlens, F.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32))
    assert torch.equal(rows.pad_rows.view(-1), torch.arange(35) >= total)


def test_padded_rows_refuse_bad_masks():
    with pytest.raises(TypeError, match="boolean"):
        padded.padded_rows(torch.ones(2, 3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="length_q"):
        padded.padded_rows(torch.ones(2, 3, dtype=torch.bool), 4)
