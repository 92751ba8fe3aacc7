"""Where a one-token decode call's time goes, under CUDA graphs (do_bench medians): the workspace fill alone, the
decode kernel with the routing inside vs given (routing computed outside the graph), per config.

    PYTHONPATH=src python scripts/time_decode_parts.py [--model qwen3-30b-a3b] [--configs 64,128,256,4,4 ...]
"""

import argparse

import torch

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, _make_inputs, _routed_expert_bytes
from flashmoe_science.moe import moe_route, triton_decode

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="qwen3-30b-a3b")
parser.add_argument("--configs", nargs="+", default=["64,128,256,4,4", "32,128,256,4,4"])
args = parser.parse_args()
shape = MODELS[args.model]
k = shape["top_k"]
x, w1, w2, logits = _make_inputs(1, shape["num_experts"], shape["d_model"], shape["d_ff"], torch.bfloat16, "cuda")
gbytes = _routed_expert_bytes((x, w1, w2, logits), k) / 1e9
with torch.no_grad():
    weights, ids = moe_route(logits, k)
    fill = _graph_median_ms(lambda: triton_decode.decode_buffers(x))
    print(f"{args.model} T=1, {gbytes * 1e3:.1f} MB of weights ({gbytes / 4.3e3 * 1e6:.1f} us at 4.3 TB/s); "
          f"workspace fill alone {fill * 1e3:.1f} us")
    for text in args.configs:
        config = triton_decode.DecodeConfig(*(int(v) for v in text.split(",")))
        routed = _graph_median_ms(lambda: triton_decode.decode_forward(x, w1, w2, logits, None, k, route=True,
                                                                       config=config))
        given = _graph_median_ms(lambda: triton_decode.decode_forward(x, w1, w2, weights, ids, k, config=config))
        print(f"  {tuple(config)}: routing inside {routed * 1e3:.1f} us ({gbytes / routed:.0f} GB/s), "
              f"routing given {given * 1e3:.1f} us")
