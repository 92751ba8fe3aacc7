"""Sweep the MoE GEMMs' tile configs one GEMM at a time, beside torch._grouped_mm doing the same GEMM, and time the
whole layer (ours with the heuristic tiles, ours with each GEMM's best tiles, the torch._grouped_mm pipeline):
the data behind moe/tiles.choose_tiles.

    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sweep_moe_gemm_tiles.py --out $OUT/run                  # on the H200, < 4 min
    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sweep_moe_gemm_tiles.py --offline [--cases mixtral-8x7b:4096]   # CPU is enough

GEMMs (names of the MoETiles fields), FLOPs with P = routed (token, expert) pairs:
    up      gather x @ w1^T + SwiGLU        4·P·d·F      torch: _grouped_mm(x_sorted, w1^T)
    down    h @ w2^T, weight, combine       2·P·d·F      torch: _grouped_mm(h, w2^T)
    up_bwd  dh = dout @ w2 (gathered rows)  2·P·d·F      torch: _grouped_mm(dout, w2)
    dx      d(gate,up) @ w1, combine        4·P·d·F      torch: _grouped_mm(dgu, w1)
    dw1     d(gate,up)_e^T x_e              4·P·d·F      torch: _grouped_mm(dgu^T, x_sorted)  (offsets along K)
    dw2     (weight·dout)_e^T h_e           2·P·d·F      torch: _grouped_mm(dout^T, h)
The torch column is the GEMM alone (gather, SwiGLU, weighting and combine not included): a ceiling, not the
pipeline. Weight bytes (for GB/s, reported at T <= 16): what the GEMM must move of expert weights, i.e. the
experts that received tokens for the forward-type GEMMs (read) and all E experts for dw1/dw2 (written).

GPU run: every candidate is first compiled for sm_90 in a pool of processes (the same `triton.compile` call the JIT
makes, so the JIT then finds the binaries in Triton's cache), then each is checked against the heuristic's output
and timed with do_bench medians (warmup 10 ms, rep 40 ms). A wall-clock budget (--budget-s) skips the remaining
candidates, never the layer timings. Writes sweep_moe.json and sweep_moe.txt (the printed tables) under --out.

--offline: no GPU needed; compiles every candidate for sm_90 and reports registers, spills (local memory, LDL/STL),
shared memory, the HGMMA/HMMA instructions and the loads (LDGSTS = cp.async, UTMALDG = TMA) of each kernel.

The down and dx candidates are timed with their combine (``tiles.COMBINES``): the accumulator's zeroing and rounding
for the atomic one, the summing pass for the rows one. ``--combine both`` also tries every down/dx candidate with the
other combine, and times the whole layer (the planner's kernels, Gluon on Hopper) with each:
``{fwd,bwd}/flashmoe-combine-{atomic,rows}`` rows of the layer table, the measurement behind
``tiles.choose_combine``. ``qwen3-moe-titan`` is the TorchTitan example job's MoE layer (E=64, top-8, d=1536, F=256,
4x4096 tokens), whose K = 256 / 512 down and dx GEMMs are small against their (T·k, d) epilogues.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import replace

import torch

from flashmoe_science.bench.moe import MODELS
from flashmoe_science.moe import gemms, layer
from flashmoe_science.moe import triton_gemm as tg
from flashmoe_science.moe.dispatch import ExpertSort, max_row_tiles
from flashmoe_science.moe.plan import plan_kernels
from flashmoe_science.moe.tiles import (COMBINES, GemmTiles, MoETiles, choose_tiles, gemm_smem_bytes, sm_count,
                                        smem_limit, split_k_for)

SMEM_LIMIT = smem_limit(torch.device("meta"))  # an H200's, as the heuristic sizes for
CASES = (  # (model, T, passes), most wanted first: a run that hits --budget-s loses the last ones' candidates
    ("mixtral-8x7b", 4096, ("fwd", "bwd")),
    ("qwen3-30b-a3b", 4096, ("fwd", "bwd")),
    ("mixtral-8x7b", 16, ("fwd", "bwd")),
    ("qwen3-30b-a3b", 16, ("fwd", "bwd")),
    ("mixtral-8x7b", 16384, ("fwd", "bwd")),
    ("mixtral-8x7b", 256, ("fwd", "bwd")),  # 64 rows per expert: the block_m = 64 regime
    ("qwen3-moe-titan", 16384, ("fwd", "bwd")),  # examples/torchtitan's Qwen3-MoE job: F = 256, top-8
)
# the benchmark's models and the TorchTitan example job's MoE layer (examples/torchtitan/flashmoe_jobs.py)
SWEEP_MODELS = {**MODELS, "qwen3-moe-titan": dict(num_experts=64, top_k=8, d_model=1536, d_ff=256)}
COMBINE_MODES = {"heuristic": False, "both": True}  # --combine: whether down/dx also try the other combine
TRY_OTHER_COMBINE = [False]
MAX_REL_ERR_ROWS = 1e-2  # against the other combine: its rows are rounded to bf16 before the sum (~2^-9 each)
PASS_GEMMS = {"fwd": ("up", "down"), "bwd": ("up_bwd", "dx", "dw1", "dw2")}
MAX_REL_ERR = 1e-3  # a candidate further than this from the heuristic's output is never "best" (tiles agree to ~1e-5)
FLOP_FACTOR = {"up": 4, "down": 2, "up_bwd": 2, "dx": 4, "dw1": 4, "dw2": 2}  # x P·d·F


# ---------------------------------------------------------------------------------------------------- candidates
def _g(bn, bk, warps, stages, split_k=1, bm=0, persistent=0):
    return GemmTiles(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split_k, block_m=bm,
                     persistent=persistent)


def _c(gemm, block_m=None, group_m=None):
    """A candidate: the GEMM's tiles, and block_m / group_m when they differ from the heuristic's."""
    return block_m, group_m, gemm


# candidates besides the heuristic's own choice (which always comes first); n = gate columns for up (its MMA
# is 2n wide: gate and up interleaved); dw: output tile bm x n, k sorted rows per step, persistent = programs per SM
# of the persistent weight-gradient kernel (0: one program per tile)
_STREAM = {  # few rows per expert (T <= 16 here): the GEMMs stream expert weights
    "up": [_c(_g(32, 128, 4, 4)), _c(_g(64, 64, 4, 4)), _c(_g(64, 128, 4, 3)), _c(_g(32, 256, 4, 3)),
           _c(_g(64, 64, 4, 6)), _c(_g(128, 64, 8, 4)), _c(_g(16, 256, 4, 4))],
    "down": [_c(_g(32, 128, 4, 4)), _c(_g(64, 64, 4, 6)), _c(_g(128, 64, 4, 4)), _c(_g(64, 256, 4, 3)),
             _c(_g(128, 128, 8, 3)), _c(_g(32, 256, 4, 3))],
    "up_bwd": [_c(_g(32, 128, 4, 4)), _c(_g(128, 64, 4, 4)), _c(_g(64, 256, 4, 3)), _c(_g(64, 64, 4, 6)),
               _c(_g(128, 128, 8, 3)), _c(_g(32, 256, 4, 3))],
    "dw": [_c(_g(64, 16, 4, 2, bm=64)), _c(_g(128, 16, 4, 2)), _c(_g(128, 16, 4, 2, bm=64)),
           _c(_g(256, 16, 8, 2, bm=128)), _c(_g(128, 16, 4, 2, bm=32)), _c(_g(64, 16, 4, 2, bm=128)),
           _c(_g(128, 16, 4, 2, bm=64, persistent=1)), _c(_g(128, 16, 4, 2, bm=64, persistent=2))],
}
_COMPUTE = {  # hundreds of rows per expert: tensor-core bound (offline sm_90 builds: none of these spills)
    "up": [_c(_g(128, 64, 8, 3)), _c(_g(128, 64, 8, 4)), _c(_g(64, 64, 4, 4)), _c(_g(64, 128, 8, 3)),
           _c(_g(128, 64, 4, 4), block_m=64), _c(_g(64, 64, 8, 3), block_m=256), _c(_g(128, 64, 8, 3), group_m=16),
           _c(_g(64, 64, 8, 4), group_m=4)],
    "down": [_c(_g(256, 64, 8, 3)), _c(_g(256, 64, 8, 4)), _c(_g(128, 64, 4, 4)), _c(_g(128, 128, 8, 3)),
             _c(_g(256, 64, 4, 4), block_m=64), _c(_g(128, 64, 8, 3), block_m=256), _c(_g(128, 64, 8, 5)),
             _c(_g(256, 64, 8, 3), group_m=16)],
    "up_bwd": [_c(_g(256, 64, 8, 3)), _c(_g(256, 64, 8, 4)), _c(_g(128, 64, 8, 3)), _c(_g(128, 64, 4, 4)),
               _c(_g(128, 128, 8, 3)), _c(_g(64, 64, 4, 4)), _c(_g(128, 64, 4, 4), block_m=64),
               _c(_g(128, 64, 8, 4), group_m=16)],
    "dw": [_c(_g(128, 64, 8, 4)), _c(_g(256, 64, 8, 3, bm=128)), _c(_g(128, 64, 8, 3, bm=256)),
           _c(_g(128, 128, 8, 3)), _c(_g(128, 64, 4, 4)), _c(_g(256, 64, 4, 4, bm=64)), _c(_g(128, 32, 8, 6)),
           _c(_g(256, 64, 8, 3, bm=128), group_m=4), _c(_g(256, 64, 8, 3, bm=128), group_m=16),
           _c(_g(128, 64, 8, 3)), _c(_g(128, 64, 4, 2, bm=64)), _c(_g(256, 64, 4, 2, bm=64)),
           # persistent: the heuristic's 128x256 tile and its s4, 128x128, and the output-write tile of block_m 64
           _c(_g(256, 64, 8, 3, bm=128, persistent=1)), _c(_g(256, 64, 8, 4, bm=128, persistent=1)),
           _c(_g(128, 64, 8, 3, persistent=1)), _c(_g(128, 64, 8, 4, persistent=1)),
           _c(_g(128, 64, 4, 2, bm=64, persistent=1)), _c(_g(128, 64, 4, 2, bm=64, persistent=2))],
}


def _dims(model):
    s = SWEEP_MODELS[model]
    return s["num_experts"], s["top_k"], s["d_model"], s["d_ff"]


def candidates(model: str, num_tokens: int, gemm: str, device=torch.device("meta")) -> list[MoETiles]:
    """Whole MoETiles that differ from the heuristic's in ``gemm`` (and possibly block_m / group_m), the heuristic's
    first; duplicates and configs over Hopper's shared memory dropped. ``device``: the GPU the heuristic sizes for
    (its SM count sets split-K; meta = an H200)."""
    num_experts, top_k, d_model, d_ff = _dims(model)
    base = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    sms = sm_count(device)
    table = _STREAM if base.block_m <= 32 else _COMPUTE
    own = getattr(base, gemm)
    specs = [(None, None, own)] + table[{"dx": "down", "dw1": "dw", "dw2": "dw"}.get(gemm, gemm)]
    if gemm in ("down", "dx"):
        if base.block_m <= 32:  # the table's down tiles get the heuristic's split-K sizing, as its own does
            k_dim = d_ff if gemm == "down" else 2 * d_ff
            row_tiles = min(num_experts, num_tokens * top_k)
            specs = specs[:1] + [(bm, gm, split_k_for(g, row_tiles, k_dim, d_model, sms)) for bm, gm, g in specs[1:]]
        # and split-K variants around the heuristic's own
        specs += [(None, None, replace(own, split_k=s)) for s in (1, own.split_k // 2, own.split_k * 2) if s >= 1]
    combines = [base.combine]
    if TRY_OTHER_COMBINE[0] and gemm in ("down", "dx"):
        combines += [mode for mode in COMBINES if mode != base.combine]
    out, seen = [], set()
    for combine in combines:
        for block_m, group_m, g in specs:
            block_m = block_m or base.block_m
            if gemm_smem_bytes(gemm, block_m, g) > SMEM_LIMIT or (combine == "rows" and g.split_k > 1):
                continue
            tiles = replace(base, block_m=block_m, group_m=group_m or base.group_m, combine=combine, **{gemm: g})
            key = (tiles.block_m, tiles.group_m, combine, g)
            if key not in seen:
                seen.add(key)
                out.append(tiles)
    return out


def label(tiles: MoETiles, gemm: str) -> str:
    g = getattr(tiles, gemm)
    if gemm in ("dw1", "dw2"):
        text = f"{g.block_m or g.block_n}x{g.block_n} k{g.block_k}"
    else:
        text = f"m{tiles.block_m} n{g.block_n} k{g.block_k}"
    text += f" w{g.num_warps} s{g.num_stages}"
    if g.split_k > 1:
        text += f" sk{g.split_k}"
    if g.persistent:
        text += f" p{g.persistent}"
    if gemm in ("down", "dx") and tiles.combine != "atomic":
        text += f" {tiles.combine}"
    return text + f" g{tiles.group_m}"  # the weight gradients' output tiles take group_m too


# -------------------------------------------------------------------------------------------------- the launches
class Buffers:
    """Every tensor the six GEMMs read or write for one (case, block_m), and their Launch objects."""

    def __init__(self, x, w1, w2, weights32, grad_out, sort: ExpertSort, block_m: int, fill, gather=True):
        """``fill(shape, dtype, device)`` makes the sorted-row operands of down/dx/dw1/dw2, or, when it has a
        ``per_pair`` attribute (``PairFill``), their values per (token, slot) pair, placed at each pair's sorted row
        (padding rows zero): then every block_m (a different row layout) sees the same operand, and the candidates'
        outputs are comparable. (Fresh random rows per block_m made every down/dx candidate with another block_m
        than the heuristic's read other data: the err of 1.3-1.8 in the 2026-11-21 H200 sweep, no kernel bug.)"""
        self.x, self.w1, self.w2, self.weights32, self.grad_out, self.sort = x, w1, w2, weights32, grad_out, sort
        num_rows = sort.tile_expert.numel() * block_m
        d_ff = w1.shape[1] // 2
        dev, dt = x.device, x.dtype
        if hasattr(fill, "per_pair"):
            rows = sort.pair_row.long()
            routed = rows >= 0
            self.h_in = torch.zeros((num_rows, d_ff), dtype=dt, device=dev)
            self.dgu_in = torch.zeros((num_rows, 2 * d_ff), dtype=dt, device=dev)
            self.h_in[rows[routed]] = fill.per_pair(d_ff, dt, dev)[routed]  # down's and dw2's sorted-row operand
            self.dgu_in[rows[routed]] = fill.per_pair(2 * d_ff, dt, dev)[routed]  # dx's and dw1's
        else:  # any values (offline builds, timing only)
            self.h_in = fill((num_rows, d_ff), dt, dev)
            self.dgu_in = fill((num_rows, 2 * d_ff), dt, dev)
        self.h_out = torch.empty((num_rows, d_ff), dtype=dt, device=dev)
        self.dgu_out = torch.empty((num_rows, 2 * d_ff), dtype=dt, device=dev)
        self.out32 = torch.zeros(x.shape, dtype=torch.float32, device=dev)
        self.rows_out = torch.empty((num_rows, x.shape[1]), dtype=dt, device=dev)  # the rows combine's
        self.combined = torch.empty(x.shape, dtype=dt, device=dev)
        self.dweights = torch.zeros(weights32.shape, dtype=torch.float32, device=dev)
        self.dw1 = torch.empty(w1.shape, dtype=dt, device=dev)
        self.dw2 = torch.empty(w2.shape, dtype=dt, device=dev)
        if gather:  # the weight gradients' gathered operands, as moe_backward makes them
            self.x_sorted = gemms.sorted_rows(x, None, sort, num_rows)
            self.g_sorted = gemms.sorted_rows(grad_out, weights32, sort, num_rows)
        else:
            self.x_sorted = torch.empty((num_rows, x.shape[1]), dtype=dt, device=dev)
            self.g_sorted = torch.empty((num_rows, x.shape[1]), dtype=dt, device=dev)

    def launch(self, gemm: str, tiles: MoETiles) -> tg.Launch:
        s = self.sort
        if gemm == "up":
            return tg.up_swiglu_launch(self.x, self.w1, self.h_out, None, s, tiles)
        if gemm == "down":
            return tg.down_forward_launch(self.h_in, self.w2, self._combine_out(tiles), self.weights32, s, tiles)
        if gemm == "up_bwd":
            return tg.dh_launch(self.grad_out, self.w2, self.h_out, s, tiles)
        if gemm == "dx":
            return tg.dx_launch(self.dgu_in, self.w1, self._combine_out(tiles), s, tiles)
        if gemm == "dw1":
            return tg.dw1_launch(self.dgu_in, self.x_sorted, self.dw1, s, tiles)
        return tg.dw2_launch(self.g_sorted, self.h_in, self.dw2, s, tiles)

    def _combine_out(self, tiles: MoETiles):
        return self.rows_out if tiles.combine == "rows" else self.out32

    def timed(self, gemm: str, tiles: MoETiles, launch):
        """What to time for a candidate: the launch, and for down / dx with their combine's own work around it
        (the accumulator's zeroing and rounding, or the rows' summing pass), as the layer runs them."""
        if gemm not in ("down", "dx"):
            return launch
        if tiles.combine == "rows":
            combine = gemms.combine_launch(self.rows_out, self.combined, self.sort, tiles)
            return lambda: (launch(), combine())
        return lambda: (self.out32.zero_(), launch(), self.out32.to(self.x.dtype))

    def result(self, gemm: str, tiles: MoETiles) -> torch.Tensor:
        """The GEMM's output after one launch from zeroed accumulators (call ``reset`` first), rows per pair; down
        and dx: the (T, d) result after their combine."""
        rows = self.sort.pair_row.long()
        if gemm in ("up", "up_bwd"):  # h, or dh = dout @ w2: both (rows, F)
            return self.h_out[rows]
        if gemm in ("down", "dx"):
            if tiles.combine == "rows":
                gemms.combine_launch(self.rows_out, self.combined, self.sort, tiles)()
                return self.combined
            return self.out32
        return self.dw1 if gemm == "dw1" else self.dw2

    def reset(self):
        self.out32.zero_()
        self.dweights.zero_()


class PairFill:
    """Random sorted-row operands keyed by (token, slot) pair, one tensor per width, made once and reused by the
    Buffers of every block_m (see ``Buffers``)."""

    def __init__(self, num_pairs: int):
        self.num_pairs, self._made = num_pairs, {}

    def __call__(self, shape, dtype, device):
        return torch.randn(shape, device=device).to(dtype)

    def per_pair(self, width, dtype, device):
        key = (width, dtype, str(device))
        if key not in self._made:
            self._made[key] = torch.randn((self.num_pairs, width), device=device).to(dtype)
        return self._made[key]


def meta_buffers(model: str, num_tokens: int, block_m: int) -> Buffers:
    """Buffers on the meta device: shapes, strides and alignment as on the GPU, no memory (offline compiles)."""
    num_experts, top_k, d_model, d_ff = _dims(model)
    dev, dt = torch.device("meta"), torch.bfloat16
    pairs = num_tokens * top_k
    tiles_max = max_row_tiles(pairs, num_experts, block_m)
    i32 = lambda n: torch.empty(n, dtype=torch.int32, device=dev)  # noqa: E731
    sort = ExpertSort(i32(tiles_max * block_m), i32(pairs), i32(tiles_max), i32(num_experts), i32(num_experts),
                      block_m, top_k, pairs)
    x = torch.empty(num_tokens, d_model, dtype=dt, device=dev)
    w1 = torch.empty(num_experts, 2 * d_ff, d_model, dtype=dt, device=dev)
    w2 = torch.empty(num_experts, d_model, d_ff, dtype=dt, device=dev)
    weights32 = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    return Buffers(x, w1, w2, weights32, torch.empty_like(x), sort, block_m,
                   lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device), gather=False)


