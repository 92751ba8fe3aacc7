"""TorchTitan's decoder on our attention reads the host once per forward and nothing per layer: `HostReads`
(tests/host_reads.py) records every operation that would synchronise a CUDA device while the model's forward
(masks included) and backward run, with the PyTorch reference's own per-sequence loop (the CPU's stand-in for the
kernels) paused. The only read is the documents' count and longest length (`document_metadata`); the cu_seqlens it
builds are valid by construction (`BuiltMetadata`), so no layer reads them back for the value check, eager or
compiled, and a batch without positions (each row one sequence) reads nothing at all."""

import pytest
import torch

pytest.importorskip("torchtitan")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("torchtitan")

from host_reads import HostReads, pausing  # noqa: E402
from test_torchtitan import _batch, _pair, _titan_models, eager_flex  # noqa: E402,F401  (a fixture)

from flashmoe_science.attention import checks, reference  # noqa: E402
from flashmoe_science.integrations import torchtitan as ours  # noqa: E402


@pytest.fixture
def reads(monkeypatch):
    reads = HostReads()
    for name in ("attention_reference", "attention_backward_reference"):
        monkeypatch.setattr(reference, name, pausing(reads, getattr(reference, name)))
    return reads


@pytest.fixture
def value_checks(monkeypatch):
    """The cu_seqlens pairs whose values were read back for `check_varlen`'s value check."""
    seen = []
    check = checks._check_cu_seqlens_values

    def counted(cu_q, cu_k, *bounds):
        seen.append(bounds)
        return check(cu_q, cu_k, *bounds)

    monkeypatch.setattr(checks, "_check_cu_seqlens_values", counted)
    return seen


def _model(layers=3):
    spec = _titan_models().llama3_spec(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                       vocab_size=61, max_seq_len=64, attn_backend="flex")
    return _pair(spec, torch.float64)


def test_packed_documents_read_once_per_step(reads, value_checks, eager_flex):
    reference_model, model = _model()
    tokens, positions = _batch(61, 32)
    for _ in range(2):  # a new batch's positions each step (as the loader's): one read again, none per layer
        step_positions = positions.clone()
        with reads:
            masks = model.get_attention_masks(step_positions)
            out = model(tokens, positions=step_positions, attention_masks=masks)
            out.square().mean().backward()
    assert reads.seen == ["tolist", "tolist"]
    assert value_checks == []
    want = reference_model(tokens, positions=positions,
                           attention_masks=reference_model.get_attention_masks(positions))
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)


def test_rows_without_positions_read_nothing(reads, value_checks):
    _, model = _model()
    tokens = torch.randint(0, 61, (2, 16))
    with reads:
        model(tokens).square().mean().backward()
    assert reads.seen == []
    assert value_checks == []


def test_compiled_layers_skip_the_value_check_of_built_metadata(value_checks):
    # under torch.compile the custom op receives new tensor objects for the same cu_seqlens in every call: the type
    # of the metadata, not a memo of checked tensors, is what spares each layer its host read
    attention = ours.FlashAttention(ours.FlashAttention.Config(backend="reference"))
    layer = torch.compile(attention, backend="aot_eager", fullgraph=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    q = torch.randn(2, 8, 2, 4, dtype=torch.float64, requires_grad=True)
    built = ours.document_metadata(positions)
    x = q
    for _ in range(3):
        x = layer(x, x, x, attention_masks=built)
    x.sum().backward()
    assert value_checks == []
    other = ours.VarlenMetadata(*built[:4])  # the same values, not of this module's making: checked
    layer(q, q, q, attention_masks=other)
    assert len(value_checks) == 1


def test_dense_metadata_is_built_once_per_shape():
    first = ours._dense_metadata(3, 8, torch.device("cpu"))
    assert ours._dense_metadata(3, 8, torch.device("cpu")).cu_seq_q is first.cu_seq_q
    assert first.cu_seq_q.tolist() == [0, 8, 16, 24] and first.max_q == first.max_k == 8
    assert ours._dense_metadata(2, 8, torch.device("cpu")).cu_seq_q.tolist() == [0, 8, 16]


def test_metadata_of_other_origin_is_still_checked(value_checks):
    # a VarlenMetadata the caller built (not document_metadata's) keeps the value check, which refuses bad values
    attention = ours.FlashAttention(ours.FlashAttention.Config(backend="reference"))
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # ends short of the 8 packed tokens
    meta = ours.VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=4, max_k=4)
    with pytest.raises(ValueError, match="last entry"):
        attention(q, q, q, attention_masks=meta)
    assert len(value_checks) == 1
