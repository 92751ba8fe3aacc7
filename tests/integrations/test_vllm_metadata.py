"""The vLLM backend's step translation (`integrations.vllm.metadata`) on batches shaped as vLLM builds them: decodes
first, then prefills, chunked prefills and prefix-cache hits over a shuffled paged cache; against float64 attention
per request. No vLLM import: CI cannot install vLLM (it pins a CUDA torch)."""

import math

import numpy as np
import pytest
import torch

from flashmoe_science.attention.seqlen import work_list
from flashmoe_science.integrations.vllm.metadata import CacheLayout, LayerOptions, build_step, count_decodes, run_step

HQ, HKV, D = 4, 2, 32


def _batch(q_lens, k_lens, block_size, dtype, seed=0, device="cpu", hq=HQ, hkv=HKV, d=D):
    """A step: per request (query length, key length); the cache already holds every key (the step's own too), as
    vLLM's KV write leaves it."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    max_blocks = max(-(-k // block_size) for k in k_lens) + 1
    num_blocks = num_reqs * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[:num_reqs * max_blocks].view(num_reqs, max_blocks).to(torch.int32)
    kv_cache = torch.randn(CacheLayout.shape(num_blocks, block_size, hkv, d), generator=g).to(device, dtype)
    table = table.to(device)
    k_cache, v_cache = CacheLayout.split(kv_cache)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    keys, values = [], []
    for r, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        pos = torch.arange(lk, device=device)
        blocks, offs = table[r, pos // block_size].long(), pos % block_size
        keys.append(k_cache[blocks, offs])
        values.append(v_cache[blocks, offs])
    new_k = torch.cat([k[-lq:] for k, lq in zip(keys, q_lens)])
    new_v = torch.cat([v[-lq:] for v, lq in zip(values, q_lens)])
    qsl = torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=torch.int32)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32)
    return dict(q=q, k=new_k, v=new_v, kv_cache=kv_cache, table=table, qsl=qsl, seq_lens=seq_lens, keys=keys,
                values=values, q_lens=q_lens, device=device)


def _reference(b, options, k_scale=1.0, v_scale=1.0, dtype=torch.float64):
    """Per-request attention in ``dtype`` (float64: the oracle; the inputs' dtype: what PyTorch's own error is)."""
    outs, start = [], 0
    for lq, k, v in zip(b["q_lens"], b["keys"], b["values"]):
        q = b["q"][start:start + lq].to(dtype).transpose(0, 1)
        group = q.shape[0] // k.shape[1]
        k = (k.to(dtype) * k_scale).transpose(0, 1).repeat_interleave(group, 0)
        v = (v.to(dtype) * v_scale).transpose(0, 1).repeat_interleave(group, 0)
        s = q @ k.transpose(-1, -2) * options.softmax_scale
        if options.softcap:
            s = options.softcap * torch.tanh(s / options.softcap)
        lk = k.shape[1]
        qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        ki = torch.arange(lk, device=q.device)[None, :]
        masked = ki > qi
        if options.window is not None and options.window[0] >= 0:
            masked |= ki < qi - options.window[0]
        s = s.masked_fill(masked, -math.inf)
        outs.append((s.float().softmax(-1).to(dtype) @ v).transpose(0, 1))
        start += lq
    return torch.cat(outs)


def _run(b, options, block_size, dtype_out, **scales):
    layout, device = CacheLayout(block_size), b["device"]
    meta = build_step(layout, b["qsl"].to(device), b["qsl"], b["seq_lens"].to(device), b["seq_lens"], b["table"],
                      b["q"].shape[0], max(b["q_lens"]))
    out = torch.full(b["q"].shape, float("nan"), dtype=dtype_out, device=device)
    run_step(meta, options, b["q"], b["k"], b["v"], b["kv_cache"], out, **scales)
    return meta, out


CASES = {
    "decode only": ([1, 1, 1], [1, 37, 300]),
    "prefill only, no context": ([17, 64, 3], [17, 64, 3]),
    "mixed: decodes, chunked prefill, prefix hit": ([1, 1, 40, 7, 100], [9, 250, 40, 77, 130]),
    "one request": ([33], [33]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 64])
def test_step_matches_float64(case, block_size):
    q_lens, k_lens = CASES[case]
    b = _batch(q_lens, k_lens, block_size, torch.float32)
    options = LayerOptions(D ** -0.5)
    meta, out = _run(b, options, block_size, torch.float32)
    assert meta.num_decodes == count_decodes(b["qsl"])
    ref = _reference(b, options)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_prefill_keys_come_from_the_step_or_the_cache():
    fresh = _batch([5, 9], [5, 9], 16, torch.float32)
    meta, _ = _run(fresh, LayerOptions(0.2), 16, torch.float32)
    assert meta.num_decodes == 0 and meta.prefill.k_rows is None
    cached = _batch([1, 5, 9], [20, 5, 30], 16, torch.float32)
    meta, _ = _run(cached, LayerOptions(0.2), 16, torch.float32)
    assert meta.num_decodes == 1 and meta.prefill.k_rows.shape == (35,)
    assert meta.prefill.cu_seqlens_k.tolist() == [0, 5, 35] and meta.prefill.cu_seqlens_q.tolist() == [0, 5, 14]


def test_window_and_softcap():
    b = _batch([1, 30, 12], [80, 30, 50], 16, torch.float32, seed=3)
    options = LayerOptions(D ** -0.5, window=(15, 0), softcap=5.0)
    _, out = _run(b, options, 16, torch.float32)
    torch.testing.assert_close(out.double(), _reference(b, options), atol=2e-5, rtol=2e-5)


def test_fp8_cache_dequantizes_with_the_layer_scales():
    b = _batch([1, 1, 20, 6], [40, 3, 20, 90], 16, torch.float32, seed=5)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.25])
    b["kv_cache"] = b["kv_cache"].to(torch.float8_e4m3fn)
    b["keys"] = [k.to(torch.float8_e4m3fn) for k in b["keys"]]
    b["values"] = [v.to(torch.float8_e4m3fn) for v in b["values"]]
    # the step's own keys as the model computed them, before the write quantized them
    b["k"], b["v"] = b["k"].to(torch.float8_e4m3fn).float() * 0.5, b["v"].to(torch.float8_e4m3fn).float() * 0.25
    options = LayerOptions(D ** -0.5)
    _, out = _run(b, options, 16, torch.float32, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.double(), _reference(b, options, 0.5, 0.25), atol=1e-4, rtol=1e-4)


def test_a_step_built_under_inference_mode_lets_its_layers_share_one_work_list():
    """vLLM builds and runs its steps under torch.inference_mode, whose tensors have no version counter: the step's
    cumulative lengths are made outside it, so the packed forward's work list (remembered per cu_seqlens tensor
    with a counter) is computed by the first layer only."""
    b = _batch([1, 5, 9], [20, 5, 30], 16, torch.float32)
    with torch.inference_mode():
        qsl, seq_lens = b["qsl"].clone(), b["seq_lens"].clone()
        assert qsl.is_inference()
        meta = build_step(CacheLayout(16), qsl, qsl, seq_lens, seq_lens, b["table"], 15, 9)
        part = meta.prefill
        assert not part.cu_seqlens_q.is_inference() and not part.cu_seqlens_k.is_inference()
        assert part.cu_seqlens_q.dtype == part.cu_seqlens_k.dtype == torch.int32
        assert work_list(part.cu_seqlens_q, 64) is work_list(part.cu_seqlens_q, 64)
        out = torch.full(b["q"].shape, float("nan"))
        run_step(meta, LayerOptions(D ** -0.5), b["q"], b["k"], b["v"], b["kv_cache"], out)
    torch.testing.assert_close(out.double(), _reference(b, LayerOptions(D ** -0.5)), atol=2e-5, rtol=2e-5)


def test_count_decodes():
    assert count_decodes(torch.tensor([0, 1, 2, 7, 8])) == 2
    assert count_decodes(torch.tensor([0, 1, 2])) == 2
    assert count_decodes(torch.tensor([0, 4])) == 0


GPU_CASES = {
    "decode 1..32k": ([1] * 6, [1, 2, 100, 1000, 8191, 32768]),
    "ragged prefill with prefixes": ([1, 1, 513, 64, 1000, 7], [20, 4000, 513, 1064, 3000, 2055]),
    "prefill, no prefixes": ([300, 1024, 77, 2048], [300, 1024, 77, 2048]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64), (8, 1, 256)])
@pytest.mark.parametrize("fp8", [False, True])
def test_step_on_gpu_within_twice_torchs_error(case, block_size, heads, fp8):
    hq, hkv, d = heads
    q_lens, k_lens = GPU_CASES[case]
    b = _batch(q_lens, k_lens, block_size, torch.bfloat16, seed=11, device="cuda", hq=hq, hkv=hkv, d=d)
    scales, ks, vs = {}, 1.0, 1.0
    if fp8:
        ks, vs = 0.5, 0.75
        scales = dict(k_scale=torch.tensor([ks], device="cuda"), v_scale=torch.tensor([vs], device="cuda"))
        b["kv_cache"] = b["kv_cache"].to(torch.float8_e4m3fn)
        b["keys"] = [k.to(torch.float8_e4m3fn) for k in b["keys"]]
        b["values"] = [v.to(torch.float8_e4m3fn) for v in b["values"]]
        b["k"] = (b["k"].to(torch.float8_e4m3fn).float() * ks).to(torch.bfloat16)
        b["v"] = (b["v"].to(torch.float8_e4m3fn).float() * vs).to(torch.bfloat16)
    options = LayerOptions(d ** -0.5)
    _, out = _run(b, options, block_size, torch.bfloat16, **scales)
    ref = _reference(b, options, ks, vs)
    torch_error = (_reference(b, options, ks, vs, dtype=torch.bfloat16).double() - ref).abs().max().item()
    error = (out.double() - ref).abs().max().item()
    assert not out.isnan().any()
    assert error <= 2 * torch_error + 2e-3, (error, torch_error)
