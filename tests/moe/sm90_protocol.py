"""A model of the mbarrier protocol of the warp-specialised sm_90 Gluon GEMMs (moe/hopper: dx_sm90, wgrad_sm90),
shared by their CPU tests.

The three partitions, written out by hand from ``_producer`` / ``_consumer`` and ``common.load_stage`` /
``common.mma_steps`` (keep it in step with them), run under random interleavings with mbarrier semantics (a parity
wait passes once the phase of that parity has completed, so it cannot tell phase p from p + 2), asynchronous TMA
copies and in-order wgmma completion. It checks that every wgmma reads the tile its K step expects, that no copy
overwrites a stage a wgmma still reads, that nothing deadlocks, and that every work item is computed (by both
consumers when cooperative, by one in ping-pong).
"""

from __future__ import annotations

import random


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _complete_if_done(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def arrive(self):
        assert self.pending > 0
        self.pending -= 1
        self._complete_if_done()

    def expect(self, nbytes):  # mbarrier.arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._complete_if_done()

    def passes(self, parity):
        return (self.phase & 1) != parity


def grouped_block(work, num_row_blocks, num_col_blocks, group_m):
    """common.grouped_block in Python."""
    per_group = group_m * num_col_blocks
    first = work // per_group * group_m
    in_group = min(num_row_blocks - first, group_m)
    return first + work % per_group % in_group, work % per_group // in_group


def work_units(num_work, k_steps, num_ctas, split_tail):
    """dx_sm90._work_units in Python: (whole items, parts per tail item, work units)."""
    tail = num_work % num_ctas if split_tail else 0
    parts = min(max(num_ctas // max(tail, 1), 1), k_steps) if split_tail else 1
    whole = num_work - tail
    return whole, parts, whole + tail * parts


def unit_item(unit, whole, parts, k_steps):
    """dx_sm90._unit_item in Python: work unit -> (work item, first K step, K steps)."""
    if unit < whole:
        return unit, 0, k_steps
    t = unit - whole
    part = t % parts
    first = part * k_steps // parts
    return whole + t // parts, first, (part + 1) * k_steps // parts - first


def simulate(seed, stages, pingpong, items, epilogue_without_steps=False):
    """One CTA's run over ``items``, its work items in order as (work id, K steps). Returns (errors, done): done[c]
    lists the items consumer c finished (took through its epilogue: items with K steps, and with
    ``epilogue_without_steps`` (wgrad_sm90 stores zeros) those without as well)."""
    rng = random.Random(seed)
    ready = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(1 if pingpong else 2) for _ in range(stages)]
    turn = [Barrier(1), Barrier(1)]
    tag, landed, readers = [None] * stages, [False] * stages, [set() for _ in range(stages)]
    copies, inflight, errors, done = [], {0: [], 1: []}, [], {0: [], 1: []}

    def producer():
        ring = 0
        for work, steps in items:
            for ks in range(steps):
                stage = ring % stages
                while not empty[stage].passes(((ring // stages) & 1) ^ 1):
                    yield
                if readers[stage]:
                    errors.append(("copy into a stage a wgmma reads", stage, ring))
                ready[stage].expect(2)
                landed[stage] = False
                copies.extend([(stage, (work, ks))] * 2)  # the A and the B box
                ring += 1
                yield

    def consumer(c):
        ring = 0
        for item, (work, steps) in enumerate(items):
            if not pingpong or item % 2 == c:
                if pingpong and item > 0:
                    while not turn[c].passes(((item - 1) // 2) & 1):
                        yield
                r = ring
                for ks in range(steps):
                    stage = r % stages
                    while not ready[stage].passes((r // stages) & 1):
                        yield
                    if not landed[stage] or tag[stage] != (work, ks):
                        errors.append(("wrong tile", c, work, ks, tag[stage]))
                    inflight[c].append((stage, (work, ks)))
                    readers[stage].add(c)
                    while len(inflight[c]) > 1:  # warpgroup_mma_wait(1)
                        yield
                    if ks > 0:
                        empty[(r + stages - 1) % stages].arrive()
                    r += 1
                    yield
                if pingpong:
                    turn[1 - c].arrive()
                while inflight[c]:  # warpgroup_mma_wait(0)
                    yield
                if steps > 0:
                    empty[(r + stages - 1) % stages].arrive()
                if steps > 0 or epilogue_without_steps:
                    done[c].append(work)
            ring += steps
            yield

    partitions = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    idle = 0
    while partitions or copies or inflight[0] or inflight[1]:
        choice = rng.choice(list(partitions) + ["copy"] * bool(copies) + [("mma", c) for c in (0, 1) if inflight[c]])
        if choice == "copy":
            stage, copied = copies.pop(0)
            tag[stage] = copied
            ready[stage].complete_tx(1)
            landed[stage] = ready[stage].tx == 0
        elif isinstance(choice, tuple):
            stage, read = inflight[choice[1]].pop(0)
            if tag[stage] != read:
                errors.append(("tile changed under a wgmma", choice[1], read, tag[stage]))
            readers[stage].discard(choice[1])
        else:
            try:
                next(partitions[choice])
                idle += 1
            except StopIteration:
                del partitions[choice]
        if choice == "copy" or isinstance(choice, tuple):
            idle = 0
        if idle > 5000:
            errors.append(("deadlock", list(partitions)))
            break
    return errors, done