# ------------------------------------------------------------------------------------------ offline sm_90 builds
def compile_launch(launch: tg.Launch, target=None):
    """``triton.compile`` of a Launch for ``target`` (default sm_90) exactly as the JIT would compile it on that GPU
    (same specialisation of the arguments, same options), so the binary lands under the JIT's cache key."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = target or GPUTarget("cuda", 90, 32)
    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.meta, debug=kernel.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def sass_summary(compiled) -> dict:
    from sass_tools import cuobjdump

    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    usage = " ".join(cuobjdump(compiled.asm["cubin"], "-res-usage").split())
    field = lambda name: int(m.group(1)) if (m := re.search(rf"\b{name}:(\d+)", usage)) else None  # noqa: E731
    mma = sorted(set(re.findall(r"\b(HGMMA\.\w+|HMMA\.\w+)", sass)))
    return {
        "regs": field("REG"), "local_bytes": field("LOCAL"), "stack": field("STACK"), "smem": compiled.metadata.shared,
        "LDL": len(re.findall(r"\bLDL\b", sass)), "STL": len(re.findall(r"\bSTL\b", sass)),
        "HGMMA": len(re.findall(r"\bHGMMA\b", sass)), "HMMA": len(re.findall(r"\bHMMA\b", sass)),
        "mma_shapes": mma, "LDGSTS": len(re.findall(r"\bLDGSTS\b", sass)),
        "UTMALDG": len(re.findall(r"\bUTMALDG\b", sass)), "LDG": len(re.findall(r"\bLDG\.", sass)),
    }


def _compile_job(job):
    model, num_tokens, gemm, tiles, want_sass = job
    start = time.perf_counter()
    try:
        compiled = compile_launch(meta_buffers(model, num_tokens, tiles.block_m).launch(gemm, tiles))
        info = sass_summary(compiled) if want_sass else {}
        return job[:4], {**info, "compile_s": round(time.perf_counter() - start, 2)}
    except Exception as error:  # noqa: BLE001 - a config that does not compile is reported, not fatal
        return job[:4], {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def compile_all(jobs, workers: int):
    """Compile (model, T, gemm, tiles, want_sass) jobs in ``workers`` processes; {job[:4]: info}."""
    if workers <= 1:
        return dict(map(_compile_job, jobs))
    ctx = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context later; never fork it
    with futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return dict(pool.map(_compile_job, jobs, chunksize=1))


def _jobs(cases, want_sass, device=torch.device("meta")):
    jobs = []
    for model, num_tokens, passes in cases:
        for pass_ in passes:
            for gemm in PASS_GEMMS[pass_]:
                jobs += [(model, num_tokens, gemm, t, want_sass) for t in candidates(model, num_tokens, gemm, device)]
    return jobs


def offline(cases, workers, out_dir):
    jobs = _jobs(cases, True)
    print(f"compiling {len(jobs)} kernels for sm_90 in {workers} processes", flush=True)
    start = time.perf_counter()
    results = compile_all(jobs, workers)
    lines = [f"{len(jobs)} sm_90 builds in {time.perf_counter() - start:.0f} s"]
    head = f"{'case':<22} {'gemm':<7} {'config':<30} {'smem':>7} {'regs':>4} {'spill(LDL/STL,local)':>21}  mma, loads"
    records = []
    for (model, num_tokens, gemm, tiles), info in results.items():
        records.append({"model": model, "T": num_tokens, "gemm": gemm, "config": label(tiles, gemm),
                        "tiles": dataclasses.asdict(tiles), **info})
    current = None
    for r in records:
        case = f"{r['model']} T={r['T']}"
        if (case, r["gemm"]) != current:
            current = (case, r["gemm"])
            lines += ["", head]
        if "error" in r:
            lines.append(f"{case:<22} {r['gemm']:<7} {r['config']:<30} FAILED {r['error']}")
            continue
        spill = f"{r['LDL']}/{r['STL']},{r['local_bytes']}"
        lines.append(f"{case:<22} {r['gemm']:<7} {r['config']:<30} {r['smem']:>7} {r['regs']:>4} {spill:>21}  "
                     f"{'+'.join(r['mma_shapes']) or 'no MMA'} x{r['HGMMA'] or r['HMMA']}, "
                     f"LDGSTS {r['LDGSTS']} UTMALDG {r['UTMALDG']} LDG {r['LDG']}")
    text = "\n".join(lines)
    print(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "sweep_moe_offline.json"), "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.join(out_dir, "sweep_moe_offline.txt"), "w") as f:
            f.write(text + "\n")


# ------------------------------------------------------------------------------------------------------ GPU sweep
def _grouped_mm_fns(x, w1, w2, ids, weights32, grad_out, h_in, dgu_in, sort):
    """The torch._grouped_mm calls doing each GEMM (on unpadded rows in argsort order), as closures."""
    num_experts, top_k = w1.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    rows = sort.pair_row.long()[order]  # our sorted rows, in argsort order: the same values, no padding
    x_s = x[order // top_k]
    dout_s = (grad_out[order // top_k].float() * weights32.reshape(-1)[order, None]).to(x.dtype)
    h_s, dgu_s = h_in[rows], dgu_in[rows]
    gmm = torch._grouped_mm
    return {
        "up": lambda: gmm(x_s, w1.transpose(1, 2), offs=offs),
        "down": lambda: gmm(h_s, w2.transpose(1, 2), offs=offs),
        "up_bwd": lambda: gmm(dout_s, w2, offs=offs),
        "dx": lambda: gmm(dgu_s, w1, offs=offs),
        "dw1": lambda: gmm(dgu_s.t(), x_s, offs=offs),
        "dw2": lambda: gmm(dout_s.t(), h_s, offs=offs),
    }


def _bench(fn, rep=40):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _layer_with_tiles(tensors, top_k, tiles, pass_):
    """Ours through triton_gemm with explicit tiles (routing included, as fused_moe does it)."""
    from flashmoe_science.moe.routing import route

    x, w1, w2, logits = tensors
    if pass_ == "fwd":
        forward_plan = plan_kernels(x, w1, w2, top_k, tiles)

        def fwd():
            weights, ids = route(logits, top_k, True, "softmax")
            return layer.moe_forward(x, w1, w2, weights.float().contiguous(), ids, forward_plan)[0]
        return fwd
    weights, ids = route(logits, top_k, True, "softmax")
    weights32 = weights.float().contiguous()
    _, saved = layer.moe_forward(x, w1, w2, weights32, ids, plan_kernels(x, w1, w2, top_k, tiles, training=True),
                                 save_for_backward=True)
    grad_out = torch.randn_like(x)
    return lambda: layer.moe_backward(grad_out, x, w1, w2, weights32, saved)


def gpu_sweep(cases, out_dir, budget_s, workers, device=None):
    """The sweep on ``device`` (default cuda; a CPU device with TRITON_INTERPRET=1 only exercises the code)."""
    from flashmoe_science.bench import moe as bench_moe
    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert

    device = device or torch.device("cuda")
    on_gpu = device.type == "cuda"
    start = time.perf_counter()
    jobs = _jobs(cases, False, device)
    try:
        compiled = compile_all(jobs, workers) if on_gpu else {}
    except Exception as error:  # noqa: BLE001 - without the pool the JIT compiles each config when first timed
        print(f"precompile pool failed ({type(error).__name__}: {error}); compiling in-process", flush=True)
        compiled = {}
    failed = {k: v["error"] for k, v in compiled.items() if "error" in v}
    lines = [f"precompiled {len(compiled)} kernels in {time.perf_counter() - start:.0f} s ({len(failed)} failed)"]
    print(lines[0], flush=True)
    dt = torch.bfloat16 if on_gpu else torch.float32
    report = {"gpu": torch.cuda.get_device_name() if on_gpu else str(device), "torch": torch.__version__,
              "cases": []}


    for model, num_tokens, passes in cases:
        num_experts, top_k, d_model, d_ff = _dims(model)
        tensors = bench_moe._make_inputs(num_tokens, num_experts, d_model, d_ff, dt, device)
        x, w1, w2, logits = tensors
        weights, ids = moe_route(logits, top_k)
        weights32 = weights.float().contiguous()
        grad_out = torch.randn_like(x)
        pairs = num_tokens * top_k
        pair_fill = PairFill(pairs)  # the same per-pair operands for every block_m of this case
        used = int((torch.bincount(ids.reshape(-1), minlength=num_experts) > 0).sum())
        base = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
        assert base == candidates(model, num_tokens, "up", device)[0], "the sweep's heuristic must be the layer's"
        case = {"model": model, "T": num_tokens, "E": num_experts, "top_k": top_k, "d_model": d_model, "d_ff": d_ff,
                "experts_used": used, "heuristic": dataclasses.asdict(base), "layer": {}, "gemms": {}}
        head = f"== {model} T={num_tokens}: {used}/{num_experts} experts used, heuristic block_m {base.block_m}"
        print(head, flush=True)
        lines += ["", head]
        weight_read = used * 3 * d_model * d_ff * 2  # bytes: w1 and w2 of the used experts

        # the whole layer: heuristic (fused_moe) and the torch._grouped_mm pipeline, as `bench moe` times them
        for pass_ in passes:
            flops = bench_moe.expert_gemm_flops(num_tokens, top_k, d_model, d_ff, pass_)
            for backend in ("flashmoe", "torch-grouped-mm"):
                try:
                    ms = bench_moe._measure(backend, pass_, tensors, top_k, device)
                except Exception as error:  # noqa: BLE001
                    print(f"  layer {pass_} {backend} failed: {error}")
                    continue
                rec = {"ms": ms, "tflops": flops / ms / 1e9}
                if pass_ == "fwd":
                    rec["weight_GBps"] = weight_read / ms / 1e6
                case["layer"][f"{pass_}/{backend}"] = rec

        if num_tokens <= 16:  # the fixed cost in front of the GEMMs
            sort_fn = lambda: sort_pairs_by_expert(moe_route(logits, top_k)[1], num_experts, base.block_m)  # noqa: E731
            case["layer"]["route+sort_ms"] = _bench(sort_fn)

        by_block_m = {}
        for pass_ in passes:
            for gemm in PASS_GEMMS[pass_]:
                flops = FLOP_FACTOR[gemm] * pairs * d_model * d_ff
                per_expert = {"up": 2, "down": 1, "up_bwd": 1, "dx": 2}.get(gemm)
                weight_bytes = (used * per_expert if per_expert else num_experts * (2 if gemm == "dw1" else 1)) \
                    * d_model * d_ff * 2
                rows, ref = [], None
                for tiles in candidates(model, num_tokens, gemm, device):
                    key = (model, num_tokens, gemm, tiles)
                    rec = {"config": label(tiles, gemm), "tiles": dataclasses.asdict(tiles)}
                    if key in failed:
                        rows.append({**rec, "error": failed[key]})
                        continue
                    if time.perf_counter() - start > budget_s:
                        rows.append({**rec, "skipped": "time budget"})
                        continue
                    if tiles.block_m not in by_block_m:
                        sort = sort_pairs_by_expert(ids, num_experts, tiles.block_m)
                        by_block_m[tiles.block_m] = Buffers(x, w1, w2, weights32, grad_out, sort, tiles.block_m,
                                                            pair_fill)
                    buf = by_block_m[tiles.block_m]
                    try:
                        launch = buf.launch(gemm, tiles)
                        buf.reset()
                        kernel = launch()
                        out = buf.result(gemm, tiles).float()
                        if ref is None:
                            ref = out.clone()
                        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                        ms = _bench(buf.timed(gemm, tiles, launch))
                    except Exception as error:  # noqa: BLE001
                        rows.append({**rec, "error": f"{type(error).__name__}: {str(error)[:300]}"})
                        continue
                    meta = getattr(kernel, "metadata", None)
                    rows.append({**rec, "ms": ms, "tflops": flops / ms / 1e9, "GBps": weight_bytes / ms / 1e6,
                                 "rel_err_vs_heuristic": err, "regs": getattr(kernel, "n_regs", None),
                                 "spills": getattr(kernel, "n_spills", None),
                                 "smem": getattr(meta, "shared", None)})
                torch_rec = None
                if by_block_m:
                    buf = next(iter(by_block_m.values()))
                    try:
                        fn = _grouped_mm_fns(x, w1, w2, ids, weights32, grad_out, buf.h_in, buf.dgu_in,
                                             buf.sort)[gemm]
                        ms = _bench(fn)
                        torch_rec = {"ms": ms, "tflops": flops / ms / 1e9, "GBps": weight_bytes / ms / 1e6}
                    except Exception as error:  # noqa: BLE001
                        torch_rec = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                case["gemms"][gemm] = {"flops": flops, "weight_bytes": weight_bytes, "candidates": rows,
                                       "torch_grouped_mm": torch_rec}
                lines += _gemm_table(gemm, rows, torch_rec, num_tokens <= 16)
                print("\n".join(lines[-(len(rows) + 2):]), flush=True)
        if TRY_OTHER_COMBINE[0]:  # the whole layer (the planner's kernels: Gluon on Hopper) with each combine
            for mode in COMBINES:
                for pass_ in passes:
                    flops = bench_moe.expert_gemm_flops(num_tokens, top_k, d_model, d_ff, pass_)
                    try:
                        tiles = _without_split_k(replace(base, combine=mode)) if mode == "rows" else \
                            replace(base, combine=mode)
                        ms = _bench(_layer_with_tiles(tensors, top_k, tiles, pass_), rep=100)
                        case["layer"][f"{pass_}/flashmoe-combine-{mode}"] = {"ms": ms, "tflops": flops / ms / 1e9}
                    except Exception as error:  # noqa: BLE001
                        print(f"  layer {pass_} with the {mode} combine failed: {error}")
        # the layer again with each GEMM's best candidate among those that keep the heuristic's block_m
        best = _best_tiles(base, case["gemms"])
        case["best_tiles"] = dataclasses.asdict(best)
        for pass_ in passes:
            flops = bench_moe.expert_gemm_flops(num_tokens, top_k, d_model, d_ff, pass_)
            try:
                ms = _bench(_layer_with_tiles(tensors, top_k, best, pass_), rep=100)
                case["layer"][f"{pass_}/flashmoe-best-tiles"] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as error:  # noqa: BLE001
                print(f"  layer {pass_} with best tiles failed: {error}")
        lines += _layer_lines(case)
        print("\n".join(_layer_lines(case)), flush=True)
        report["cases"].append(case)
        _write(out_dir, report, lines)  # after every case: a run cut short still leaves its results
        del tensors, x, w1, w2, logits, by_block_m
        if on_gpu:
            torch.cuda.empty_cache()

    lines.append(f"\ntotal {time.perf_counter() - start:.0f} s")
    print(lines[-1])
    _write(out_dir, report, lines)


def _write(out_dir, report, lines):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep_moe.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "sweep_moe.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _gemm_table(gemm, rows, torch_rec, show_bw):
    out = [f"  {gemm:<7} {'config':<30} {'ms':>8} {'TFLOP/s':>8}" + (f" {'GB/s':>7}" if show_bw else "")
           + f" {'regs':>4} {'spill':>5} {'smem':>7} {'err':>8}"]
    t = torch_rec or {}
    if "ms" in t:
        out.append(f"  {'':<7} {'torch._grouped_mm':<30} {t['ms']:8.4f} {t['tflops']:8.1f}"
                   + (f" {t['GBps']:7.0f}" if show_bw else ""))
    for r in sorted(rows, key=lambda r: r.get("ms", float("inf"))):
        if "ms" not in r:
            out.append(f"  {'':<7} {r['config']:<30} {r.get('error') or r.get('skipped')}")
            continue
        out.append(f"  {'':<7} {r['config']:<30} {r['ms']:8.4f} {r['tflops']:8.1f}"
                   + (f" {r['GBps']:7.0f}" if show_bw else "")
                   + f" {r['regs'] or 0:4d} {r['spills'] or 0:5d} {r['smem'] or 0:7d} {r['rel_err_vs_heuristic']:8.1e}")
    return out


def _without_split_k(tiles: MoETiles) -> MoETiles:
    return replace(tiles, down=replace(tiles.down, split_k=1), dx=replace(tiles.dx, split_k=1))


def _close_enough(row, base: MoETiles) -> bool:
    limit = MAX_REL_ERR if row["tiles"]["combine"] == base.combine else MAX_REL_ERR_ROWS
    return row["rel_err_vs_heuristic"] < limit


def _best_tiles(base: MoETiles, gemms: dict) -> MoETiles:
    best = base
    for gemm, data in gemms.items():
        timed = [r for r in data["candidates"] if "ms" in r and r["tiles"]["block_m"] == base.block_m
                 and _close_enough(r, base)]
        if timed:
            winner = min(timed, key=lambda r: r["ms"])["tiles"]
            best = replace(best, **{gemm: GemmTiles(**winner[gemm])})
            if gemm == "up":  # group_m is shared: take the forward GEMM1's
                best = replace(best, group_m=winner["group_m"])
            if gemm in ("down", "dx"):  # one combine for both: dx's (the longer K, twice down's FLOPs) last
                best = replace(best, combine=winner["combine"])
    return _without_split_k(best) if best.combine == "rows" else best


def _layer_lines(case):
    out = []
    for name, rec in case["layer"].items():
        if isinstance(rec, dict):
            bw = f" {rec['weight_GBps']:7.0f} GB/s" if "weight_GBps" in rec and case["T"] <= 16 else ""
            out.append(f"  layer {name:<32} {rec['ms']:8.4f} ms {rec['tflops']:7.1f} TFLOP/s{bw}")
        else:
            out.append(f"  layer {name:<32} {rec:8.4f} ms")
    return out


def parse_case(text: str) -> tuple[str, int, tuple[str, ...]]:
    """(model, T, passes) of a --cases entry `model:T` or `model:T:fwd+bwd`."""
    model, tokens, *passes = text.split(":")
    if model not in SWEEP_MODELS:
        raise SystemExit(f"--cases: unknown model {model!r}; known: {', '.join(SWEEP_MODELS)}")
    passes = tuple(passes[0].split("+")) if passes else ("fwd", "bwd")
    if not tokens.isdigit() or int(tokens) < 1 or not set(passes) <= {"fwd", "bwd"}:
        raise SystemExit(f"--cases: {text!r} is not model:T[:fwd+bwd] with T a positive token count")
    return model, int(tokens), passes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("--offline", action="store_true", help="sm_90 builds and SASS counts only (no GPU needed)")
    parser.add_argument("--cases", default="", help="comma list of model:T[:passes] (passes fwd+bwd by default) of "
                        f"{', '.join(SWEEP_MODELS)}; default: all of CASES")
    parser.add_argument("--gemms", default="", help="comma list of GEMMs to sweep (default: all of PASS_GEMMS)")
    parser.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of the GPU candidate loop")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--combine", choices=tuple(COMBINE_MODES), default="heuristic",
                        help="both: down/dx candidates and the whole layer with either combine (tiles.COMBINES)")
    args = parser.parse_args()
    TRY_OTHER_COMBINE[0] = COMBINE_MODES[args.combine]
    cases = CASES
    if args.cases:
        cases = tuple(parse_case(c) for c in args.cases.split(","))
    if args.gemms:
        wanted = set(args.gemms.split(","))
        PASS_GEMMS.update({p: tuple(g for g in gemms if g in wanted) for p, gemms in PASS_GEMMS.items()})
    if args.offline:
        offline(cases, args.workers, args.out)
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU: use --offline for the sm_90 builds")
        gpu_sweep(cases, args.out or ".", args.budget_s, args.workers)


if __name__ == "__main__":
    main()
