"""Decode benchmark (`flashmoe-science bench --suite decode`): one new token against a full KV cache, prefill chunks
appended to a cache, and a served workload.

Decode reads the cache once, so its measure is bandwidth: bytes of K and V read / time, against the H200's
4.3 TB/s and against a pure-read kernel over the same bytes timed in the same run. Hq=32, Hkv=8, D=128, bf16;
contexts 8k..1M at B=1 and at the B with B·context = 256k tokens; our kernel on a contiguous cache and on a paged
one (block 64, blocks shuffled over the pool); PyTorch SDPA (every backend that takes the shape, enable_gqa, on a
contiguous (B, Hkv, L, D) copy: their best layout) and compiled FlexAttention (B=1) beside it.

On the GPU an e4m3 cache (per-KV-head scales) is timed beside the bf16 one ("flashmoe-fp8", "flashmoe-fp8-paged64";
its TB/s count the e4m3 bytes it reads, half of bf16's).

vLLM's FlashAttention-3 build ("fa3-paged64", "fa3-chunk-paged64"; where `bench.attention.fa3_skip_reason` finds it
importable, else one line says why) reads the same paged pool, (num_blocks, 64, Hkv, D) as it takes it, through
`flash_attn_varlen_func(..., seqused_k=, block_table=, fa_version=3)` as vLLM calls it: scheduler metadata made once
outside timing; decode with the split bound of vLLM's CUDA-graph decode steps, chunks with FA3's own choice.

Prefill chunks (`run_chunk_bench`): Lq = 512 and 128 new tokens appended to a cache of 4k and 32k (--quick: 512 at
32k) and attending it (bottom-right causal), ours on contiguous and paged caches, against our dense forward on the
same shape and SDPA (cuDNN, efficient) with a lower-right causal additive bias on contiguous copies. TFLOP/s count
the visible (query, key) pairs.

Every call is captured once in a CUDA graph and the graph's replay is timed (triton's do_bench: L2 flushed
before each replay, median), so host launch overhead is not measured for anyone. Records:
    {"op": "decode", "layout", "B", "L", "Hq", "Hkv", "D", "backend", "kv_dtype", "ms", "tbps", "of_peak", "of_read"}
    {"op": "prefill_chunk", "layout", "B", "Lq", "L", "Hq", "Hkv", "D", "backend", "ms", "tflops"}
    {"op": "decode_ragged", ... as "decode", "L_min"}: a serving engine's decode step (`run_serving_decode_bench`)

`run_serving_bench`: transformers' continuous batching (`generate_batch`) of a small random Qwen3-like model over
many prompts, tokens/s per attention implementation (ours, `sdpa`: transformers' paged SDPA), greedy outputs
compared.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashmoe_science.bench.report import (
    format_number,
    format_table,
    gpu_median_ms,
    graph_replay,
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
BACKEND_ORDER = ("flashmoe", "flashmoe-paged64", "flashmoe-fp8", "flashmoe-fp8-paged64", "fa3-paged64", "read",
                 *SDPA_BACKENDS, "flex")
FA3_DECODE_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph: the split bound of its graphed decode steps
# (new tokens, cache length after them), grouped by new tokens: a group's cases share their kernels' compilation
# (seconds per contender, against ~0.15 s of timing), which is most of this table's run time.
CHUNK_CASES = ((512, 4096), (512, 32768), (128, 4096), (128, 32768))
QUICK_CHUNK_CASES = ((512, 32768),)  # --quick: one compilation per contender


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


def fa3_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seqused_k: torch.Tensor,
              block_table: torch.Tensor, max_seqlen_k: int, num_splits: int = 0) -> Callable[[], torch.Tensor]:
    """vLLM's FlashAttention-3 over a paged cache, as vLLM calls it: q (B, Lq, Hq, D) the new tokens (viewed as its
    token-major (B·Lq, Hq, D)), each row's last Lq of its `seqused_k` cached keys, bottom-right causal; pools
    (num_blocks, block_size, Hkv, D), an int32 block table. The scheduler metadata is made here, once (vLLM's metadata
    builder makes it before the layers run); `num_splits` 0 lets FA3 choose. Returns the call, whose output is
    (B, Lq, Hq, D)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    batch, new_tokens, heads, dim = q.shape
    packed = q.view(batch * new_tokens, heads, dim)
    cu_seqlens_q = torch.arange(0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32, device=q.device)
    metadata = get_scheduler_metadata(
        batch_size=batch, max_seqlen_q=new_tokens, max_seqlen_k=max_seqlen_k, num_heads_q=heads,
        num_heads_kv=k_pool.shape[2], headdim=dim, cache_seqlens=seqused_k, qkv_dtype=q.dtype,
        cu_seqlens_q=cu_seqlens_q, page_size=k_pool.shape[1], causal=True, num_splits=num_splits)

    def call():
        out = flash_attn_varlen_func(packed, k_pool, v_pool, max_seqlen_q=new_tokens, cu_seqlens_q=cu_seqlens_q,
                                     max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                                     causal=True, softmax_scale=dim ** -0.5, scheduler_metadata=metadata,
                                     num_splits=num_splits, fa_version=3)
        return out.view(batch, new_tokens, heads, dim)

    return call


