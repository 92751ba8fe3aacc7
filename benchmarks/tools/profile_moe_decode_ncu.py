"""Run the one-launch decode kernel a few times for ncu:

    ncu -k regex:_decode_moe_kernel --launch-skip 3 --launch-count 1 --section ... \
        python benchmarks/tools/profile_moe_decode_ncu.py --model qwen3-30b-a3b --config 64,128,256,4,4
"""

import argparse

import torch

from flashmoe_science.bench.moe import MODELS, _make_inputs
from flashmoe_science.moe import triton_decode

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="qwen3-30b-a3b")
parser.add_argument("--tokens", type=int, default=1)
parser.add_argument("--config", default="64,128,256,4,4")
args = parser.parse_args()
shape = MODELS[args.model]
config = triton_decode.DecodeConfig(*(int(v) for v in args.config.split(",")))
x, w1, w2, logits = _make_inputs(args.tokens, shape["num_experts"], shape["d_model"], shape["d_ff"], torch.bfloat16,
                                 "cuda")
with torch.no_grad():
    for _ in range(5):
        triton_decode.decode_forward(x, w1, w2, logits, None, shape["top_k"], route=True, config=config)
torch.cuda.synchronize()
