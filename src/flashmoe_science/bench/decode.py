"""Decode benchmark (`flashmoe-science bench --suite decode`): one new token against a full KV cache.

Decode reads the cache once, so its measure is bandwidth: bytes of K and V read / time, against the H200's
4.3 TB/s and against a pure-read kernel over the same bytes timed in the same run. Hq=32, Hkv=8, D=128, bf16;
contexts 8k..1M at B=1 and at the B with B·context = 256k tokens; our kernel on a contiguous cache and on a paged
one (block 64, blocks shuffled over the pool); PyTorch SDPA (every backend that takes the shape, enable_gqa, on a
contiguous (B, Hkv, L, D) copy: their best layout) and compiled FlexAttention (B=1) beside it.

Every call is captured once in a CUDA graph and the graph's replay is timed (triton's do_bench: L2 flushed
before each replay, median), so host launch overhead is not measured for anyone. Records:
    {"op": "decode", "layout", "B", "L", "Hq", "Hkv", "D", "backend", "ms", "tbps", "of_peak", "of_read"}
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashmoe_science.bench.report import (
    format_number,
    format_table,
    gpu_median_ms,
    plot_panels,
    ratio,
    round_significant,
)

H200_PEAK_TBPS = 4.3
HQ, HKV, HEAD_DIM = 32, 8, 128
GPU_CONTEXTS = (8192, 32768, 131072, 1 << 20)
CPU_CONTEXTS = (1024, 4096)
TOKENS_PER_BATCH = 1 << 18  # B·context of the batched rows
PAGE = 64
SDPA_BACKENDS = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
BACKEND_ORDER = ("flashmoe", "flashmoe-paged64", "read", *SDPA_BACKENDS, "flex")


def decode_cases(contexts, batched: bool = True) -> list[tuple[int, int]]:
    """(B, L): B=1 for every context, and (batched) B = 256k / L where that is more than 1."""
    cases = []
    for length in contexts:
        cases.append((1, length))
        if batched and TOKENS_PER_BATCH // length > 1:
            cases.append((TOKENS_PER_BATCH // length, length))
    return cases


@triton.jit
def _read_kernel(K, V, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads K and V once (the decode kernel's bytes) and writes one float per program: HBM's practical ceiling."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(K + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += tl.load(V + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))


def _pure_read(k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    block, iters = 2048, 8
    programs = triton.cdiv(k.numel(), block * iters)
    out = torch.empty(programs, dtype=torch.float32, device=k.device)
    return lambda: _read_kernel[(programs,)](k, v, out, k.numel(), BLOCK=block, ITERS=iters, num_warps=8)


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph (after a warm-up that compiles it); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _paged_copy(k: torch.Tensor, v: torch.Tensor):
    """k, v (B, L, Hkv, D) as a paged pool of PAGE-row blocks in shuffled order, with its block table."""
    batch, length = k.shape[:2]
    per_row = length // PAGE
    order = torch.randperm(batch * per_row, device=k.device)
    table = order.view(batch, per_row).to(torch.int32)
    pools = []
    for t in (k, v):
        pool = torch.empty(batch * per_row, PAGE, *t.shape[2:], dtype=t.dtype, device=t.device)
        pool[order] = t.reshape(batch * per_row, PAGE, *t.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table


def _contenders(batch: int, length: int, device, dtype, on_gpu: bool) -> dict[str, Callable[[], object]]:
    """Each backend's call on the same cache contents (a backend that cannot be set up is left out)."""
    from flashmoe_science import flash_attention_decode
    from flashmoe_science.bench.attention import _compiled_flex, _sdpa_context

    q = torch.randn(batch, 1, HQ, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(batch, length, HKV, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    k_pool, v_pool, table = _paged_copy(k, v)
    calls = {
        "flashmoe": lambda: flash_attention_decode(q, k, v, seqlens),
        "flashmoe-paged64": lambda: flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table),
    }
    if on_gpu:
        calls["read"] = _pure_read(k, v)
    # SDPA and flex take (B, H, L, D); a contiguous copy of the cache is their best layout.
    q_heads = q.transpose(1, 2)
    k_heads, v_heads = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    for name, kernel in SDPA_BACKENDS.items():
        if not on_gpu and name != "sdpa-math":
            continue

        def sdpa(kernel=kernel):
            with _sdpa_context(kernel)():
                return F.scaled_dot_product_attention(q_heads, k_heads, v_heads, enable_gqa=True)

        calls[name] = sdpa
    if on_gpu and batch == 1:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        # An explicit all-visible block mask, built once: with block_mask=None the compiled call ran at 0.11 TB/s
        # (benchmarks/tools/ab_flex_decode.py: 2.1 TB/s at 32k, 2.8 at 128k with this mask, as CUDA-graph replays).
        every_key = create_block_mask(lambda b, h, q_index, kv_index: q_index >= 0, B=None, H=None, Q_LEN=1,
                                      KV_LEN=length, device=device)
        calls["flex"] = lambda: flex(q_heads, k_heads, v_heads, block_mask=every_key, enable_gqa=True)
    return calls


def run_decode_bench(progress, skips: list[str], contexts=None, on_case_done=None) -> list[dict]:
    """Time every contender on every case; returns the records (see the module docstring). ``on_case_done(records)``
    after each case (the partial-results file)."""
    from flashmoe_science.bench.attention import cpu_median_ms

    on_gpu = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    cases = decode_cases(contexts or (GPU_CONTEXTS if on_gpu else CPU_CONTEXTS), batched=on_gpu)
    progress.set_total(len(cases))
    records = []
    for batch, length in cases:
        calls = _contenders(batch, length, device, dtype, on_gpu)
        kv_bytes = 2 * batch * length * HKV * HEAD_DIM * torch.finfo(dtype).bits // 8
        case_records = []
        for name, call in calls.items():
            try:
                ms = gpu_median_ms(_graphed(call)) if on_gpu else cpu_median_ms(call)
            except Exception as error:  # a backend that rejects the shape or cannot be captured: n/a
                skips.append(f"{name} B={batch} L={length}: {type(error).__name__}: {str(error)[:160]}")
                continue
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            case_records.append({"op": "decode", "layout": "paged64" if name.endswith("paged64") else "contiguous",
                                 "B": batch, "L": length, "Hq": HQ, "Hkv": HKV, "D": HEAD_DIM,
                                 "dtype": str(dtype).removeprefix("torch."), "backend": name,
                                 "ms": round_significant(ms), "tbps": round_significant(tbps),
                                 "of_peak": round_significant(tbps / H200_PEAK_TBPS)})
        read = next((r["tbps"] for r in case_records if r["backend"] == "read"), None)
        for record in case_records:
            record["of_read"] = None if read is None else round_significant(record["tbps"] / read)
        records += case_records
        del calls
        if on_gpu:
            torch.cuda.empty_cache()
        if on_case_done is not None:
            on_case_done(records)
        progress.update(desc=f"B={batch} L={length}")
    return records


def decode_table(records: list[dict]) -> str:
    """TB/s per backend, one row per (B, L); ours against the pure read, the peak and the best SDPA/flex."""
    rows = {}
    for record in records:
        rows.setdefault((record["B"], record["L"]), {})[record["backend"]] = record["tbps"]
    columns = [name for name in BACKEND_ORDER if any(name in values for values in rows.values())]
    body = []
    for (batch, length), values in rows.items():
        ours = max((values[name] for name in ("flashmoe", "flashmoe-paged64") if name in values), default=None)
        theirs = max((values[name] for name in (*SDPA_BACKENDS, "flex") if name in values), default=None)
        body.append([f"B={batch} L={length}", *(format_number(values.get(name), 2) for name in columns),
                     format_number(ratio(values.get("flashmoe"), values.get("read")), 2),
                     format_number(ratio(values.get("flashmoe"), H200_PEAK_TBPS), 2),
                     format_number(ratio(ours, theirs), 2)])
    return format_table(["case (TB/s)", *columns, "ours/read", "ours/4.3", "ours/best-torch"], body)


def plot_decode(records: list[dict], path, title: str):
    """TB/s against context, one panel for B=1 and one for B·L = 256k, one line per backend."""
    panels: dict[str, dict[str, list]] = {}
    for record in records:
        panel = "B=1" if record["B"] == 1 else f"B·L={TOKENS_PER_BATCH // 1024}k"
        panels.setdefault(panel, {}).setdefault(record["backend"], []).append((record["L"], record["tbps"]))
    if not panels:
        return None
    return plot_panels(path, panels, xlabel="context (tokens)", ylabel="TB/s (K+V bytes / time)", suptitle=title,
                       columns=2)


def bandwidth_note() -> str:
    return (f"bandwidth = bytes of K and V read / time; peak {H200_PEAK_TBPS} TB/s (H200 HBM3e); 'read' is a pure "
            "read kernel over the same bytes; every call timed as a CUDA-graph replay with L2 flushed")

