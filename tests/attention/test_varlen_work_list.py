"""A packed batch's ranked work list (seqlen.varlen_work_list): its exact integers on the host, and the kernels'
decoding of every work list under the Triton interpreter (work_list_interpreter_check.py)."""

from pathlib import Path

import torch

from flashmoe_science.attention.seqlen import (VarlenBatch, ranked_work_list, ranked_work_list_entries,
                                               varlen_work_list, work_items_bound, work_list)
from interpreter_driver import interpreter_suite, run_marked_suite


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_records_hold_the_longest_first_slots_and_the_tiles_in_decreasing_causal_cost():
    cu = _cu(300, 100, 0, 129)  # tiles 3, 1, 0, 2 at 128 rows; longest first: sequences 0, 3, 1, 2
    slots = work_items_bound(4, 600, 600, 128)  # min(4 * 5, 5 + 4)
    table = varlen_work_list(cu, 128, slots)
    assert table.dtype == torch.int32 and table.shape == (ranked_work_list_entries(4, 600, 128),) == (37,)
    assert table[0] == 6
    records = table[1:].view(slots, 4).tolist()
    # slots: sequence 0 -> 0, 1, 2; sequence 3 -> 3, 4; sequence 1 -> 5; past the tiles: the last rank's record
    assert [r[:3] for r in records] == [[0, 0, 3]] * 3 + [[3, 3, 2]] * 2 + [[1, 5, 1]] + [[2, 6, 0]] * 3
    # costs (tile + 1) 1, 2, 3, 1, 2, 1: decreasing, ties in slot order; the slots past the tiles last
    assert [r[3] for r in records] == [2, 1, 4, 0, 3, 5, 6, 7, 8]


def test_ranked_work_list_is_computed_once_per_unwritten_tensor_and_packed_rows():
    cu = _cu(5, 0, 130, 1, 64)
    first = ranked_work_list(cu, 64, 200)
    assert ranked_work_list(cu, 64, 200) is first
    assert ranked_work_list(cu, 64, 400) is not first  # other packed rows, another number of slots
    assert torch.equal(first, varlen_work_list(cu, 64, work_items_bound(5, 200, 200, 64)))
    assert ranked_work_list(cu, 64, 200) is not work_list(cu, 64)


def test_varlen_batch_takes_the_ranked_list_for_the_causal_path():
    cu = _cu(5, 0, 130)
    assert VarlenBatch.of(cu, cu, 128, 135, True).tile_offsets is ranked_work_list(cu, 128, 135)
    assert VarlenBatch.of(cu, cu, 128, 135, False).tile_offsets is work_list(cu, 128)


@interpreter_suite(Path(__file__).with_name("work_list_interpreter_check.py"))
def test_kernels_decode_the_work_lists_under_the_interpreter(request):
    run_marked_suite(request)
