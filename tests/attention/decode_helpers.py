"""Shared by the decode tests (CPU, interpreter, GPU): random caches, the float64 oracle, the tolerance rule.

The oracle is `decode_reference` run on float64 copies of the inputs (after rounding to the tested dtype): the
reference itself is checked against an independent float64 SDPA over the gathered cache in test_decode.py.
PyTorch's own error in the tested dtype is the plain attention chain computed in that dtype (scores, softmax and
the value product each rounded to it, as SDPA's math backend does) on the same gathered cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmoe_science.attention.decode.checks import check_decode
from flashmoe_science.attention.decode.problem import FP8_CACHE
from flashmoe_science.attention.decode.reference import decode_reference, rotate_new_tokens
from flashmoe_science.attention.mask import score_mods

OUT_SLACK = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-5, torch.float64: 1e-12}


@dataclass
class DecodeCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None = None
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def kwargs(self, **options) -> dict:
        names = ("block_table", "k_new", "v_new", "rotary_cos", "rotary_sin", "alibi_slopes", "cache_batch_idx",
                 "cache_leftpad", "k_scale", "v_scale")
        return {**{name: getattr(self, name) for name in names}, **options}

    def fresh_caches(self) -> "DecodeCase":
        """The same case with its own copies of the caches (an append writes them in place)."""
        return DecodeCase(**{**self.__dict__, "k_cache": self.k_cache.clone(), "v_cache": self.v_cache.clone()})


def make_case(lengths, *, lq=1, hq=4, hkv=2, d=64, dtype=torch.float32, device="cpu", block_size=None,
              capacity=None, num_new=0, rotary=False, alibi=False, spare_blocks=3, leftpad=False, batch_idx=False,
              fp8=False) -> DecodeCase:
    """lengths: cache_seqlens per batch row (before the append). block_size None: contiguous cache of `capacity`
    (default: the longest sequence after the append). Paged: blocks shuffled across the pool, spare ones unused.
    leftpad: a random first position in [0, length] per row; batch_idx: the rows drawn from a cache of twice the
    batch; fp8: e4m3 caches (random values of scale ~1 per head) with random per-KV-head scales."""
    batch = len(lengths)
    need = max(lengths) + num_new
    capacity = capacity or max(need, 1)

    def rand(*shape):
        return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)

    q = rand(batch, lq, hq, d)
    cache_rows = 2 * batch if batch_idx else batch
    if block_size is None:
        k_cache, v_cache, table = rand(cache_rows, capacity, hkv, d), rand(cache_rows, capacity, hkv, d), None
    else:
        per_row = math.ceil(capacity / block_size)
        pool = batch * per_row + spare_blocks
        k_cache, v_cache = rand(pool, block_size, hkv, d), rand(pool, block_size, hkv, d)
        table = torch.randperm(pool, device=device)[: batch * per_row].view(batch, per_row).to(torch.int32)
    case = DecodeCase(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=device), table)
    if num_new:
        case.k_new, case.v_new = rand(batch, num_new, hkv, d), rand(batch, num_new, hkv, d)
    if rotary:
        positions = torch.arange(capacity + 8, dtype=torch.float64, device=device)
        freqs = 10000.0 ** (-torch.arange(0, d // 2, dtype=torch.float64, device=device) / (d // 2))
        angles = positions[:, None] * freqs[None, :]
        case.rotary_cos, case.rotary_sin = angles.cos().float(), angles.sin().float()
    if alibi:
        case.alibi_slopes = torch.rand(batch, hq, dtype=torch.float32, device=device) * 0.5
    if leftpad:
        case.cache_leftpad = torch.tensor([int(torch.randint(0, n + 1, ())) for n in lengths], dtype=torch.int32,
                                          device=device)
    if batch_idx:
        case.cache_batch_idx = torch.randperm(cache_rows, device=device)[:batch].to(torch.int32)
    if fp8:
        case.k_scale = torch.rand(hkv, dtype=torch.float32, device=device) * 0.5 + 0.25
        case.v_scale = torch.rand(hkv, dtype=torch.float32, device=device) * 0.5 + 0.25
        case.k_cache = (torch.randn(k_cache.shape, device=device) * 2).to(FP8_CACHE)
        case.v_cache = (torch.randn(v_cache.shape, device=device) * 2).to(FP8_CACHE)
    return case


def _as64(t):
    """A float64 copy (always a copy: the oracle's append must not touch the case's caches); e4m3 caches stay e4m3
    (their values are exact in float64 once dequantised, which the reference does)."""
    if t is None:
        return None
    return t.to(torch.float64 if t.is_floating_point() and t.dtype != FP8_CACHE else t.dtype, copy=True)


def _extras(case) -> dict:
    return dict(cache_batch_idx=case.cache_batch_idx, cache_leftpad=case.cache_leftpad, k_scale=case.k_scale,
                v_scale=case.v_scale)


def oracle(case: DecodeCase, **mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (out, lse, k_cache, v_cache after the append) of the case, leaving its tensors untouched."""
    c64 = DecodeCase(**{name: _as64(value) for name, value in case.__dict__.items()})
    problem = check_decode(c64.q, c64.k_cache, c64.v_cache, c64.cache_seqlens, c64.block_table, c64.k_new,
                           c64.v_new, c64.rotary_cos, c64.rotary_sin, mask.get("causal", True),
                           mask.get("softmax_scale"), mask.get("window"), mask.get("softcap"), c64.alibi_slopes,
                           **_extras(case))
    out, lse = decode_reference(c64.q, c64.k_cache, c64.v_cache, c64.cache_seqlens, problem, c64.block_table,
                                c64.k_new, c64.v_new, c64.rotary_cos, c64.rotary_sin,
                                mask.get("rotary_interleaved", False), c64.alibi_slopes,
                                cache_starts=case.cache_leftpad, cache_batch_idx=case.cache_batch_idx,
                                k_scale=case.k_scale, v_scale=case.v_scale)
    return out, lse, c64.k_cache, c64.v_cache


