"""One launch of the Gluon sm_90 backward (and the Triton dK/dV pass beside it) for Nsight Compute:

    ncu --set full -k regex:"attention_backward_sm90|_bwd_dkdv" --launch-skip 0 --launch-count 2 \\
        python benchmarks/tools/profile_attention_backward_ncu.py [B H L D causal]

Each kernel runs twice (warm-up, then the profiled launch is whichever ncu picks by its filters)."""
import math
import sys

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper import bwd_sm90
from flashmoe_science.attention.tiles import padded_head_dim

b, h, length, d, causal = (map(int, sys.argv[1:6]) if len(sys.argv) > 5 else (4, 16, 4096, 128, 0))
causal = bool(causal)
q, k, v, grad_out = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
scale = 1.0 / math.sqrt(d)
with torch.no_grad():
    out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
delta = torch.empty_like(lse)
dq_accum = torch.empty(b, h, length, padded_head_dim(d), device="cuda")
for _ in range(2):
    bwd_sm90.attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, causal, scale, dq_accum)
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
for _ in range(2):
    flash_attention_science(qg, kg, vg, causal=causal).backward(grad_out)
torch.cuda.synchronize()
print("done")
