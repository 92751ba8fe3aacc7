"""Sweep the Gluon sm_90 e4m3 forward's tiles and schedule on one GPU, beside the Triton e4m3 kernel on the same
inputs: the data behind hopper/tiles.sm90_fp8_forward_tiles.

    PYTHONPATH=src python benchmarks/tools/sweep_attention_fp8_sm90.py --out $OUT [--shapes 1x16x16384x128,...]
        [--budget-s 60]

Per shape and mask (non-causal, causal): the plan's schedule, then ring depths 2/3/4, 64- and 128-key tiles, one or
two Q buffers per consumer and one CTA per query tile, where they fit the shared memory; the kernel alone on
preallocated outputs (fwd_sm90.attention_forward_sm90_fp8), triton's do_bench median. Each schedule's output is
compared with the plan's (max |diff|). Stops starting new schedules after --budget-s seconds. Writes
sweep_fp8_sm90.json under --out and prints one line per schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
import triton

from flashmoe_science import quantize_fp8
from flashmoe_science.attention.fp8 import fp8_problem
from flashmoe_science.attention.hopper.backend import fp8_forward_plan
from flashmoe_science.attention.hopper.fwd_sm90 import attention_forward_sm90_fp8
from flashmoe_science.attention.hopper.tiles import sm90_fp8_smem_bytes
from flashmoe_science.attention.triton.backend import TritonFp8Forward
from flashmoe_science.device import device_traits

DEFAULT_SHAPES = "1x16x16384x128,1x8x16384x256"


def _schedules(plan, head_dim, smem):
    """The plan's schedule first, then its neighbours that fit."""
    yield plan
    for block_n in (128, 64):
        for stages in (2, 3, 4):
            for persistent, q_buffers in ((True, 2), (True, 1), (False, 1)):
                tiles = replace(plan.tiles, block_n=block_n, num_stages=stages)
                other = replace(plan, tiles=tiles, persistent=persistent, q_buffers=q_buffers)
                if other != plan and sm90_fp8_smem_bytes(tiles, head_dim, q_buffers) <= smem:
                    yield other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--budget-s", type=float, default=60.0)
    args = parser.parse_args()
    start, rows = time.time(), []
    traits = device_traits(torch.device("cuda"))
    for shape in args.shapes.split(","):
        b, h, length, d = map(int, shape.split("x"))
        x = [torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        inputs = quantize_fp8(*x)
        for causal in (False, True):
            flops = 4 * b * h * length * length * d / (2 if causal else 1)
            problem = fp8_problem(*inputs, causal=causal, softmax_scale=None, backend="auto")
            plan = fp8_forward_plan(problem)
            reference = None
            triton_ms = triton.testing.do_bench(lambda: TritonFp8Forward().run(problem))
            rows.append(dict(shape=shape, causal=causal, kernel="triton", ms=triton_ms,
                             tflops=flops / triton_ms / 1e9))
            print(f"{shape} causal={causal} triton: {triton_ms:.3f} ms {flops / triton_ms / 1e9:.0f} TFLOP/s",
                  flush=True)
            for schedule in _schedules(plan, d, traits.smem_per_block):
                if time.time() - start > args.budget_s:
                    break
                out = torch.empty(inputs.q.shape, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(inputs.q.shape[:3], dtype=torch.float32, device="cuda")
                num_ctas = traits.sm_count if schedule.persistent else None

                def launch():
                    attention_forward_sm90_fp8(*inputs[:3], out, lse, *inputs[3:], causal, problem.softmax_scale,
                                               schedule.tiles, num_ctas, schedule.q_buffers)

                try:
                    launch()
                except Exception as error:  # a schedule that does not build or launch: reported, not fatal
                    print(f"{shape} causal={causal} {schedule}: {type(error).__name__}: {error}"[:300], flush=True)
                    continue
                if reference is None:
                    reference = out.clone()
                ms = triton.testing.do_bench(launch)
                row = dict(shape=shape, causal=causal, kernel="gluon", plan=schedule == plan,
                           block_n=schedule.tiles.block_n, stages=schedule.tiles.num_stages,
                           persistent=schedule.persistent, q_buffers=schedule.q_buffers, ms=ms,
                           tflops=flops / ms / 1e9, max_diff=(out.float() - reference.float()).abs().max().item())
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    with open(os.path.join(args.out, "sweep_fp8_sm90.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
