"""Two small warp-specialised Gluon kernels that are race-free by construction, for reading racecheck's reports on
the sm_90 attention kernels:

    compute-sanitizer --tool racecheck python3 benchmarks/tools/racecheck_probe.py [ws-only] [handoff]

- ``ws-only``: a 4-warp default partition and a 1-warp worker that touch no shared memory of their own; anything
  racecheck reports here comes from Triton's warp-specialisation runtime (the per-warp partition table the default
  warps write before the named barrier that starts the workers), not from a kernel's code.
- ``handoff``: the attention kernels' record handoff through a ring of shared-memory slots guarded by mbarriers: a
  1-warp producer waits for a slot's ``empty`` barrier, stores two int32 into it and arrives on its ``full`` barrier;
  the 4-warp consumer waits for ``full``, loads the pair, and arrives on ``empty``. The consumer checks every pair
  it reads (a wrong one would be a real race) and the host checks the sum.

Prints "ok NAME" per probe; compare the sanitizer's report with the attention kernels' (sanitize_kernels.py)."""

from __future__ import annotations

import sys

import torch

from flashmoe_science.gluon.compat import gl, gluon, mbarrier

ROUNDS = 64
SLOTS = 2
_PAIR = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))
_PAIR4 = gl.constexpr(gl.BlockedLayout([2], [32], [4], [0]))


@gluon.jit
def _ws_default(out):
    gl.store(out + gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])), 1)


@gluon.jit
def _ws_worker(out):
    gl.store(out + 128 + gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0])), 2)


@gluon.jit
def ws_only_kernel(out):
    gl.warp_specialize([(_ws_default, (out,)), (_ws_worker, (out,))], [1], [24])


@gluon.jit
def _producer(records, full, empty, ROUNDS: gl.constexpr, SLOTS: gl.constexpr):
    pair = gl.arange(0, 2, layout=_PAIR)
    for i in range(ROUNDS):
        slot = i % SLOTS
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # first pass: passes at once
        records.index(slot).store(gl.where(pair == 0, i, 3 * i))
        mbarrier.arrive(full.index(slot), count=1)


@gluon.jit
def _consumer(records, full, empty, out, ROUNDS: gl.constexpr, SLOTS: gl.constexpr):
    index = gl.arange(0, 2, layout=_PAIR4)
    total = 0
    for i in range(ROUNDS):
        slot = i % SLOTS
        mbarrier.wait(full.index(slot), (i // SLOTS) & 1)
        got = records.index(slot).load(_PAIR4)
        first = gl.sum(gl.where(index == 0, got, 0), 0)
        second = gl.sum(gl.where(index == 1, got, 0), 0)
        total += first + second + (second != 3 * first).to(gl.int32) * 1000000  # a torn pair shows in the sum
        mbarrier.arrive(empty.index(slot), count=1)
    gl.store(out, total)


@gluon.jit
def handoff_kernel(out, ROUNDS: gl.constexpr, SLOTS: gl.constexpr):
    records = gl.allocate_shared_memory(gl.int32, [SLOTS, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_consumer, (records, full, empty, out, ROUNDS, SLOTS)),
                        (_producer, (records, full, empty, ROUNDS, SLOTS))], [1], [24])


def main(names: list[str]) -> int:
    names = names or ["ws-only", "handoff"]
    if "ws-only" in names:
        out = torch.zeros(160, dtype=torch.int32, device="cuda")
        ws_only_kernel[(1,)](out, num_warps=4)
        assert out[:128].eq(1).all() and out[128:].eq(2).all()
        print("ok ws-only", flush=True)
    if "handoff" in names:
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        handoff_kernel[(1,)](out, ROUNDS, SLOTS, num_warps=4)
        expect = sum(4 * i for i in range(ROUNDS))
        assert int(out) == expect, (int(out), expect)
        print("ok handoff", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
