"""Expert-parallel MoE with the exchange planned by the Triton kernels (distributed/triton_plan.py, run under
TRITON_INTERPRET=1 on the CPU) in a gloo group: the moe_cases comparisons against the whole layer in one process."""

import moe_cases
from flashmoe_science.distributed import pair_plan


def _with_triton_plan(case):
    def run(rank, world_size):
        pair_plan.plans_in_triton = lambda topk_ids: True  # this rank's process only
        case(rank, world_size)
    return run


# ragged token counts with a rank of none, E not a multiple of W; a rank receiving nothing over 3 chunks; top-W
ep_triton_plan_ragged = _with_triton_plan(moe_cases.ep_ragged_tokens)
ep_triton_plan_rank_receives_nothing = _with_triton_plan(moe_cases.ep_rank_receives_nothing)
ep_triton_plan_no_overlap = _with_triton_plan(moe_cases.ep_no_overlap_sigmoid)

CASES = [name for name in dir() if name.startswith("ep_triton_plan")]
