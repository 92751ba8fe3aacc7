"""A CPU model of how the sm_90 varlen kernels' work items fill a Hopper's SMs (docs/perf-notes.md, "Ragged batches:
the order of the work items"). Usage: PYTHONPATH=src python benchmarks/tools/varlen_schedule_model.py

Backward (bwd_sm90, D=128): one CTA per (sequence, kv head, 128-key block), one CTA per SM; the hardware starts
them in program-id order as SMs free up (list scheduling). A CTA costs a fixed prologue/epilogue plus its visited
64-row query tiles (masked tiles x1.15). Forward (fwd_sm90, persistent): 132 CTAs take items in rounds of 132 with
the snake of work_items.work_index, a static assignment; an item costs a fixed part plus its 128-key tiles.
Orders: the batch's, longest sequence first (seqlen.varlen_work_list: the backward's), every tile in decreasing
cost (the causal forward's), shortest first or shuffled (what a data loader may hand over)."""

from __future__ import annotations

import heapq
import random

from flashmoe_science.bench.features import VARLEN_DISTRIBUTIONS

SMS, HEADS = 132, 16
BWD_TILE_US, MASKED = 2.77, 1.15  # a 64x128 D=128 backward tile at the dense kernel's 493 TFLOP/s (H200)
FWD_TILE_US = 1.76  # a 128x128 D=128 forward tile at 630 TFLOP/s


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def backward_ctas(length: int, causal: bool, block_n: int = 128, rows: int = 64) -> list[tuple[int, int]]:
    """(visited query tiles, masked ones) per key block of one (sequence, head): bwd_common._query_tile_bounds."""
    query_end = cdiv(length, rows) * rows
    blocks = []
    for n in range(cdiv(length, block_n)):
        start = min(n * block_n // rows * rows, query_end) if causal else 0
        diag_end = min(cdiv(min(n * block_n + block_n, length), rows) * rows, query_end) if causal else 0
        if n * block_n + block_n > length:
            diag_end = query_end
        blocks.append(((query_end - start) // rows, (diag_end - start) // rows))
    return blocks


def list_schedule(costs: list[float]) -> float:
    ends = [0.0] * SMS
    for cost in costs:
        heapq.heappush(ends, heapq.heappop(ends) + cost)
    return max(ends)


def snake_schedule(costs: list[float]) -> float:
    per_cta = [0.0] * SMS
    for work, cost in enumerate(costs):
        rnd, pos = divmod(work, SMS)
        per_cta[pos if rnd % 2 == 0 else SMS - 1 - pos] += cost
    return max(per_cta)


def backward(lengths: list[int], causal: bool, order: list[int], fixed_us: float) -> tuple[float, float, float]:
    """(makespan, ideal, fixed share) in µs."""
    costs = [fixed_us + BWD_TILE_US * (tiles + (MASKED - 1) * masked)
             for b in order for _ in range(HEADS) for tiles, masked in backward_ctas(lengths[b], causal)]
    return list_schedule(costs), sum(costs) / SMS, fixed_us * len(costs) / sum(costs)


def forward_items(lengths: list[int], causal: bool, order: list[int], heaviest_first: bool) -> list[int]:
    """Key tiles per item, in the numbering: sequences in `order`, head by head (causal: each head's tiles
    heaviest first), or every tile in decreasing cost with its heads consecutive."""
    if heaviest_first:
        tiles = [t + 1 for b in order for t in range(cdiv(lengths[b], 128))]
        return [cost for cost in sorted(tiles, reverse=True) for _ in range(HEADS)]
    return [(t + 1 if causal else cdiv(lengths[b], 128))
            for b in order for _ in range(HEADS) for t in reversed(range(cdiv(lengths[b], 128)))]


def forward(lengths, causal, order, heaviest_first, fixed_us) -> tuple[float, float]:
    costs = [fixed_us + FWD_TILE_US * k for k in forward_items(lengths, causal, order, heaviest_first)]
    return snake_schedule(costs), sum(costs) / SMS


def main() -> None:
    for name in ("long tail", "packed documents"):
        lengths = VARLEN_DISTRIBUTIONS[name](1)
        batch = list(range(len(lengths)))
        longest = sorted(batch, key=lambda b: -lengths[b])
        shuffles = [random.Random(seed).sample(batch, len(batch)) for seed in range(50)]
        for causal in (False, True):
            print(f"{name}, {len(lengths)} sequences, causal={causal}")
            for fixed in (5.0, 20.0):
                run = lambda order: backward(lengths, causal, order, fixed)  # noqa: E731
                (old, ideal, share), new = run(batch), run(longest)[0]
                worst, mean = run(longest[::-1])[0], sum(run(o)[0] for o in shuffles) / len(shuffles)
                print(f"  backward, fixed {fixed:4.1f} µs ({share:.0%} of the work): ideal {ideal:6.0f} µs, "
                      f"batch order {old / ideal - 1:+.1%}, longest first {new / ideal - 1:+.1%}; shortest first "
                      f"{worst / ideal - 1:+.1%}, shuffled (mean of 50) {mean / ideal - 1:+.1%}")
            for fixed in (1.0, 3.0):
                old, ideal = forward(lengths, causal, batch, False, fixed)
                new = forward(lengths, causal, longest, causal, fixed)[0]
                mean = sum(forward(lengths, causal, o, False, fixed)[0] for o in shuffles) / len(shuffles)
                order = "heaviest first" if causal else "longest first"
                print(f"  forward, fixed {fixed:3.1f} µs: ideal {ideal:6.0f} µs, batch order {old / ideal - 1:+.1%} "
                      f"(shuffled {mean / ideal - 1:+.1%}), {order} {new / ideal - 1:+.1%}: x{old / new:.2f}")


if __name__ == "__main__":
    main()
