"""What the warp-specialised sm_90 Gluon GEMMs of moe/hopper share (dx_sm90, wgrad_sm90); what every sm_90 kernel
shares (register split, launch options, wgmma layouts, descriptors, offline builds) is flashmoe_science.gluon.sm90.

Both run one producer warp that fills a ring of NUM_STAGES shared-memory stages by TMA (an A box and a B box per
stage, both completing on the stage's "ready" mbarrier) and two consumer warpgroups that issue async wgmmas on the
stages and release each one on its "empty" mbarrier once the wgmma after it has been issued and it has completed
(one wgmma in flight). The consumers either share each work item (cooperative: consumer c takes ROWS rows of the
output tile from ROW0 = c * ROWS; "empty" counts 2 arrivals) or alternate work items (ping-pong: "empty" counts 1,
and a "turn" barrier pair orders their main loops). The ring position advances by each work item's K steps, in the
same order in every partition; see dx_sm90's docstring for the protocol and why it is safe.

Here: the GROUP_M work order, the barriers' set-up, one producer step (``load_stage``), the consumer's main loop
(``mma_steps``) and the checks of a tile config. Gluon inlines these helpers: the kernels compile as if they were
written out in place.
"""

from __future__ import annotations

from flashmoe_science.gluon.compat import gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

NUM_CONSUMERS = 2
HOPPER_SMEM_PER_BLOCK = 232448  # bytes of shared memory a block may opt in to on sm_90


# ------------------------------------------------------------------------------------------------- device helpers
@gluon.jit
def grouped_block(work, num_row_blocks, num_col_blocks, GROUP_M: gl.constexpr):
    """Work item -> (row block, column block): mirrors triton_gemm._row_tile_and_col_block (GROUP_M consecutive row
    blocks sweep a column block together, so the operand block they share is read from L2 by all but one)."""
    programs_per_group = GROUP_M * num_col_blocks
    group = work // programs_per_group
    first_block = group * GROUP_M
    blocks_in_group = gl.minimum(num_row_blocks - first_block, GROUP_M)
    row_block = first_block + (work % programs_per_group) % blocks_in_group
    col_block = (work % programs_per_group) // blocks_in_group
    return row_block, col_block


@gluon.jit
def init_barriers(NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """(ready, empty, turn): the ring's barriers (ready: one arrival plus the TMA bytes; empty: one arrival per
    consumer reading the stage) and the ping-pong turn pair."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        # a stage is free again once every consumer that reads it has released it
        mbarrier.init(empty.index(i), count=1 if PINGPONG else 2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


@gluon.jit
def load_stage(a_desc, a_row, a_col, b_desc, b_row, b_col, a_smem, b_smem, ready, empty, ring,
               NUM_STAGES: gl.constexpr):
    """The producer's step at ring position ``ring``: wait until its stage is released, then TMA the A box at
    (a_row, a_col) and the B box at (b_row, b_col) into it, both completing on the stage's "ready" barrier."""
    stage = ring % NUM_STAGES
    # barriers start "phase 1 complete": the first pass over the ring does not wait
    mbarrier.wait(empty.index(stage), ((ring // NUM_STAGES) & 1) ^ 1)
    bar = ready.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_load(a_desc, [a_row, a_col], bar, a_smem.index(stage))
    tma.async_load(b_desc, [b_row, b_col], bar, b_smem.index(stage))


@gluon.jit
def mma_steps(a_smem, b_smem, ready, empty, ring, k_steps, acc,
              ROW0: gl.constexpr, ROWS: gl.constexpr, NUM_STAGES: gl.constexpr, A_MN_MAJOR: gl.constexpr,
              B_K_MAJOR: gl.constexpr = False):
    """acc += A[ROW0:ROW0+ROWS] @ B over k_steps ring stages from position `ring`, one async wgmma in flight: each
    stage is released once the wgmma after it has been issued and it has completed. A's stage holds the (rows, K)
    tile, or with A_MN_MAJOR the (K, rows) tile, read transposed by the wgmma (an MN-major A descriptor). B's stage
    holds the (K, N) tile, or with B_K_MAJOR the (N, K) tile (a weight stored (N, K), read transposed). Returns (acc
    with its last wgmma still in flight, the ring position after the item)."""
    for ks in range(k_steps):
        stage = ring % NUM_STAGES
        mbarrier.wait(ready.index(stage), (ring // NUM_STAGES) & 1)
        if A_MN_MAJOR:
            a = a_smem.index(stage).slice(ROW0, ROWS, dim=1).permute((1, 0))
        else:
            a = a_smem.index(stage).slice(ROW0, ROWS)
        if B_K_MAJOR:
            b = b_smem.index(stage).permute((1, 0))
        else:
            b = b_smem.index(stage)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step's wgmma is done: release its stage
        mbarrier.arrive(empty.index((ring + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=ks > 0)
        ring += 1
    return acc, ring


# --------------------------------------------------------------------------------------------------- host helpers
def check_tile_config(kernel: str, config, smem_needed: int, smem_limit: int) -> None:
    """The checks every GEMM config here shares (``config`` has block_n, block_k, pingpong, num_stages, group_m and
    label()); ValueError naming ``kernel`` and the field."""
    if config.block_n not in (128, 256):
        raise ValueError(f"{kernel}: block_n must be 128 or 256, got {config.block_n}")
    if config.block_k not in (32, 64, 128):
        raise ValueError(f"{kernel}: block_k must be 32, 64 or 128, got {config.block_k}")
    if config.pingpong and config.block_n != 128:
        # one warpgroup then holds the whole 128-row tile: 128 x 256 fp32 would be 256 registers per thread
        raise ValueError(f"{kernel}: pingpong needs block_n 128 (the 128 x block_n accumulator is one warpgroup's), "
                         f"got {config.block_n}")
    if config.num_stages < 2:
        raise ValueError(f"{kernel}: num_stages must be at least 2, got {config.num_stages}")
    if config.group_m < 1:
        raise ValueError(f"{kernel}: group_m must be positive, got {config.group_m}")
    if smem_needed > smem_limit:
        raise ValueError(f"{kernel}: {config.label()} needs {smem_needed} bytes of shared memory, more than the "
                         f"{smem_limit} a block may have")