def fa3_missing_line(skips: list[str]) -> bool:
    """Whether vLLM's FlashAttention-3 can run the decode suite's shapes here; if not, its reason joins `skips` (one
    line for the whole command)."""
    from flashmoe_science.bench.attention import fa3_skip_reason

    reason = fa3_skip_reason(HEAD_DIM)
    line = f"fa3 (vLLM's FlashAttention-3): {reason}"
    if reason is not None and line not in skips:
        skips.append(line)
    return reason is None


def _contenders(batch: int, length: int, device, dtype, on_gpu: bool,
                fa3: bool = False) -> dict[str, Callable[[], object]]:
    """Each backend's call on the same cache contents (a backend that cannot be set up is left out); `fa3` adds
    vLLM's FlashAttention-3 on the paged pool."""
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
        scale = torch.full((HKV,), 0.5, dtype=torch.float32, device=device)
        k8, v8, k8_pool, v8_pool = (t.div(0.5).to(torch.float8_e4m3fn) for t in (k, v, k_pool, v_pool))
        calls["flashmoe-fp8"] = lambda: flash_attention_decode(q, k8, v8, seqlens, k_scale=scale, v_scale=scale)
        calls["flashmoe-fp8-paged64"] = lambda: flash_attention_decode(q, k8_pool, v8_pool, seqlens,
                                                                       block_table=table, k_scale=scale,
                                                                       v_scale=scale)
        calls["read"] = _pure_read(k, v)
    if fa3:
        calls["fa3-paged64"] = fa3_paged(q, k_pool, v_pool, seqlens, table, length, FA3_DECODE_SPLITS)
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
    fa3 = fa3_missing_line(skips)
    progress.set_total(len(cases))
    records = []
    for batch, length in cases:
        calls = _contenders(batch, length, device, dtype, on_gpu, fa3)
        case_records = []
        for name, call in calls.items():
            try:
                ms = gpu_median_ms(graph_replay(call)) if on_gpu else cpu_median_ms(call)
            except Exception as error:  # a backend that rejects the shape or cannot be captured: n/a
                skips.append(f"{name} B={batch} L={length}: {type(error).__name__}: {str(error)[:160]}")
                continue
            kv_dtype = torch.float8_e4m3fn if "fp8" in name else dtype
            kv_bytes = 2 * batch * length * HKV * HEAD_DIM * torch.finfo(kv_dtype).bits // 8
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            case_records.append({"op": "decode", "layout": "paged64" if name.endswith("paged64") else "contiguous",
                                 "B": batch, "L": length, "Hq": HQ, "Hkv": HKV, "D": HEAD_DIM,
                                 "dtype": str(dtype).removeprefix("torch."),
                                 "kv_dtype": str(kv_dtype).removeprefix("torch."), "backend": name,
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
    """TB/s per backend, one row per (B, L); ours against the pure read, the peak and the best SDPA/flex; with
    vLLM's FlashAttention-3, ours on the same paged pool against it; with an e4m3 cache, its speed-up over bf16 (time
    ratio, contiguous caches)."""
    rows, times = {}, {}
    for record in records:
        if record.get("op", "decode") != "decode":
            continue
        rows.setdefault((record["B"], record["L"]), {})[record["backend"]] = record["tbps"]
        times.setdefault((record["B"], record["L"]), {})[record["backend"]] = record.get("ms")
    columns = [name for name in BACKEND_ORDER if any(name in values for values in rows.values())]
    body = []
    for (batch, length), values in rows.items():
        ours = max((values[name] for name in ("flashmoe", "flashmoe-paged64") if name in values), default=None)
        theirs = max((values[name] for name in (*SDPA_BACKENDS, "flex") if name in values), default=None)
        ms = times[(batch, length)]
        fp8 = [format_number(ratio(ms.get("flashmoe"), ms.get("flashmoe-fp8")), 2)] if "flashmoe-fp8" in columns else []
        fa3 = ([format_number(ratio(values.get("flashmoe-paged64"), values.get("fa3-paged64")), 2)]
               if "fa3-paged64" in columns else [])
        body.append([f"B={batch} L={length}", *(format_number(values.get(name), 2) for name in columns),
                     format_number(ratio(values.get("flashmoe"), values.get("read")), 2),
                     format_number(ratio(values.get("flashmoe"), H200_PEAK_TBPS), 2),
                     format_number(ratio(ours, theirs), 2), *fa3, *fp8])
    fa3_header = ["paged/fa3"] if "fa3-paged64" in columns else []
    fp8_header = ["fp8 speed-up"] if "flashmoe-fp8" in columns else []
    return format_table(["case (TB/s)", *columns, "ours/read", "ours/4.3", "ours/best-torch", *fa3_header,
                         *fp8_header], body)


def _chunk_contenders(new_tokens: int, length: int, device, dtype,
                      fa3: bool = False) -> dict[str, Callable[[], object]]:
    """A prefill chunk of `new_tokens` appended at length - new_tokens and attending the whole cache; `fa3` adds
    vLLM's FlashAttention-3 on the paged pool that already holds the chunk's keys (vLLM writes them before
    attention)."""
    from flashmoe_science import flash_attention_decode, flash_attention_science
    from flashmoe_science.attention.mask import make_mask, visibility
    from flashmoe_science.bench.attention import _sdpa_context

    q = torch.randn(1, new_tokens, HQ, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, length, HKV, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    k_new, v_new = k[:, length - new_tokens :].clone(), v[:, length - new_tokens :].clone()
    cached = torch.full((1,), length - new_tokens, dtype=torch.int32, device=device)
    k_pool, v_pool, table = _paged_copy(k, v)
    q_heads, k_heads, v_heads = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    calls = {
        "flashmoe-chunk": lambda: flash_attention_decode(q, k, v, cached, k_new=k_new, v_new=v_new),
        "flashmoe-chunk-paged64": lambda: flash_attention_decode(q, k_pool, v_pool, cached, block_table=table,
                                                                 k_new=k_new, v_new=v_new),
        "flashmoe-dense": lambda: flash_attention_science(q_heads, k_heads, v_heads, causal=True),
    }
    if fa3:
        whole = torch.full((1,), length, dtype=torch.int32, device=device)
        calls["fa3-chunk-paged64"] = fa3_paged(q, k_pool, v_pool, whole, table, length)
    # an additive bias (0 / -inf), what an SDPA user passes for a chunk: cuDNN and efficient take it, flash does not
    bias = torch.zeros(new_tokens, length, device=device, dtype=dtype).masked_fill(
        ~visibility(new_tokens, length, make_mask(True), device), float("-inf"))
    for name in ("sdpa-cudnn", "sdpa-efficient"):

        def sdpa(kernel=SDPA_BACKENDS[name]):
            with _sdpa_context(kernel)():
                return F.scaled_dot_product_attention(q_heads, k_heads, v_heads, attn_mask=bias, enable_gqa=True)

        calls[name] = sdpa
    return calls


def run_chunk_bench(progress, skips: list[str], cases=CHUNK_CASES, on_case_done=None) -> list[dict]:
    """Prefill chunks against a cache (GPU): the records of the module docstring. ``on_case_done(records)`` after
    each case."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    fa3 = fa3_missing_line(skips)
    progress.set_total(len(cases))
    records = []
    for new_tokens, length in cases:
        visible = new_tokens * length - new_tokens * (new_tokens - 1) // 2  # bottom-right causal pairs
        for name, call in _chunk_contenders(new_tokens, length, device, dtype, fa3).items():
            try:
                ms = gpu_median_ms(graph_replay(call))
            except Exception as error:  # a backend that rejects the shape or cannot be captured: n/a
                skips.append(f"{name} Lq={new_tokens} L={length}: {type(error).__name__}: {str(error)[:160]}")
                continue
            records.append({"op": "prefill_chunk", "layout": "paged64" if name.endswith("paged64") else "contiguous",
                            "B": 1, "Lq": new_tokens, "L": length, "Hq": HQ, "Hkv": HKV, "D": HEAD_DIM,
                            "dtype": "bfloat16", "backend": name, "ms": round_significant(ms),
                            "tflops": round_significant(4 * HQ * HEAD_DIM * visible / (ms * 1e-3) / 1e12)})
        torch.cuda.empty_cache()
        if on_case_done is not None:
            on_case_done(records)
        progress.update(desc=f"chunk Lq={new_tokens} L={length}")
    return records


# A serving engine's decode step: many sequences of ragged lengths, one new token each (vLLM's `decode` workload:
# 256 prompts of 128 tokens, 512 new), on its default pages of 16 and on pages of 64; longer contexts beside it.
SERVING_DECODE_CASES = ((256, 128, 640), (64, 1024, 4096))  # (sequences, shortest, longest)
SERVING_DECODE_PAGES = (16, 64)


def ragged_lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """`batch` key counts drawn uniformly from [shortest, longest], the same for a given batch in every run."""
    return torch.randint(shortest, longest + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()


def ragged_paged_cache(lengths: list[int], page: int, device, dtype, generator=None):
    """(k_pool, v_pool, block_table, seqlens) of random K/V for sequences of `lengths` keys in pages of `page` rows,
    each sequence's pages scattered over the pool; pools (num_blocks, page, Hkv, D), an int32 table."""
    per_seq = [math.ceil(n / page) for n in lengths]
    widest, blocks = max(per_seq), sum(per_seq)
    order = torch.randperm(blocks, device=device, generator=generator).to(torch.int32)
    table = torch.zeros(len(lengths), widest, dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(per_seq):
        table[row, :count] = order[start:start + count]
        start += count
    k_pool, v_pool = (torch.randn(blocks, page, HKV, HEAD_DIM, device=device, dtype=dtype, generator=generator)
                      for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return k_pool, v_pool, table, seqlens


def run_serving_decode_bench(progress, skips: list[str], cases=SERVING_DECODE_CASES, on_case_done=None) -> list[dict]:
    """Decode steps of ragged batches (GPU): ours and vLLM's FlashAttention-3 (its CUDA-graph split bound) on the
    same pools, pages of 16 and 64; records {"op": "decode_ragged"} with `run_decode_bench`'s fields, layout
    "paged<page>", L the longest sequence and L_min the shortest, TB/s of the bytes the batch's keys and values
    hold."""
    from flashmoe_science import flash_attention_decode

    device, dtype = torch.device("cuda"), torch.bfloat16
    fa3 = fa3_missing_line(skips)
    generator = torch.Generator(device=device).manual_seed(0)
    progress.set_total(len(cases) * len(SERVING_DECODE_PAGES))
    records = []
    for batch, shortest, longest in cases:
        lengths = ragged_lengths(batch, shortest, longest)
        kv_bytes = 2 * sum(lengths) * HKV * HEAD_DIM * torch.finfo(dtype).bits // 8
        q = torch.randn(batch, 1, HQ, HEAD_DIM, device=device, dtype=dtype, generator=generator)
        for page in SERVING_DECODE_PAGES:
            k_pool, v_pool, table, seqlens = ragged_paged_cache(lengths, page, device, dtype, generator)
            calls = {"flashmoe": lambda: flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table)}
            if fa3:
                calls["fa3"] = fa3_paged(q, k_pool, v_pool, seqlens, table, longest, FA3_DECODE_SPLITS)
            for name, call in calls.items():
                try:
                    ms = gpu_median_ms(graph_replay(call))
                except Exception as error:  # a backend that rejects the shape or cannot be captured: n/a
                    skips.append(f"{name} B={batch} {shortest}..{longest} page {page}: {type(error).__name__}: "
                                 f"{str(error)[:160]}")
                    continue
                tbps = kv_bytes / (ms * 1e-3) / 1e12
                records.append({"op": "decode_ragged", "layout": f"paged{page}", "B": batch, "L": longest,
                                "L_min": shortest, "Hq": HQ, "Hkv": HKV, "D": HEAD_DIM, "dtype": "bfloat16",
                                "kv_dtype": "bfloat16", "backend": name, "ms": round_significant(ms),
                                "tbps": round_significant(tbps), "of_peak": round_significant(tbps / H200_PEAK_TBPS)})
            del k_pool, v_pool
            torch.cuda.empty_cache()
            if on_case_done is not None:
                on_case_done(records)
            progress.update(desc=f"B={batch} {shortest}..{longest} page {page}")
    return records


def serving_decode_table(records: list[dict]) -> str:
    """TB/s per (batch, page): ours, FlashAttention-3, ours / FA3."""
    rows = {}
    for record in records:
        if record.get("op") == "decode_ragged":
            key = (record["B"], record["L_min"], record["L"], record["layout"])
            rows.setdefault(key, {})[record["backend"]] = record["tbps"]
    body = [[f"B={batch} {shortest}..{longest}", layout, format_number(values.get("flashmoe"), 2),
             format_number(values.get("fa3"), 2), format_number(ratio(values.get("flashmoe"), values.get("fa3")), 2)]
            for (batch, shortest, longest, layout), values in rows.items()]
    return format_table(["ragged decode (TB/s)", "layout", "flashmoe", "fa3", "ours/fa3"], body)


def chunk_table(records: list[dict]) -> str:
    """TFLOP/s per backend, one row per (Lq, L); ours against our dense forward and the best SDPA (and, with vLLM's
    FlashAttention-3, ours on the same paged pool against it)."""
    rows = {}
    for record in records:
        if record.get("op") == "prefill_chunk":
            rows.setdefault((record["Lq"], record["L"]), {})[record["backend"]] = record["tflops"]
    names = ("flashmoe-chunk", "flashmoe-chunk-paged64", "fa3-chunk-paged64", "flashmoe-dense", "sdpa-cudnn",
             "sdpa-efficient")
    columns = [name for name in names if any(name in values for values in rows.values())]
    with_fa3 = "fa3-chunk-paged64" in columns
    body = []
    for (new_tokens, length), values in rows.items():
        theirs = max((values[name] for name in ("sdpa-cudnn", "sdpa-efficient") if name in values), default=None)
        fa3 = ([format_number(ratio(values.get("flashmoe-chunk-paged64"), values.get("fa3-chunk-paged64")), 2)]
               if with_fa3 else [])
        body.append([f"Lq={new_tokens} L={length}", *(format_number(values.get(name), 3) for name in columns),
                     *fa3, format_number(ratio(values.get("flashmoe-chunk"), values.get("flashmoe-dense")), 2),
                     format_number(ratio(values.get("flashmoe-chunk"), theirs), 2)])
    return format_table(["chunk (TFLOP/s)", *columns, *(["paged/fa3"] if with_fa3 else []), "chunk/dense",
                         "chunk/best-sdpa"], body)


SERVING_PAGE = 256  # transformers' default page (block) size
SERVING_BATCH_TOKENS = 8192  # transformers' default max_batch_tokens


def serving_model_config():
    """The served model: a Qwen3-like decoder (hidden 1024, 8 layers, 16 query heads, 8 KV heads, head dim 128)."""
    import transformers

    return transformers.Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=4096)


def serving_options(lengths: list[int], new_tokens: int, page_size: int = SERVING_PAGE,
                    max_batch_tokens: int = SERVING_BATCH_TOKENS) -> dict:
    """Continuous-batching options sized to the workload, the same for every implementation. Left to
    transformers, the paged cache takes 90% of the free memory (about 2M tokens of this model on an 80 GB card):
    the CUDA-graph warm-up then runs one max_batch_tokens prefill against the whole cache (a 8192 x 2M attention per
    layer, twice with asynchronous batching), each `generate_batch` call sizes and warms a new cache, and the second
    implementation gets only what the first left in PyTorch's allocator. Here the cache holds every request at once
    (all prompts and their new tokens, one spare page each), so no request waits for pages or is evicted, and the
    scheduler's limits are explicit: max_batch_tokens, one batch may hold every request, block tables as wide as the
    longest request."""
    pages = sum(math.ceil((n + new_tokens) / page_size) + 1 for n in lengths)
    widest = math.ceil((max(lengths) + new_tokens) / page_size) + 1
    return dict(page_size=page_size, num_blocks=pages, max_batch_tokens=max_batch_tokens,
                max_requests_per_batch=len(lengths), max_blocks_per_request=widest + widest % 2)


def _phase_logger(log):
    """log(implementation, phase, seconds) for each finished phase (stderr by default: stdout carries the JSON)."""
    if log is not None:
        return log
    import sys

    return lambda implementation, phase, seconds: print(f"generate_batch {implementation}: {phase} {seconds:.1f} s",
                                                        file=sys.stderr, flush=True)


def run_serving_bench(num_prompts: int = 256, new_tokens: int = 32, device="cuda", seed: int = 0,
                      implementations=None, model_config=None, dtype=torch.bfloat16, log=None) -> list[dict]:
    """tokens/s of transformers' continuous batching (`generate_batch`) over `num_prompts` random prompts of 64..512
    tokens (greedy, `new_tokens` each), per attention implementation: ours (`hf.register_flash()`: varlen prefill,
    block-table decode on CUDA) and transformers' paged SDPA, on the model of `serving_model_config` (random
    weights) unless `model_config` is given.

    Both run the same continuous-batching options (`serving_options`); transformers decides per implementation
    whether to capture CUDA graphs and batch asynchronously (a flash implementation yes; SDPA, which needs an
    attention mask, no), and each record says what it decided. The manager is kept between a first pass over the
    whole workload (the warm-up: graph captures and kernel compilations for every batch shape the workload meets)
    and the timed second pass. A line per phase with its seconds goes to `log` (stderr by default). Each record
    says whether its greedy tokens equal the first implementation's and the timed pass's peak memory."""
    import time

    import transformers

    from flashmoe_science.integrations import hf

    log = _phase_logger(log)
    on_cuda = torch.device(device).type == "cuda"

    def synchronize():
        if on_cuda:
            torch.cuda.synchronize(device)

    started = time.perf_counter()
    torch.manual_seed(seed)
    config = model_config if model_config is not None else serving_model_config()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    lengths = torch.randint(64, 513, (num_prompts,)).tolist()
    prompts = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in lengths]
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    log("model", "built", time.perf_counter() - started)
    records, first = [], None
    for implementation in implementations or (hf.register_flash(), "sdpa"):
        options = serving_options(lengths, new_tokens)
        name = hf.paged_sdpa(options) if implementation == "sdpa" else implementation
        model.set_attn_implementation(name)
        cb_config = hf.continuous_batching_config(**options)
        passes = {}
        for phase in ("warm-up pass", "timed pass"):
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            synchronize()
            began = time.perf_counter()
            outputs = model.generate_batch(inputs=prompts, generation_config=generation,
                                           continuous_batching_config=cb_config, persistent_manager=True)
            synchronize()
            passes[phase] = time.perf_counter() - began
            log(implementation, phase, passes[phase])
        decided = model.init_continuous_batching().continuous_batching_config  # the kept manager's resolved options
        model.destroy_cached_continuous_batching_manager()
        tokens = [list(o.generated_tokens) for o in outputs.values()]  # in the order of the prompts
        generated = sum(map(len, tokens))
        first = tokens if first is None else first
        seconds = passes["timed pass"]
        records.append({"op": "generate_batch", "implementation": implementation, "prompts": num_prompts,
                        "new_tokens": new_tokens, "seconds": round_significant(seconds),
                        "warmup_seconds": round_significant(passes["warm-up pass"]),
                        "tokens_per_s": round_significant(generated / seconds),
                        "same_greedy_as_first": sum(map(list.__eq__, tokens, first)),
                        "requests_done": len(tokens),
                        "cuda_graphs": list(decided.cuda_graph_booleans), "async": bool(decided.use_async_batching),
                        "options": options,
                        "peak_gib": round_significant(torch.cuda.max_memory_allocated(device) / 2**30)
                        if on_cuda else None})
        del outputs
        if on_cuda:
            torch.cuda.empty_cache()
    log("all", "done", time.perf_counter() - started)
    return records


def plot_decode(records: list[dict], path, title: str):
    """TB/s against context, one panel for B=1 and one for B·L = 256k, one line per backend."""
    panels: dict[str, dict[str, list]] = {}
    for record in records:
        if record.get("op", "decode") != "decode":
            continue
        panel = "B=1" if record["B"] == 1 else f"B·L={TOKENS_PER_BATCH // 1024}k"
        panels.setdefault(panel, {}).setdefault(record["backend"], []).append((record["L"], record["tbps"]))
    if not panels:
        return None
    return plot_panels(path, panels, xlabel="context (tokens)", ylabel="TB/s (K+V bytes / time)", suptitle=title,
                       columns=2)


def bandwidth_note() -> str:
    return (f"bandwidth = bytes of K and V read / time; peak {H200_PEAK_TBPS} TB/s (H200 HBM3e); 'read' is a pure "
            "read kernel over the same bytes; every call timed as a CUDA-graph replay with L2 flushed")

