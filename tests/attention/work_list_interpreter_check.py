"""Under TRITON_INTERPRET=1, as a script or as the interpreter child's cases (tests/attention/test_varlen_work_list.py's
driver runs the `test_` functions): the tables of seqlen.varlen_work_list (two Triton kernels) against their
definition with Python's sorts (`sorted_work_list`), and the decoding of every work item
of random packed batches with the kernels' `seqlen.tile_of_work`, `ranked_tile_of_work` and `heaviest_tile_of_work`
and checks them against the exact integer rules of each numbering (every real tile of every head once; the batch's
order, or the sequences longest first, a (sequence, head)'s tiles consecutive and increasing; or every tile in
decreasing causal cost, the heads of a tile consecutive). Prints "ok N" on success, raises on the first mismatch."""

import random
import sys

import torch
import triton
import triton.language as tl

from flashmoe_science.attention import seqlen


@triton.jit
def _decode(TABLE, OUT, num_seqs, num_heads, NUMBERING: tl.constexpr):
    work = tl.program_id(0)
    num_tiles = -1
    if NUMBERING == 0:
        seq, head, tile = seqlen.tile_of_work(TABLE, num_seqs, num_heads, work)
    elif NUMBERING == 1:
        seq, head, tile, num_tiles = seqlen.ranked_tile_of_work(TABLE, num_heads, work)
    else:
        seq, head, tile = seqlen.heaviest_tile_of_work(TABLE, num_heads, work)
    tl.store(OUT + work * 4 + 0, seq)
    tl.store(OUT + work * 4 + 1, head)
    tl.store(OUT + work * 4 + 2, tile)
    tl.store(OUT + work * 4 + 3, num_tiles)


def decode(table, num_seqs, heads, items, numbering):
    out = torch.full((items, 4), -2, dtype=torch.int32)
    if items:
        _decode[(items,)](table, out, num_seqs, heads, numbering)
    return [tuple(row) for row in out.tolist()]


def _consecutive_tiles(items, tiles):
    """A (sequence, head)'s tiles consecutive and increasing from 0."""
    for a, b in zip(items, items[1:]):
        if a[:2] == b[:2]:
            assert b[2] == a[2] + 1, (a, b)
        else:
            assert b[2] == 0 and a[2] == tiles[a[0]] - 1, (a, b)


