"""Under TRITON_INTERPRET=1, as a script or as the interpreter child's case (tests/attention/test_mask.py's driver
runs `test_draws`): checks the kernels' view of the mask rules (`mask.key_tile_range`, `mask.visible`, `mask.score_to_log2`) against the host view (`mask.visibility`,
`mask.score_mods`) on random shapes and windows. Prints "ok N" on success, raises on the first mismatch."""

import math
import random
import sys

import torch
import triton
import triton.language as tl

from flashmoe_science.attention import mask as M


@triton.jit
def _tile_view(RANGES, QRANGES, VIS, SCORES, S, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale,
               alibi_slope_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    pid = tl.program_id(0)
    start_m = pid * BLOCK_M
    key_start, full_start, full_end, key_end = M.key_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    tl.store(RANGES + pid * 4 + 0, key_start)
    tl.store(RANGES + pid * 4 + 1, full_start)
    tl.store(RANGES + pid * 4 + 2, full_end)
    tl.store(RANGES + pid * 4 + 3, key_end)
    q_start, qfull_start, qfull_end, q_end = M.query_tile_range(
        pid * BLOCK_N, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    tl.store(QRANGES + pid * 4 + 0, q_start)
    tl.store(QRANGES + pid * 4 + 1, qfull_start)
    tl.store(QRANGES + pid * 4 + 2, qfull_end)
    tl.store(QRANGES + pid * 4 + 3, q_end)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, KEYS)
    diagonal = seqlen_k - seqlen_q
    seen = M.visible(rows[:, None], cols[None, :], seqlen_k, diagonal, window_left, window_right,
                     MASK_LEFT, MASK_RIGHT)
    in_q = rows[:, None] < seqlen_q
    tl.store(VIS + rows[:, None] * KEYS + cols[None, :], seen.to(tl.int8), mask=in_q)
    s = tl.load(S + rows[:, None] * KEYS + cols[None, :], mask=in_q, other=0.0)
    x, _ = M.score_to_log2(s, rows[:, None], cols[None, :], diagonal, qk_scale, softcap_scale, alibi_slope_log2,
                           SOFTCAP, ALIBI)
    tl.store(SCORES + rows[:, None] * KEYS + cols[None, :], x, mask=in_q)


def check(rng: random.Random) -> None:
    lq, lk = rng.randint(1, 40), rng.randint(1, 40)
    block_m, block_n = rng.choice([4, 8, 16]), rng.choice([4, 8, 16])
    causal = rng.random() < 0.4
    window = (rng.choice([-1, 0, 1, 3, 7, 20]), rng.choice([-1, 0, 2, 5, 30]))
    softcap = rng.choice([0.0, 0.0, 2.5])
    slope = rng.choice([None, 0.3])
    spec = M.make_mask(causal, window, softcap)
    scale = 0.7
    args = spec.kernel_args(scale)
    keys = triton.next_power_of_2(lk)
    n_tiles = max(math.ceil(lq / block_m), math.ceil(lk / block_n))
    ranges = torch.full((n_tiles, 4), -7, dtype=torch.int32)
    qranges = torch.full((n_tiles, 4), -7, dtype=torch.int32)
    vis = torch.zeros(lq, keys, dtype=torch.int8)
    s = torch.randn(lq, keys) * 4
    scores = torch.zeros(lq, keys)
    _tile_view[(n_tiles,)](ranges, qranges, vis, scores, s, lq, lk, args["window_left"], args["window_right"],
                           args["qk_scale"], args["softcap_scale"], (slope or 0.0) * M.LOG2_E.value,
                           BLOCK_M=block_m, BLOCK_N=block_n, KEYS=keys, MASK_LEFT=args["MASK_LEFT"],
                           MASK_RIGHT=args["MASK_RIGHT"], SOFTCAP=args["SOFTCAP"], ALIBI=slope is not None)
    truth = M.visibility(lq, lk, spec)
    what = f"lq={lq} lk={lk} blocks={block_m}x{block_n} causal={causal} window={window} -> {spec}"
    assert torch.equal(vis[:, :lk].bool(), truth), f"visible() disagrees with visibility(): {what}"
    for tile in range(math.ceil(lk / block_n)):
        qs, fs, fe, qe = qranges[tile].tolist()
        cols = slice(tile * block_n, min(lk, (tile + 1) * block_n))
        assert 0 <= qs <= fs <= fe <= qe <= lq, (qranges[tile], what)
        for bound in (qs, fs, fe):
            assert bound % block_m == 0 or bound == qe, (qranges[tile], what)
        seen_rows = truth[:, cols].any(1).nonzero().flatten()
        if len(seen_rows):
            assert qs <= seen_rows.min() and seen_rows.max() < qe, f"key tile {tile} misses rows {qranges[tile]}: {what}"
        full = truth[fs:fe, tile * block_n:(tile + 1) * block_n]
        assert full.all() and (fs == fe or full.shape[1] == block_n), f"key tile {tile} rows {fs}:{fe} not full: {what}"
    for tile in range(math.ceil(lq / block_m)):
        ks, fs, fe, ke = ranges[tile].tolist()
        rows = slice(tile * block_m, min(lq, (tile + 1) * block_m))
        assert 0 <= ks <= fs <= fe <= ke <= lk, (ranges[tile], what)
        for bound in (ks, fs, fe):  # tile-aligned, or clipped to key_end
            assert bound % block_n == 0 or bound == ke, (ranges[tile], what)
        seen_cols = truth[rows].any(0).nonzero().flatten()
        if len(seen_cols):
            assert ks <= seen_cols.min() and seen_cols.max() < ke, f"tile {tile} misses keys {ranges[tile]}: {what}"
        assert truth[rows, fs:fe].all(), f"tile {tile} full range {fs}:{fe} is not fully visible: {what}"
    ref = M.score_mods(s[:, :lk][None, None] * scale, spec, lq, lk,
                       None if slope is None else torch.full((1, 1), slope))[0, 0]
    got = scores[:, :lk] / M.LOG2_E.value
    fin = truth
    assert torch.allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5), f"score_to_log2 disagrees: {what}"


def test_draws():
    """150 draws from seed 1."""
    rng = random.Random(1)
    for _ in range(150):
        check(rng)


if __name__ == "__main__":
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    for _ in range(n):
        check(rng)
    print(f"ok {n}")
