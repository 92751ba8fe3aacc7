"""Forward launches of the sm_90 kernel at one shape, for `ncu` (see docs/perf-notes.md for the command).

    PYTHONPATH=src python benchmarks/tools/profile_attention_forward_ncu.py B H L D CAUSAL BLOCK_N STAGES

Launches the persistent kernel, then the one-CTA-per-tile grid, twice each (read the second of each)."""
import sys

import torch

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import AttentionTiles

b, h, l, d, causal, block_n, stages = (int(a) for a in (sys.argv[1:] + ["4", "16", "4096", "128", "0", "128", "2"][len(sys.argv) - 1:]))
q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(b, h, l, device="cuda")
tiles = AttentionTiles(128, block_n, 8, stages, True)
for num_ctas in (torch.cuda.get_device_properties(0).multi_processor_count, None):
    for _ in range(2):  # the second launch of each is the one to read (warm caches, no compile)
        fwd_sm90.attention_forward_sm90(q, k, v, out, lse, bool(causal), d**-0.5, tiles, num_ctas=num_ctas)
torch.cuda.synchronize()
