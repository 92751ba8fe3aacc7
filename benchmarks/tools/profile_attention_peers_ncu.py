"""Forward and backward of one attention backend, for Nsight Compute beside a peer:

    ncu --profile-from-start off --section SpeedOfLight ... \\
        python benchmarks/tools/profile_attention_peers_ncu.py {flashmoe|fa4} B H L D causal

Two warm-up rounds of forward + backward through the public calls (ours: flash_attention_science; FA4:
flash_attn.cute.flash_attn_func, (B, L, H, D) layout), then the profiled round runs warm, compiled
kernels between cudaProfilerStart and Stop (process-wide: autograd runs the backward on its own thread, which a
thread-local NVTX range would miss)."""
import sys

import torch

backend, b, h, length, d, causal = sys.argv[1], *map(int, sys.argv[2:7])
causal = bool(causal)
if backend == "fa4":
    from flash_attn.cute import flash_attn_func

    shape = (b, length, h, d)

    def attend(q, k, v):
        result = flash_attn_func(q, k, v, causal=causal)
        return result[0] if isinstance(result, tuple) else result
else:
    from flashmoe_science.attention.api import flash_attention_science

    shape = (b, h, length, d)

    def attend(q, k, v):
        return flash_attention_science(q, k, v, causal=causal)

q, k, v, grad_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
for _ in range(2):
    attend(q, k, v).backward(grad_out)
torch.cuda.synchronize()
torch.cuda.profiler.start()
attend(q, k, v).backward(grad_out)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
torch.cuda.synchronize()
print("done", backend, b, h, length, d, causal)
