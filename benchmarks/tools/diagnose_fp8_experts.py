#!/usr/bin/env python
# GPU only: `OUT=dir PYTHONPATH=src python benchmarks/tools/diagnose_fp8_experts.py` from the repository root.
# Where the GPU's FP8 up stage departs from the float64 emulation: the emulation's own e4m3 conversions on CUDA
# (torch) against bit-exact ones, the kernels' x quantisation against round-to-nearest-even, and per tile family
# h against three oracles (torch-conversion oracle on CUDA, exact oracle on CUDA, exact oracle on CPU), on normal x
# and on losslessly quantised x (the GEMM alone). Qwen3-like dims, 2048 tokens; writes $OUT/fp8bug_diagnose.json.
import json, os, sys, torch
sys.path[:0] = ["tests/moe", "tests"]
from dataclasses import replace
import torch.nn.functional as F
from flashmoe_science.moe import moe_route
from flashmoe_science.moe.fp8 import FP8, quantize_fp8_groups, _per_group, dequantize_fp8, round_to_e4m3
from flashmoe_science.moe.triton_fp8_gemm import fp8_up, fp8_tile_candidates, quantize_groups_launch
from fp8_testing import quantized_experts, rne_e4m3, e4m3_values, exact_dequantized
from test_moe_fp8 import _losslessly_quantised
out, records = os.environ["OUT"], []
def log(r):
    print(json.dumps(r), flush=True); records.append(r)
torch.manual_seed(0)
v = torch.randn(1 << 22, dtype=torch.float64, device="cuda") * torch.exp(2 * torch.randn(1 << 22, dtype=torch.float64, device="cuda"))
codes = torch.arange(256, dtype=torch.uint8, device="cuda").view(FP8)
finite = ~torch.isnan(codes.double())
log({"check": "torch cuda conversions vs exact",
     "f64_to_e4m3_mismatch": (round_to_e4m3(v) != rne_e4m3(v)).double().mean().item(),
     "f32_to_e4m3_mismatch": (round_to_e4m3(v.float()).double() != rne_e4m3(v.float()).double()).double().mean().item(),
     "bf16_to_e4m3_mismatch": (round_to_e4m3(v.bfloat16()).double() != rne_e4m3(v.bfloat16()).double()).double().mean().item(),
     "e4m3_to_f64_mismatch": (codes.double()[finite] != e4m3_values(codes)[finite]).sum().item(),
     "cuda_vs_cpu_f64_to_e4m3": (round_to_e4m3(v).cpu() != round_to_e4m3(v.cpu())).double().mean().item()})
T, d, f, E, k = 2048, 2048, 768, 64, 8
x, _, _, q1, s1, q2, s2 = quantized_experts(T, d, f, E, torch.bfloat16, "cuda")
xin, xsc = torch.empty(x.shape, dtype=FP8, device="cuda"), torch.empty(T, d // 128, device="cuda")
quantize_groups_launch(x, xin, xsc)()
xq, xs = quantize_fp8_groups(x.double(), rne_e4m3)
log({"check": "kernel x quantisation vs exact RNE", "q_mismatch": (xin.double() != xq).double().mean().item(),
     "scale_max_rel": ((xsc.double() - xs).abs() / xs).max().item()})
w, ids = moe_route(torch.randn(T, E, device="cuda"), k)
default = fp8_tile_candidates(T, k, E, d, f, x.device)["default"]
families = {"rows-16 w4 s4 gather": replace(default, block_m=16, up=replace(default.up, num_warps=4, num_stages=4), quantize_in_gather=True),
            "rows-16 w8 s3 gather": replace(default, block_m=16, quantize_in_gather=True),
            "rows-64 (default)": default, "rows-64 s1": replace(default, up=replace(default.up, num_stages=1)),
            "rows-128": replace(default, block_m=128)}
# Triton's sm_90 default lets e4m3 dots accumulate in the tensor core's reduced precision over the whole K; the
# "precise" families compile the up GEMM with promotion to float32 after every instruction instead.
import flashmoe_science.moe.triton_fp8_gemm as gemm_module
_up_launch, PRECISE = gemm_module.up_swiglu_fp8_launch, {"on": False}
def _patched_up(*args, **kwargs):
    launch = _up_launch(*args, **kwargs)
    return launch._replace(meta={**launch.meta, "max_num_imprecise_acc_default": 0}) if PRECISE["on"] else launch
gemm_module.up_swiglu_fp8_launch = _patched_up
families.update({"rows-64 precise-acc": default, "rows-16 w8 s3 gather precise-acc": families["rows-16 w8 s3 gather"]})
def oracle(xx, rows_x, sel_pairs, exact, device):
    cast = rne_e4m3 if exact else round_to_e4m3
    xx = xx.to(device)
    xq, xs = quantize_fp8_groups(xx.double(), cast); xd = _per_group(xq, xs)
    tok, exp = (sel_pairs // k).to(device), ids.reshape(-1)[sel_pairs].long().to(device)
    he = torch.empty(sel_pairs.numel(), f, dtype=torch.float64, device=device)
    for e in exp.unique().tolist():
        s = exp == e
        wq = exact_dequantized(q1[e].to(device), s1[e].to(device)) if exact else dequantize_fp8(q1[e].to(device), s1[e].to(device), torch.float64)
        gu = xd[tok[s]] @ wq.T
        he[s] = F.silu(gu[:, :f]) * gu[:, f:]
    return quantize_fp8_groups(he, cast)
for xname, xx in (("x normal", x), ("x lossless", _losslessly_quantised(T, d, torch.bfloat16).cuda())):
    for name, tiles in families.items():
        PRECISE["on"] = name.endswith("precise-acc")
        sort, h, hs = fp8_up(xx, q1, s1, ids, tiles)
        pairs = torch.nonzero(sort.pair_row >= 0).squeeze(1)[:4096]
        rows = sort.pair_row[pairs].long()
        r = {"x": xname, "family": name}
        for oname, exact, device in (("torch-cuda", False, "cuda"), ("exact-cuda", True, "cuda"), ("exact-cpu", True, "cpu")):
            hq_e, hs_e = oracle(xx, rows, pairs, exact, device)
            hq_e, hs_e = hq_e.cuda(), hs_e.cuda()
            r[oname] = {"h_rerounded": (h[rows].double() != hq_e).double().mean().item(),
                        "h_scale_max_rel": ((hs[rows].double() - hs_e).abs() / hs_e).max().item()}
        log(r)
json.dump(records, open(os.path.join(out, "fp8bug_diagnose.json"), "w"), indent=1)
