"""The Triton kernels' plain path before and after the mask/varlen features (run once with each tree's src on
PYTHONPATH), and what a window costs: ms of forward and backward, backend="triton", bf16.

    PYTHONPATH=src python benchmarks/tools/ab_triton_features.py [label]
"""

import sys

import torch
from triton.testing import do_bench

from flashmoe_science import flash_attention_science

label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
cases = [((2, 16, 4096, 128), {}), ((2, 16, 4096, 128), dict(causal=True)), ((4, 8, 2048, 64), dict(causal=True)),
         ((16, 16, 2048, 64), dict(causal=True)), ((1, 16, 32768, 128), dict(causal=True))]
try:  # only the new tree takes a window
    flash_attention_science(*(torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16),) * 3, window=(8, 0))
    cases += [((1, 16, 32768, 128), dict(causal=True, window=(4095, 0))), ((2, 16, 4096, 128), dict(softcap=30.0))]
except TypeError:
    pass
for shape, kwargs in cases:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fwd = do_bench(lambda: flash_attention_science(q, k, v, backend="triton", **kwargs), warmup=25, rep=100,
                   return_mode="median")
    out = flash_attention_science(q, k, v, backend="triton", **kwargs)
    dout = torch.randn_like(out)
    bwd = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=25, rep=100, grad_to_none=[q, k, v],
                   return_mode="median")
    print(f"{label}: {shape} {kwargs} fwd {fwd:.3f} ms bwd {bwd:.3f} ms", flush=True)