def torch_same_dtype_error(case: DecodeCase, ref_out: torch.Tensor, k_after, v_after, **mask) -> float:
    """max |PyTorch's attention in the case's dtype - ref_out|, over the gathered (already appended, rotated) cache
    of the oracle rounded back to the dtype."""
    dtype = case.q.dtype
    c64 = DecodeCase(**{name: value if name.endswith("cache") else _as64(value)
                        for name, value in case.__dict__.items()})
    problem = check_decode(c64.q, k_after, v_after, c64.cache_seqlens, c64.block_table, c64.k_new, c64.v_new, None, None,
                           mask.get("causal", True), mask.get("softmax_scale"), mask.get("window"),
                           mask.get("softcap"), c64.alibi_slopes, **_extras(case))
    q = c64.q
    if case.rotary_cos is not None:  # the rotated q, as the oracle saw it
        q, _ = rotate_new_tokens(q, c64.k_new, c64.rotary_cos, c64.rotary_sin, case.cache_seqlens, problem,
                                 mask.get("rotary_interleaved", False))
    worst = 0.0
    for b in range(problem.batch):
        start = 0 if case.cache_leftpad is None else int(case.cache_leftpad[b])
        lk = int(case.cache_seqlens[b]) + problem.num_new - start
        if lk == 0:
            continue
        pos = torch.arange(start, start + lk, device=q.device)
        if case.block_table is None:
            row = b if case.cache_batch_idx is None else int(case.cache_batch_idx[b])
            keys, values = k_after[row, pos], v_after[row, pos]
        else:
            blocks = case.block_table[b, pos // problem.block_size].long()
            keys, values = k_after[blocks, pos % problem.block_size], v_after[blocks, pos % problem.block_size]
        if case.k_scale is not None:  # the dequantised cache, as the oracle reads it
            keys = keys.to(torch.float64) * case.k_scale.to(torch.float64).expand(keys.shape[1]).unsqueeze(-1)
            values = values.to(torch.float64) * case.v_scale.to(torch.float64).expand(keys.shape[1]).unsqueeze(-1)
        keys = keys.to(dtype).transpose(0, 1).repeat_interleave(problem.group, 0)
        values = values.to(dtype).transpose(0, 1).repeat_interleave(problem.group, 0)
        queries = q[b].to(dtype).transpose(0, 1)
        scores = (queries @ keys.transpose(-1, -2)) * problem.softmax_scale
        slopes = None if case.alibi_slopes is None else case.alibi_slopes.expand(problem.batch, -1)[b : b + 1]
        scores = score_mods(scores.unsqueeze(0), problem.mask, problem.seqlen_q, lk, slopes)[0]
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = (probs @ values).transpose(0, 1)
        worst = max(worst, (out.to(torch.float64) - ref_out[b]).abs().max().item())
    return worst


def assert_decode_close(case: DecodeCase, out, lse=None, k_after=None, v_after=None, **mask):
    """out (and lse, and the caches after an append) vs the float64 oracle within 2x PyTorch's error + slack."""
    ref_out, ref_lse, ref_k, ref_v = oracle(case, **mask)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), "non-finite output"
    ours = (out.to(torch.float64) - ref_out).abs().max().item()
    theirs = torch_same_dtype_error(case, ref_out, ref_k, ref_v, **mask)
    bound = 2 * theirs + OUT_SLACK[case.q.dtype]
    assert ours <= bound, f"out error {ours:.3e} > {bound:.3e} (2 x torch's {theirs:.3e} + slack)"
    if lse is not None:
        assert lse.shape == (case.q.shape[0], case.q.shape[2], case.q.shape[1]) and lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
        finite = torch.isfinite(ref_lse)
        if finite.any():
            err = (lse[finite].to(torch.float64) - ref_lse[finite]).abs().max().item()
            assert err <= 2e-2 * max(1.0, ref_lse[finite].abs().max().item()) if case.q.dtype != torch.float32 \
                else err <= 1e-4, f"lse error {err:.3e}"
    if k_after is not None:  # the append: bit-exact where nothing is rotated, one rounding where it is
        tol = 0.0 if case.rotary_cos is None else 2 * torch.finfo(case.q.dtype).eps * 8
        for name, ours_cache, ref_cache in (("k_cache", k_after, ref_k), ("v_cache", v_after, ref_v)):
            if ref_cache.dtype == FP8_CACHE:  # e4m3 values: equal, or one step (1/8 relative) where a rotation rounded
                a, r = ours_cache.to(torch.float64), ref_cache.to(torch.float64)
                step = 0.0 if case.rotary_cos is None else 0.125 * torch.maximum(a.abs(), r.abs()) + 2.0 ** -9
                assert ((a - r).abs() <= step).all(), f"{name} after the append differs"
                continue
            diff = (ours_cache.to(torch.float64) - ref_cache.to(case.q.dtype).to(torch.float64)).abs().max().item()
            assert diff <= tol, f"{name} after the append differs by {diff:.3e}"
    return ours, theirs


