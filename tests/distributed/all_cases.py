"""Every distributed case, as "module.function" names for dist_spawn.run_cases."""

import bench_cases
import moe_cases
import ring_cases

CASES = [f"{module.__name__}.{name}" for module in (ring_cases, moe_cases, bench_cases) for name in module.CASES]
# on GPUs the benchmark's harness runs its full sizes (128k to 1M tokens, minutes), so the GPU spawns leave it out
GPU_CASES = [f"{module.__name__}.{name}" for module in (ring_cases, moe_cases) for name in module.CASES]


def cases_for(device: str) -> list[str]:
    """The cases one spawn on ``device`` ("cpu" or "cuda") runs."""
    return GPU_CASES if device == "cuda" else CASES
