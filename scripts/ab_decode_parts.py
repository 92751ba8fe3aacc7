"""Where the one-launch decode kernel's time goes at Qwen3-30B-A3B T=1: the kernel against copies of itself with
one part changed (timing only, their outputs are wrong by design), under CUDA graphs in a stack of layers.

    PYTHONPATH=src:scripts python scripts/ab_decode_parts.py --out $OUT/decode-parts

Variants (written from triton_decode's source into a module under --out, then imported):
  as-is         the kernel
  store         the w2 loop's float32 atomics replaced by plain stores (same bytes, no same-address contention)
  no-w2         the w2 loop removed, h stored instead (the gate/up stream alone)
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys

import torch

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, _make_inputs, _routed_expert_bytes
from flashmoe_science.moe import triton_decode as td

BANDWIDTH = 4.3e12


def variant_modules(out_dir):
    """{name: module} of triton_decode's source with one part changed (each its own module file)."""
    source = inspect.getsource(td)
    atomic = 'tl.atomic_add(acc_ptrs, part, mask=x_row & d_valid[None, :], sem="relaxed")'
    loop = "for d0 in range(0, d_model, BLOCK_D):\n            d_valid = (d0 + ds) < d_model\n            w = tl.load(w2_ptrs"
    assert atomic in source and loop in source
    sources = {
        "store": source.replace(atomic, "tl.store(acc_ptrs, part, mask=x_row & d_valid[None, :])"),
        # h stored (into acc) so that the gate/up stream is not dead code
        "no-w2": source.replace(loop, "tl.store(acc_ptr + row * d_model + tile_rows[:, None] * 0 + fs[None, :], "
                                      "h.to(tl.float32), mask=x_row & (fs < d_ff)[None, :])\n        "
                                + loop.replace("range(0, d_model, BLOCK_D)", "range(0, 0, BLOCK_D)")),
    }
    modules = {}
    for name, text in sources.items():
        module_name = "decode_variant_" + name.replace("-", "_")
        path = os.path.join(out_dir, module_name + ".py")
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode-parts")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--unpipelined", action="store_true", help="num_stages=1 configs, the kernel as it is only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = variant_modules(args.out)
    dims = MODELS["qwen3-30b-a3b"]
    top_k = dims["top_k"]
    torch.manual_seed(0)
    layers = [_make_inputs(1, dims["num_experts"], dims["d_model"], dims["d_ff"], torch.bfloat16,
                           torch.device("cuda")) for _ in range(args.layers)]
    num_bytes = _routed_expert_bytes(layers[0], top_k)
    base = td.decode_config(2)
    configs = [base, base._replace(block_f=16, block_k=512, num_stages=3), base._replace(block_f=16, block_k=1024,
               num_stages=2), base._replace(block_f=32, block_k=512, num_stages=2),
               base._replace(block_f=16, block_k=512, num_stages=2, num_warps=8),
               base._replace(block_f=16, block_k=2048, num_stages=1)]
    if args.unpipelined:
        # num_stages=1: plain loads into registers (no cp.async ring), several programs per SM instead
        configs = [base] + [base._replace(block_f=f, block_k=k, num_stages=1, num_warps=w)
                            for f, k, w in ((64, 128, 4), (32, 128, 4), (16, 128, 4), (16, 256, 4), (32, 64, 4),
                                            (16, 128, 2), (32, 256, 8))]
    for name, kernel in (("as-is", td._decode_moe_kernel), ("store", variants["store"]._decode_moe_kernel),
                         ("no-w2", variants["no-w2"]._decode_moe_kernel))[:1 if args.unpipelined else 3]:
        for config in configs:
            def layer_call(layer, config=config, kernel=kernel):
                x, w1, w2, logits = layer
                out, acc, arrivals = td.decode_buffers(x)
                launch = td.decode_launch(x, w1, w2, out, acc, arrivals, logits, logits, top_k, True, True, False,
                                          config)
                launch._replace(kernel=kernel)()
            try:
                one = _graph_median_ms(lambda: layer_call(layers[0]))
                stack = _graph_median_ms(lambda: [layer_call(layer) for layer in layers]) / args.layers
            except Exception as error:  # noqa: BLE001
                print(f"{name:6s} {tuple(config)}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            print(f"{name:6s} f{config.block_f} k{config.block_k} d{config.block_d} w{config.num_warps} "
                  f"s{config.num_stages}: one layer {one * 1e3:5.1f} us, stack {stack * 1e3:5.1f} us/layer "
                  f"({num_bytes / (stack * 1e-3) / BANDWIDTH:.2f} of 4.3 TB/s)", flush=True)


if __name__ == "__main__":
    main()
