"""Qwen3-30B-A3B T=1 decode: the one-launch kernel (triton_decode, tl.dot on 16-row tiles, cp.async pipeline) against
a CUDA-core variant whose weight loads are plain vectorised loads into registers (num_stages=1, several programs per
SM, float32 FMAs and a row sum), perf notes v23's last open question. Both on given routing (ids and weights), one
layer per CUDA graph and stacked (--layers per graph, time per layer); outputs checked against the library kernel.

    PYTHONPATH=src:scripts python scripts/ab_decode_cuda_core.py [--layers 8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, _make_inputs, _routed_expert_bytes
from flashmoe_science.moe import moe_route
from flashmoe_science.moe import triton_decode as td

BANDWIDTH = 4.3e12


@triton.jit
def _decode_cuda_core_kernel(x_ptr, w1_ptr, w2_ptr, out_ptr, acc_ptr, arrivals_ptr, weights_ptr, ids_ptr,
                             d_model, d_ff, TOP_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """Contiguous weights (E, 2F, d) and (E, d, F), x (T, d), weights/ids (T, k) contiguous."""
    slices = tl.cdiv(d_ff, BLOCK_F)
    pid = tl.program_id(0)
    token = pid // (TOP_K * slices)
    slot = (pid // slices) % TOP_K
    f_slice = pid % slices
    weight = tl.load(weights_ptr + token * TOP_K + slot)
    expert = tl.load(ids_ptr + token * TOP_K + slot).to(tl.int64)
    row = token.to(tl.int64)
    fs = f_slice * BLOCK_F + tl.arange(0, BLOCK_F)
    ks = tl.arange(0, BLOCK_K)
    gate_ptrs = w1_ptr + expert * 2 * d_ff * d_model + fs[:, None] * d_model + ks[None, :]
    up_ptrs = gate_ptrs + d_ff * d_model
    x_ptrs = x_ptr + row * d_model + ks
    acc_gate = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
    for _ in range(0, d_model, BLOCK_K):
        xs = tl.load(x_ptrs).to(tl.float32)[None, :]
        acc_gate += tl.load(gate_ptrs).to(tl.float32) * xs
        acc_up += tl.load(up_ptrs).to(tl.float32) * xs
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    h = (gate * tl.sigmoid(gate) * up).to(w2_ptr.dtype.element_ty).to(tl.float32) * weight
    ds = tl.arange(0, BLOCK_D)
    w2_ptrs = w2_ptr + expert * d_model * d_ff + ds[:, None] * d_ff + fs[None, :]
    acc_ptrs = acc_ptr + row * d_model + ds
    for _ in range(0, d_model, BLOCK_D):
        part = tl.sum(tl.load(w2_ptrs).to(tl.float32) * h[None, :], axis=1)
        tl.atomic_add(acc_ptrs, part, sem="relaxed")
        w2_ptrs += BLOCK_D * d_ff
        acc_ptrs += BLOCK_D
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
    if arrived == TOP_K * slices - 1:
        for d0 in range(0, d_model, BLOCK_D):
            total = tl.load(acc_ptr + row * d_model + d0 + ds, cache_modifier=".cg")
            tl.store(out_ptr + row * d_model + d0 + ds, total.to(out_ptr.dtype.element_ty))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dims = MODELS["qwen3-30b-a3b"]
    top_k, d_model, d_ff = dims["top_k"], dims["d_model"], dims["d_ff"]
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        x, w1, w2, logits = _make_inputs(1, dims["num_experts"], d_model, d_ff, torch.bfloat16, torch.device("cuda"))
        weights, ids = moe_route(logits, top_k)
        layers.append((x, w1, w2, weights.float().contiguous(), ids.to(torch.int32).contiguous()))
    num_bytes = _routed_expert_bytes((layers[0][0], layers[0][1], layers[0][2], logits), top_k)

    def library(layer):
        x, w1, w2, weights, ids = layer
        out, _ = td.decode_forward(x, w1, w2, weights, ids, top_k)
        return out

    def cuda_core(layer, f, k, d, warps):
        x, w1, w2, weights, ids = layer
        out, acc, arrivals = td.decode_buffers(x)
        grid = (x.shape[0] * top_k * triton.cdiv(d_ff, f),)
        _decode_cuda_core_kernel[grid](x, w1, w2, out, acc, arrivals, weights, ids, d_model, d_ff, TOP_K=top_k,
                                       BLOCK_F=f, BLOCK_K=k, BLOCK_D=d, num_warps=warps, num_stages=1)
        return out

    ref = library(layers[0])
    variants = {"library": library}
    for f, k, d, warps in ((16, 256, 64, 4), (32, 128, 64, 4), (16, 512, 64, 8), (32, 256, 32, 8), (8, 512, 128, 4),
                           (16, 128, 128, 2), (32, 64, 64, 2)):
        variants[f"cuda-core f{f} k{k} d{d} w{warps}"] = (lambda layer, f=f, k=k, d=d, w=warps:
                                                          cuda_core(layer, f, k, d, w))
    for _round in range(2):
        for name, fn in variants.items():
            try:
                out = fn(layers[0])
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                one = _graph_median_ms(lambda: fn(layers[0]))
                stack = _graph_median_ms(lambda: [fn(layer) for layer in layers]) / args.layers
            except Exception as error:  # noqa: BLE001
                print(f"{name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            print(f"{name:<28} err {err:.1e}  one layer {one * 1e3:5.1f} us ({num_bytes / (one * 1e-3) / BANDWIDTH:.2f})"
                  f", stack {stack * 1e3:5.1f} us/layer ({num_bytes / (stack * 1e-3) / BANDWIDTH:.2f} of 4.3 TB/s)",
                  flush=True)


if __name__ == "__main__":
    main()
