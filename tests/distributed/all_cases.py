"""Every distributed case, as "module.function" names for dist_spawn.run_cases."""

import bench_cases
import moe_cases
import ring_cases

CASES = [f"{module.__name__}.{name}" for module in (ring_cases, moe_cases, bench_cases) for name in module.CASES]
