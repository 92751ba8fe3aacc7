"""Host time of an engine's prefill step through `engine_attention.prefill_into`, as vLLM and SGLang run it: under
torch.inference_mode, one prompt, a model's layers each a 4096 x 6144 matmul then the packed call, a new prompt length
every step. The step's cumulative lengths are either an inference tensor (`inference`: what the engines held before
`packed_lengths`) or `packed_lengths`' (`packed`); SDPA's call in the packed call's place (`sdpa`) is the host-time
yardstick. Prints per length: the step's host and wall ms (medians), and the call's host us on layers 2..L.

    PYTHONPATH=src python benchmarks/tools/engine_prefill_host.py [--lengths 338,1044,1985] [--layers 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from flashmoe_science.integrations.engine_attention import LayerOptions, packed_lengths, prefill_into, warm_prefill

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096
MODES = ("inference", "packed", "sdpa")


def step(length: int, mode: str, layers: int, weight: torch.Tensor, options: LayerOptions,
         per_layer: list | None = None) -> tuple[float, float]:
    """(host ms, wall ms) of one step of `layers` layers over a prompt of `length` tokens."""
    dev = weight.device
    x = torch.randn(length, HIDDEN, device=dev, dtype=weight.dtype)
    q = torch.randn(length, HEADS, HEAD_DIM, device=dev, dtype=weight.dtype)
    k, v = (torch.randn(length, KV_HEADS, HEAD_DIM, device=dev, dtype=weight.dtype) for _ in range(2))
    out = torch.empty_like(q)
    starts = torch.zeros(2, dtype=torch.int32, device=dev)  # the engine's persistent buffer, written in place
    starts[1] = length
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cu = packed_lengths(starts - 0) if mode == "packed" else starts - 0
    for _ in range(layers):
        x @ weight
        t = time.perf_counter()
        if mode == "sdpa":
            o = torch.nn.functional.scaled_dot_product_attention(
                *(t_.transpose(0, 1)[None] for t_ in (q, k, v)), is_causal=True, enable_gqa=True)
            out.copy_(o[0].transpose(0, 1))
        else:
            prefill_into(out, options, q, k, v, cu, cu, length, length)
        if per_layer is not None:
            per_layer.append((time.perf_counter() - t) * 1e6)
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="338,1044,1985")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    dev = torch.device("cuda")
    options = LayerOptions(HEAD_DIM ** -0.5)
    with torch.inference_mode():
        warm_prefill(options, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, dev)
        weight = torch.randn(HIDDEN, 6144, device=dev, dtype=torch.bfloat16)
        print(torch.cuda.get_device_name(), "| layers", args.layers)
        for length in (int(n) for n in args.lengths.split(",")):
            for mode in MODES:
                step(length, mode, args.layers, weight, options)
            for mode in MODES:  # lengths differ step to step, as fresh prompts do
                times = [step(length + i % 7, mode, args.layers, weight, options) for i in range(args.steps)]
                per_layer: list = []
                step(length + 11, mode, args.layers, weight, options, per_layer)
                host, wall = np.median(np.array(times), axis=0)
                print(f"{length:6d} tokens  {mode:9s}  step host {host:6.2f} ms  wall {wall:6.2f} ms  "
                      f"call host (layers 2..) {np.median(per_layer[1:]):6.0f} us", flush=True)


if __name__ == "__main__":
    main()
