#!/usr/bin/env python
# GPU only: `OUT=dir PYTHONPATH=src python benchmarks/tools/diagnose_fp8_experts.py` from the repository root.
# Where the GPU's FP8 up stage departs from the float64 emulation, one line per hypothesis (writes
# $OUT/fp8_diagnose.json):
# - ties: how often 448 x / amax of bf16 x is exactly an e4m3 rounding tie, and how many x codes the kernels'
#   quantiser (_quantize_groups_kernel) rounds differently from the emulation (quantize_fp8_groups, IEEE float32
#   divisions), split into ties and non-ties; the same for a quantiser with `/` (approximate division) instead
#   of div_rn, and whether the compiled quantiser holds div.rn.f32 only;
# - torch's CUDA division by a Python scalar (a reciprocal multiply) against division by a tensor, in float64;
# - per tile family, h against the emulation computed on the CPU: rows-16 (mma.sync on float16, exact products),
#   rows-64/128 (e4m3 wgmma) with Triton's default reduced-precision accumulation and with
#   max_num_imprecise_acc_default=0 (float32 promotion after every instruction), on normal and on losslessly
#   quantised x (the GEMM alone).
import json, os, sys
sys.path[:0] = ["tests/moe", "tests"]
from dataclasses import replace
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from flashmoe_science.moe import moe_route
from flashmoe_science.moe.fp8 import FP8, FP8_MAX, SCALE_EPS, quantize_fp8_groups, _per_group
import flashmoe_science.moe.triton_fp8_gemm as gemm
from fp8_testing import quantized_experts, rne_e4m3, exact_dequantized
from test_moe_fp8 import _losslessly_quantised

out, records = os.environ["OUT"], []


def log(r):
    print(json.dumps(r), flush=True)
    records.append(r)


@triton.jit
def _quantize_groups_approx_kernel(x_ptr, q_ptr, n_cols, EPS: tl.constexpr, FP8_LIMIT: tl.constexpr):
    # the quantiser as it was: `/` compiles to div.full.f32 (and amax * rcp(448) for the constant)
    row, group = tl.program_id(0), tl.program_id(1)
    cols = group * 128 + tl.arange(0, 128)
    values = tl.load(x_ptr + row * n_cols + cols).to(tl.float32)[None, :]
    scale = tl.maximum(tl.max(tl.abs(values), axis=1), EPS) / FP8_LIMIT
    q = tl.clamp(values / scale[:, None], -FP8_LIMIT, FP8_LIMIT).to(tl.float8e4nv)
    tl.store(q_ptr + row * n_cols + cols[None, :], q)


torch.manual_seed(0)
T, d, f, E, k = 2048, 2048, 768, 64, 8
x, _, _, q1, s1, q2, s2 = quantized_experts(T, d, f, E, torch.bfloat16, "cuda")
xq_em, xs_em = quantize_fp8_groups(x.cpu().double(), rne_e4m3)
v = x.cpu().double().reshape(T, -1, 128) / xs_em[..., None]
ties = (rne_e4m3(v * (1 - 1e-12)) != rne_e4m3(v * (1 + 1e-12))).reshape(T, d)
xin, xsc = torch.empty(x.shape, dtype=FP8, device="cuda"), torch.empty(T, d // 128, device="cuda")
launch = gemm.quantize_groups_launch(x, xin, xsc)
ptx = launch.kernel[launch.grid](*launch.args, **launch.meta).asm["ptx"]  # the CompiledKernel of this launch
approx = torch.empty(x.shape, dtype=FP8, device="cuda")
_quantize_groups_approx_kernel[(T, d // 128)](x, approx, d, EPS=SCALE_EPS, FP8_LIMIT=FP8_MAX)
torch.cuda.synchronize()
amax = x.double().reshape(T, -1, 128).abs().amax(-1)
log({"hypothesis": "ties + approximate division in the x quantiser",
     "tie_share_of_x": ties.double().mean().item(),
     "kernel_vs_emulation": {"codes": (xin.cpu().double() != xq_em).sum().item(),
                             "at_ties": ((xin.cpu().double() != xq_em) & ties).sum().item(),
                             "scale_max_rel": ((xsc.cpu().double() - xs_em).abs() / xs_em).max().item()},
     "slash_division_quantiser_vs_emulation": {"codes": (approx.cpu().double() != xq_em).sum().item(),
                                               "at_ties": ((approx.cpu().double() != xq_em) & ties).sum().item()},
     "quantiser_ptx": {op: ptx.count(op) for op in ("div.rn.f32", "div.full.f32", "div.approx.f32")},
     "torch_cuda_f64_scalar_div_vs_tensor_div": ((amax / 448) != (amax / torch.full_like(amax, 448.0))).sum().item()})

w, ids = moe_route(torch.randn(T, E, device="cuda"), k)
default = gemm.fp8_tile_candidates(T, k, E, d, f, x.device)["default"]
families = {"rows-16 mma.sync": replace(default, block_m=16, up=replace(default.up, num_warps=4, num_stages=4),
                                        quantize_in_gather=True),
            "rows-64 wgmma (default)": default, "rows-128 wgmma": replace(default, block_m=128)}
_up_launch, PRECISE = gemm.up_swiglu_fp8_launch, {"on": False}


def _patched_up(*args, **kwargs):
    launch = _up_launch(*args, **kwargs)
    return launch._replace(meta={**launch.meta, "max_num_imprecise_acc_default": 0}) if PRECISE["on"] else launch


gemm.up_swiglu_fp8_launch = _patched_up
families.update({f"{name} precise-acc": tiles for name, tiles in families.items() if "wgmma" in name})


def emulated_h(xx, pairs):
    """h's emulated e4m3 values and scales for the (token, slot) pairs, in float64 on the CPU."""
    xq, xs = quantize_fp8_groups(xx.cpu().double(), rne_e4m3)
    xd = _per_group(xq, xs)
    tok, exp = (pairs // k).cpu(), ids.reshape(-1)[pairs].long().cpu()
    he = torch.empty(pairs.numel(), f, dtype=torch.float64)
    for e in exp.unique().tolist():
        s = exp == e
        gu = xd[tok[s]] @ exact_dequantized(q1[e].cpu(), s1[e].cpu()).T
        he[s] = F.silu(gu[:, :f]) * gu[:, f:]
    return quantize_fp8_groups(he, rne_e4m3)


for xname, xx in (("x normal", x), ("x lossless", _losslessly_quantised(T, d, torch.bfloat16).cuda())):
    reference = None
    for name, tiles in families.items():
        PRECISE["on"] = name.endswith("precise-acc")
        sort, h, hs = gemm.fp8_up(xx, q1, s1, ids, tiles)
        pairs = torch.nonzero(sort.pair_row >= 0).squeeze(1)[:4096]
        rows = sort.pair_row[pairs].long()
        if reference is None:
            reference = emulated_h(xx, pairs)
        hq_e, hs_e = reference
        log({"x": xname, "family": name, "h_rerounded": (h[rows].cpu().double() != hq_e).double().mean().item(),
             "h_scale_max_rel": ((hs[rows].cpu().double() - hs_e).abs() / hs_e).max().item()})
json.dump(records, open(os.path.join(out, "fp8_diagnose.json"), "w"), indent=1)
