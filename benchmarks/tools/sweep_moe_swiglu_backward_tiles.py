"""Time the MoE backward's elementwise SwiGLU pass (``_swiglu_backward_kernel``) over rows x columns per step and
warps, at the bench's T=4096 shapes. Prints GB/s of the bytes it must move (gate_up, dh and h read, d(gate, up)
written). Usage on the GPU: PYTHONPATH=src python benchmarks/tools/sweep_moe_swiglu_backward_tiles.py
"""

import torch
import triton
from triton.testing import do_bench

from flashmoe_science.bench.moe import MODELS
from flashmoe_science.moe import moe_route
from flashmoe_science.moe import gemms, layer
from flashmoe_science.moe import triton_gemm as tg
from flashmoe_science.moe.dispatch import sort_pairs_by_expert
from flashmoe_science.moe.tiles import choose_tiles


def main():
    for model, cfg in MODELS.items():
        E, k, d, F = cfg["num_experts"], cfg["top_k"], cfg["d_model"], cfg["d_ff"]
        T = 4096
        tiles = choose_tiles(T, k, E, d, F, torch.device("cuda"))
        weights, ids = moe_route(torch.randn(T, E, device="cuda"), k)
        weights32 = weights.float().contiguous()
        sort = sort_pairs_by_expert(ids, E, tiles.block_m)
        num_rows = sort.tile_expert.numel() * tiles.block_m
        x = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
        w1 = torch.empty(E, 2 * F, d, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(num_rows, 2 * F, device="cuda").to(torch.bfloat16)
        h = torch.randn(num_rows, F, device="cuda").to(torch.bfloat16)
        dgu, dweights = layer.backward_buffers(x, w1, sort, tiles)
        dh = gemms.dh_buffer(dgu)
        dh.normal_()
        base = tg.swiglu_backward_launch(gate_up, dh, h, weights32, dgu, dweights, sort)
        moved = T * k * F * (2 * 2 + dh.element_size() + 2 + 2 * 2)  # gate_up, dh, h read; d(gate, up) written
        print(f"{model} T={T}: rows {num_rows}, F {F}; default BLOCK_R {base.meta['BLOCK_R']} BLOCK_C "
              f"{base.meta['BLOCK_C']}")
        for rows in (1, 2, 4, 8, 16):
            for cols in (256, 512, 1024, 2048):
                for warps in (4, 8):
                    if cols > triton.next_power_of_2(F) or rows * cols // (32 * warps) < 4:
                        continue
                    launch = base._replace(meta=dict(BLOCK_R=rows, BLOCK_C=cols, num_warps=warps),
                                           grid=(triton.cdiv(num_rows, rows),))
                    ms = do_bench(launch, warmup=10, rep=40, return_mode="median")
                    print(f"  rows {rows:2d} cols {cols:4d} warps {warps}: {ms * 1e3:8.1f} us "
                          f"{moved / ms / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
