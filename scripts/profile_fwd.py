"""One forward launch per kernel at one shape, for `ncu` (see docs/perf-notes.md for the command)."""
import sys

import torch

from flashmoe_science.attention import triton_fwd
from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import AttentionTiles

b, h, l, d = 4, 16, 4096, int(sys.argv[1]) if len(sys.argv) > 1 else 128
q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(b, h, l, device="cuda")
for _ in range(2):  # the second launch of each is the one to read (warm caches, no compile)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, False, d**-0.5, AttentionTiles(128, 128, 8, 2, True))
    triton_fwd.attention_forward(q, k, v, out, lse, False, d**-0.5, AttentionTiles(128, 64, 8, 3, False))
torch.cuda.synchronize()
