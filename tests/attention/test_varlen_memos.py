"""What a packed call derives from its cu_seqlens values (the kernels' work lists, the value check) is remembered per
tensor (`prepared_cache.TensorMemo`), so a model's layers sharing one pair per batch compute it once: only while the
very tensor lives unwritten. A tensor written in place, or a new tensor of equal values, is never served an old
entry."""

import pytest
import torch

from flashmoe_science.attention import checks
from flashmoe_science.attention.seqlen import varlen_tile_offsets, work_list


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_work_list_is_computed_once_per_unwritten_tensor():
    cu = _cu(5, 0, 130, 1, 64)
    first = work_list(cu, 64)
    assert work_list(cu, 64) is first  # the layers after the first: no device ops
    assert torch.equal(first, varlen_tile_offsets(cu, 64))
    assert not torch.equal(work_list(cu, 16), first)  # another tile size, another list
    cu[2] += 70  # written in place: a sequence grew into the next
    again = work_list(cu, 64)
    assert again is not first and torch.equal(again, varlen_tile_offsets(cu, 64))
    equal_values = cu.clone()
    assert work_list(equal_values, 64) is not again  # identity, not values: an equal tensor computes its own


def test_a_freed_tensor_is_not_mistaken_for_its_successor():
    lists = [work_list(_cu(*lengths), 32) for lengths in ((40, 1), (1, 90), (200, 3))]
    for lengths, offsets in zip(((40, 1), (1, 90), (200, 3)), lists):
        assert torch.equal(offsets, varlen_tile_offsets(_cu(*lengths), 32))


def test_value_check_runs_once_per_unwritten_pair(monkeypatch):
    calls = []
    check = checks._check_cu_seqlens_values
    monkeypatch.setattr(checks, "_check_cu_seqlens_values", lambda *a: calls.append(1) or check(*a))
    q = torch.randn(12, 2, 8)
    cu = _cu(5, 7)
    for _ in range(3):
        checks.check_varlen(q, q, q, cu, cu, 7, 7)
    assert len(calls) == 1
    cu[1] = 6  # in place, still valid
    checks.check_varlen(q, q, q, cu, cu, 7, 7)
    assert len(calls) == 2
    cu[1] = 13  # in place, past the total: refused, not served the earlier pass
    with pytest.raises(ValueError, match="non-decreasing"):
        checks.check_varlen(q, q, q, cu, cu, 7, 7)