def run_and_check(case: DecodeCase, **options):
    """flash_attention_decode on copies of the case's caches (the append writes them), checked against the oracle:
    the output, the lse and, where new tokens were appended, the caches."""
    from flashmoe_science import flash_attention_decode

    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out, lse = flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens,
                                      **case.kwargs(return_lse=True, **options))
    if out.is_cuda:
        torch.cuda.synchronize()
    mask = {name: options[name] for name in ("causal", "window", "softcap", "rotary_interleaved") if name in options}
    appended = case.k_new is not None
    return assert_decode_close(case, out, lse, k_cache if appended else None, v_cache if appended else None, **mask)


def run_varlen_case(paged: bool, dtype, atol: float, *, device="cpu", backend="auto", hq=4, hkv=2, d=32,
                    block_size=16, q_lengths=(0, 1, 7, 20, 5), k_lengths=(3, 1, 30, 20, 0), **mask):
    """flash_attention_varlen with keys read in place (paged with block_table, or packed with spare rows after each
    sequence and seqused_k) against float64 packed attention over the gathered keys (the reference backend)."""
    from flashmoe_science import flash_attention_varlen

    def rand(*shape):
        return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)

    def cumulative(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    batch = len(q_lengths)
    cu_q = cumulative(q_lengths)
    q = rand(int(cu_q[-1]), hq, d)
    seqused = torch.tensor(k_lengths, dtype=torch.int32, device=device)
    if paged:
        per_row = math.ceil(max(k_lengths) / block_size) + 1
        pool = batch * per_row + 2
        k, v = rand(pool, block_size, hkv, d), rand(pool, block_size, hkv, d)
        table = torch.randperm(pool, device=device)[: batch * per_row].view(batch, per_row).to(torch.int32)
        cu_k = cumulative(k_lengths)
        gather = [table[b, torch.arange(n, device=device) // block_size].long() * block_size
                  + torch.arange(n, device=device) % block_size for b, n in enumerate(k_lengths)]
        flat_k, flat_v = k.flatten(0, 1), v.flatten(0, 1)
        extra = dict(block_table=table, seqused_k=seqused)
    else:
        spare = [2 + b for b in range(batch)]
        cu_k = cumulative([n + s for n, s in zip(k_lengths, spare)])
        k, v = rand(int(cu_k[-1]), hkv, d), rand(int(cu_k[-1]), hkv, d)
        gather = [int(cu_k[b]) + torch.arange(n, device=device) for b, n in enumerate(k_lengths)]
        flat_k, flat_v = k, v
        extra = dict(seqused_k=seqused)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths) + 8, return_lse=True,
                                      backend=backend, **extra, **mask)
    index = torch.cat(gather)
    k64, v64 = flat_k[index].to(torch.float64), flat_v[index].to(torch.float64)
    ref_out, ref_lse = flash_attention_varlen(q.to(torch.float64), k64, v64, cu_q, cumulative(k_lengths),
                                              max(q_lengths), max(k_lengths), return_lse=True, backend="reference",
                                              **mask)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, q.shape[0])
    assert torch.isfinite(out).all()
    err = (out.to(torch.float64) - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= atol, f"out error {err:.3e} > {atol:.1e}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].to(torch.float64) - ref_lse[finite]).abs().max().item() <= max(atol, 1e-4) * 10


def captured(call):
    """`(graph, outputs)`: `call` run once on a side stream (its kernels compile outside the capture), then captured
    in a CUDA graph whose replays write `outputs`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs
