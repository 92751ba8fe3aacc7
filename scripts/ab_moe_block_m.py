"""A/B of the MoE backward's row tile at a few tokens per expert: the tiles choose_tiles picks for T against the
tiles it picks for larger T (128-row tiles: the Gluon dx/dw1/dw2 kernels on Hopper), beside the torch._grouped_mm
pipeline's backward. do_bench medians.

    PYTHONPATH=src python scripts/ab_moe_block_m.py [--model mixtral-8x7b] [--tokens 256] [--as-tokens 256,512,4096]
"""

import argparse

import torch
import triton.testing

from flashmoe_science.bench.moe import MODELS, _make_inputs, torch_grouped_mm_moe
from flashmoe_science.moe import moe_route, triton_gemm
from flashmoe_science.moe.tiles import choose_tiles

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mixtral-8x7b")
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--as-tokens", default="256,512,4096")
args = parser.parse_args()
shape = MODELS[args.model]
k, E, d, F = shape["top_k"], shape["num_experts"], shape["d_model"], shape["d_ff"]
x, w1, w2, logits = _make_inputs(args.tokens, E, d, F, torch.bfloat16, "cuda")
bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731

leaves = [t.detach().requires_grad_() for t in (x, w1, w2, logits)]
out = torch_grouped_mm_moe(*leaves, k)
grad_out = torch.randn_like(out)
ref_ms = bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
print(f"{args.model} T={args.tokens}: grouped_mm pipeline backward {ref_ms:.3f} ms")

weights, ids = moe_route(logits, k)
weights32 = weights.float().contiguous()
for as_tokens in (int(t) for t in args.as_tokens.split(",")):
    tiles = choose_tiles(as_tokens, k, E, d, F, x.device)
    _, saved = triton_gemm.moe_forward(x, w1, w2, weights32, ids, tiles=tiles, save_for_backward=True)
    ms = bench(lambda: triton_gemm.moe_backward(grad_out, x, w1, w2, weights32, saved))
    fwd = bench(lambda: triton_gemm.moe_forward(x, w1, w2, weights32, ids, tiles=tiles))
    print(f"  tiles of T={as_tokens} (block_m {tiles.block_m}): backward {ms:.3f} ms = {ref_ms / ms:.2f}x grouped_mm;"
          f" forward {fwd:.3f} ms")
