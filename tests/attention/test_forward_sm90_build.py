"""The Gluon sm_90 forward without a GPU: its sm_90 build (ptxas and cuobjdump ship with triton) at the tiles the
library launches. Its numerics are tested on the H200 (test_forward_gpu.py)."""

from __future__ import annotations

import os
import re

import pytest

fwd_sm90 = pytest.importorskip("flashmoe_science.attention.hopper.fwd_sm90")
from flashmoe_science.attention.tiles import sm90_forward_tiles  # noqa: E402
from flashmoe_science.hopper.common import offline_sass, spill_budget, spill_count  # noqa: E402

SMEM_PER_BLOCK = 232448  # sm_90's opt-in limit (ANCHORS.md)


# (head dim, causal, seqlen, Q buffers, cross-item) -> LDL + STL of the triton 3.6 build: the persistent kernel
# spills a few values at the work-item boundary only (docs/perf-notes.md), none at short causal rows' 64-key tiles
CASES = {
    (64, False, 2048, 2, True): 0,
    (128, False, 2048, 1, False): 65,
    (128, True, 512, 2, False): 0,
    (128, True, 4096, 1, False): 188,
    (256, True, 2048, 1, False): 38,
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "D{}-{}-L{}-q{}{}".format(
    c[0], "causal" if c[1] else "full", c[2], c[3], "-cross" if c[4] else ""))
def test_builds_for_sm90_with_tma_and_register_operand_pv(case):
    """S = Q Kᵀ from shared memory, O += P V with P from registers, K/V by TMA loads, O by TMA stores, the shared
    memory within a block's, spills no more than the tuned build's."""
    head_dim, causal, seqlen, q_buffers, cross_item = case
    tiles = sm90_forward_tiles(head_dim, causal, seqlen)
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, num_ctas=132, q_buffers=q_buffers,
                                        cross_item=cross_item)
    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("no cuobjdump in this triton")
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16 R\d+, gdesc" % tiles.block_n, sass)  # S: both from smem
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16 R\d+, R\d+, gdesc" % head_dim, sass)  # P·V: P in registers
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert spill_count(sass) <= spill_budget(CASES[case]), "spills grew"
    assert compiled.metadata.shared <= SMEM_PER_BLOCK
