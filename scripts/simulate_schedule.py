"""Model of how evenly the sm_90 forward's causal work items spread over persistent CTAs (docs/perf-notes.md,
session 7): each item costs its key tiles plus `--overhead` key tiles; prints the mean CTA's share over the busiest
CTA's (1.0 = perfect) for the static snaking rounds (hopper/fwd_sm90._work_tile), a dynamic schedule in the same
head-major order, a dynamic one in the heaviest-first order, and one CTA per tile balanced like a dynamic schedule.
The model predicted +2-3% for a dynamic schedule; the kernel measured it slower (balance was not the cost).

    python scripts/simulate_schedule.py [--ctas 132] [--overhead 1.0]
"""
from __future__ import annotations

import argparse
import heapq


def static_rounds(costs: list[float], ctas: int) -> float:
    busy = [0.0] * ctas
    for work, cost in enumerate(costs):
        rnd, pos = divmod(work, ctas)
        busy[pos if rnd % 2 == 0 else ctas - 1 - pos] += cost
    return sum(busy) / ctas / max(busy)


def dynamic(costs: list[float], ctas: int) -> float:
    free_at = [(0.0, c) for c in range(ctas)]
    for cost in costs:
        t, c = heapq.heappop(free_at)
        heapq.heappush(free_at, (t + cost, c))
    return sum(costs) / ctas / max(t for t, _ in free_at)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--overhead", type=float, default=1.0, help="per-item cost in key tiles")
    a = p.parse_args()
    print("D L heads: static-rounds dynamic-head-major dynamic-heaviest-first")
    for d, heads_x_d in ((64, 2048), (128, 2048), (256, 2048)):
        for length in (512, 1024, 2048, 4096, 8192, 16384):
            heads = (16384 // length) * (heads_x_d // d)
            m_tiles = length // 128
            block_n = 64 if (length <= 1024 and d <= 128) or d > 128 else 128
            # item pid_m (heaviest first within a head) streams (pid_m + 1) * 128 / block_n key tiles
            costs = [(m_tiles - i) * 128 // block_n + a.overhead for _ in range(heads) for i in range(m_tiles)]
            print(f"{d} {length} {heads}: {static_rounds(costs, a.ctas):.3f} {dynamic(costs, a.ctas):.3f} "
                  f"{dynamic(sorted(costs, reverse=True), a.ctas):.3f}")


if __name__ == "__main__":
    main()