def check(lengths, heads, block, slots):
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    tiles = [-(-n // block) for n in lengths]
    everything = sorted((b, h, t) for b in range(len(lengths)) for h in range(heads) for t in range(tiles[b]))
    count = heads * sum(tiles)

    batch = decode(seqlen.varlen_tile_offsets(cu, block), len(lengths), heads, count, 0)
    assert sorted(i[:3] for i in batch) == everything, (lengths, heads, block)
    assert [i[0] for i in batch] == sorted(i[0] for i in batch), lengths  # the batch's order
    _consecutive_tiles(batch, tiles)

    table = seqlen.varlen_work_list(cu, block, slots)
    assert table.dtype == torch.int32 and table.shape == (1 + 4 * slots,) and int(table[0]) == sum(tiles)
    ranked = decode(table, len(lengths), heads, count, 1)
    assert sorted(i[:3] for i in ranked) == everything, (lengths, heads, block)
    assert all(n == tiles[b] for b, _, _, n in ranked)
    lengths_in_order = [lengths[i[0]] for i in ranked]
    assert lengths_in_order == sorted(lengths_in_order, reverse=True), lengths  # longest first
    _consecutive_tiles(ranked, tiles)

    heaviest = decode(table, len(lengths), heads, count, 2)
    assert sorted(i[:3] for i in heaviest) == everything, (lengths, heads, block)
    assert all(a[2] >= b[2] for a, b in zip(heaviest, heaviest[1:])), lengths  # causal cost tile + 1, decreasing
    for w, (b, h, t, _) in enumerate(heaviest):  # a tile's heads consecutive
        assert h == w % heads and heaviest[w - h][0] == b and heaviest[w - h][2] == t


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_records_hold_the_longest_first_slots_and_the_tiles_in_decreasing_causal_cost():
    cu = _cu(300, 100, 0, 129)  # tiles 3, 1, 0, 2 at 128 rows; longest first: sequences 0, 3, 1, 2
    slots = seqlen.work_items_bound(4, 600, 600, 128)  # min(4 * 5, 5 + 4)
    table = seqlen.varlen_work_list(cu, 128, slots)
    assert table.dtype == torch.int32 and table.shape == (seqlen.ranked_work_list_entries(4, 600, 128),) == (37,)
    assert table[0] == 6
    records = table[1:].view(slots, 4).tolist()
    # slots: sequence 0 -> 0, 1, 2; sequence 3 -> 3, 4; sequence 1 -> 5; past the tiles: the last rank's record
    assert [r[:3] for r in records] == [[0, 0, 3]] * 3 + [[3, 3, 2]] * 2 + [[1, 5, 1]] + [[2, 6, 0]] * 3
    # costs (tile + 1) 1, 2, 3, 1, 2, 1: decreasing, ties in slot order; the slots past the tiles last
    assert [r[3] for r in records] == [2, 1, 4, 0, 3, 5, 6, 7, 8]


def test_ranked_work_list_is_computed_once_per_unwritten_tensor_and_packed_rows():
    cu = _cu(5, 0, 130, 1, 64)
    first = seqlen.ranked_work_list(cu, 64, 200)
    assert seqlen.ranked_work_list(cu, 64, 200) is first
    assert seqlen.ranked_work_list(cu, 64, 400) is not first  # other packed rows, another number of slots
    assert torch.equal(first, seqlen.varlen_work_list(cu, 64, seqlen.work_items_bound(5, 200, 200, 64)))
    assert seqlen.ranked_work_list(cu, 64, 200) is not seqlen.work_list(cu, 64)


def test_varlen_batch_takes_the_ranked_list_for_the_causal_path():
    cu = _cu(5, 0, 130)
    assert seqlen.VarlenBatch.of(cu, cu, 128, 135, True).tile_offsets is seqlen.ranked_work_list(cu, 128, 135)
    assert seqlen.VarlenBatch.of(cu, cu, 128, 135, False).tile_offsets is seqlen.work_list(cu, 128)


def sorted_work_list(cu_seqlens, block: int, slots: int) -> list[int]:
    """varlen_work_list's table by its definition, with Python's sorts."""
    lengths = [int(b) - int(a) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])  # stable: equal lengths keep the batch's order
    offsets = [0]
    for b in order:
        offsets.append(offsets[-1] + -(-lengths[b] // block))
    total, records = offsets[-1], []
    for p in range(slots):
        rank = max(0, min(max(r for r in range(len(offsets)) if offsets[r] <= p), len(lengths) - 1))
        records.append([order[rank], offsets[rank], offsets[rank + 1] - offsets[rank]])
    cost = [p - records[p][1] + 1 if p < total else 0 for p in range(slots)]
    for place, p in enumerate(sorted(range(slots), key=lambda p: (-cost[p], p))):
        records[place].append(p)
    return [total, *(value for record in records for value in record)]


def test_tables_equal_their_definition():
    """Random packed batches, empty ones and empty sequences among them, against sorted_work_list."""
    rng = random.Random(5)
    for _ in range(60):
        block = rng.choice((64, 128))
        lengths = [rng.choice((0, 1, block - 1, block, block + 1, rng.randint(1, 6 * block)))
                   for _ in range(rng.choice((0, 1, rng.randint(2, 9), rng.randint(60, 140))))]
        rows = sum(lengths) + rng.randint(0, 3 * block)
        cu = _cu(*lengths) if lengths else torch.zeros(1, dtype=torch.int32)
        slots = seqlen.work_items_bound(len(lengths), rows, rows, block)
        assert seqlen.varlen_work_list(cu, block, slots).tolist() == sorted_work_list(cu, block, slots), lengths


def main(seed: int, cases: int) -> None:
    rng = random.Random(seed)
    check([0, 1, 127, 129, 0, 643], 2, 128, seqlen.work_items_bound(6, 900, 900, 128))
    for _ in range(cases - 1):
        block = rng.choice((64, 128))
        lengths = [rng.choice((0, 1, block - 1, block, block + 1, rng.randint(1, 6 * block)))
                   for _ in range(rng.randint(1, 9))]
        rows = sum(lengths) + rng.randint(0, 3 * block)  # packed rows past the last sequence
        check(lengths, rng.choice((1, 2, 3)), block, seqlen.work_items_bound(len(lengths), rows, rows, block))
    print(f"ok {cases}")


def test_draws():
    """40 packed batches from seed 3."""
    main(3, 40)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
