"""The SGLang backend's batch translation (`integrations.sglang.metadata`) on batches shaped as SGLang builds them: a
token-major pool of whole pages handed out in shuffled order, requests at scattered ``req_to_token`` rows, decode
batches (eager, and through the CUDA-graph buffers with padded requests), extend batches with and without prefixes;
against float64 attention per request. No SGLang import: CI cannot install SGLang (it pins a CUDA torch). Also the
plugin's refusal of a page size, its silence without SGLang, and its entry point."""

import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashmoe_science.attention.seqlen import work_list
from flashmoe_science.integrations.engine_attention import LayerOptions, packed_keys
from flashmoe_science.integrations.sglang import register
from flashmoe_science.integrations.sglang.metadata import (DecodeGraphBuffers, PoolLayout, build_decode, build_extend,
                                                           page_size_refusal, run_decode, run_extend)
from integrations.test_vllm_metadata import _reference

HQ, HKV, D = 4, 2, 32
MAX_REQS, CONTEXT = 7, 600  # req_to_token's rows and columns (not a multiple of every page size)


def _pool(seq_lens, page_size, dtype=torch.float32, seed=0, device="cpu", hq=HQ, hkv=HKV, d=D):
    """A pool holding every request's keys (the batch's new ones too, as SGLang writes them before attention):
    page 0 reserved (SGLang's padding page), the others handed out shuffled; requests at scattered rows of a
    req_to_token whose unused entries are stale slots."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_needed) + 4
    rows = num_pages * page_size
    k_buffer = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
    v_buffer = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
    # columns past the longest request and not a multiple of a page: the GPU cases hold up to 32k keys
    context = max(CONTEXT, max(seq_lens, default=0) + 7)
    req_to_token = torch.randint(0, rows, (MAX_REQS, context), generator=g, dtype=torch.int32)
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    req_pool_indices = torch.randperm(MAX_REQS, generator=g)[:len(seq_lens)]
    for idx, n in zip(req_pool_indices.tolist(), seq_lens):
        pages = torch.tensor([free.pop() for _ in range(-(-n // page_size))], dtype=torch.int32)
        pos = torch.arange(n, dtype=torch.int32)
        req_to_token[idx, :n] = pages[pos // page_size] * page_size + pos % page_size
    req_to_token = req_to_token.to(device)
    req_pool_indices = req_pool_indices.to(device)
    slots = [req_to_token[idx, :n].long() for idx, n in zip(req_pool_indices.tolist(), seq_lens)]
    return dict(k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                keys=[k_buffer[s] for s in slots], values=[v_buffer[s] for s in slots], slots=slots,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device), device=device, g=g)


def _decode_batch(seq_lens, page_size, **kw):
    b = _pool(seq_lens, page_size, **kw)
    b["q"] = torch.randn(len(seq_lens), kw.get("hq", HQ), kw.get("d", D), generator=b["g"]).to(b["device"],
                                                                                             b["k_buffer"].dtype)
    b["q_lens"] = [1] * len(seq_lens)
    return b


def _extend_batch(q_lens, prefix_lens, page_size, **kw):
    b = _pool([q + p for q, p in zip(q_lens, prefix_lens)], page_size, **kw)
    dtype = b["k_buffer"].dtype
    b["q"] = torch.randn(sum(q_lens), kw.get("hq", HQ), kw.get("d", D), generator=b["g"]).to(b["device"], dtype)
    b["k"] = torch.cat([k[p:] for k, p in zip(b["keys"], prefix_lens)])
    b["v"] = torch.cat([v[p:] for v, p in zip(b["values"], prefix_lens)])
    b["out_cache_loc"] = torch.cat([s[p:] for s, p in zip(b["slots"], prefix_lens)])
    b["q_lens"], b["prefix_lens"] = list(q_lens), list(prefix_lens)
    return b


def _nan_like(q):
    return torch.full_like(q, float("nan"))


def _decode(b, layout, options, **scales):
    step = build_decode(layout, b["req_to_token"], b["req_pool_indices"], b["seq_lens"], b["seq_lens"].cpu())
    return step, run_decode(step, layout, options, b["q"], b["k_buffer"], b["v_buffer"], _nan_like(b["q"]), **scales)


def _extend(b, options, with_new=True, **scales):
    step = build_extend(b["req_to_token"], b["req_pool_indices"], b["q_lens"], b["prefix_lens"])
    k, v = (b["k"], b["v"]) if with_new else (None, None)
    out = run_extend(step, options, b["q"], k, v, b["k_buffer"], b["v_buffer"], _nan_like(b["q"]), **scales,
                     new_rows=b["out_cache_loc"])
    return step, out


DECODE_CASES = {"short and long": [1, 37, 300, 17], "one request": [129]}
EXTEND_CASES = {
    "prefill, no prefixes": ([17, 64, 3], [0, 0, 0]),
    "prefix hits and chunked prefill": ([40, 7, 100], [0, 70, 30]),
    "mixed: decodes as one-token extends": ([1, 33, 1], [250, 0, 8]),
    "one request": ([33], [0]),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("page_size", [16, 64, 512])
def test_decode_matches_float64(case, page_size):
    b = _decode_batch(DECODE_CASES[case], page_size)
    options = LayerOptions(D ** -0.5)
    step, out = _decode(b, PoolLayout(page_size), options)
    assert step.block_table.dtype == torch.int32 and step.seq_lens.dtype == torch.int32
    torch.testing.assert_close(out.double(), _reference(b, options), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("page_size", [16, 64])
def test_extend_matches_float64(case, page_size):
    q_lens, prefix_lens = EXTEND_CASES[case]
    b = _extend_batch(q_lens, prefix_lens, page_size)
    options = LayerOptions(D ** -0.5)
    step, out = _extend(b, options)
    assert step.num_tokens == sum(q_lens) and step.max_seqlen_q == max(q_lens)
    assert step.max_seqlen_k == max(q + p for q, p in zip(q_lens, prefix_lens))
    torch.testing.assert_close(out.double(), _reference(b, options), atol=2e-5, rtol=2e-5)


def test_extend_keys_come_from_the_step_or_the_pool():
    fresh = _extend_batch([5, 9], [0, 0], 16)
    step, _ = _extend(fresh, LayerOptions(0.2))
    assert step.k_rows is None and step.cu_seqlens_k is step.cu_seqlens_q
    cached = _extend_batch([1, 5, 9], [19, 0, 21], 16)
    step, _ = _extend(cached, LayerOptions(0.2))
    assert step.cu_seqlens_q.tolist() == [0, 1, 6, 15] and step.cu_seqlens_k.tolist() == [0, 20, 25, 55]
    assert step.k_rows.tolist() == torch.cat(cached["slots"]).tolist()


def test_an_extend_built_under_inference_mode_lets_its_layers_share_one_work_list():
    """As vLLM's: the batch's cumulative lengths carry a version counter, so the first layer's work list serves the
    others."""
    b = _extend_batch([1, 5, 9], [19, 0, 21], 16)
    with torch.inference_mode():
        step = build_extend(b["req_to_token"], b["req_pool_indices"], b["q_lens"], b["prefix_lens"])
        assert not step.cu_seqlens_q.is_inference() and not step.cu_seqlens_k.is_inference()
        assert work_list(step.cu_seqlens_k, 64) is work_list(step.cu_seqlens_k, 64)


def test_extend_without_k_and_v_reads_the_new_keys_from_the_pool():
    b = _extend_batch([6, 11], [0, 0], 16)
    options = LayerOptions(D ** -0.5)
    _, out = _extend(b, options, with_new=False)
    torch.testing.assert_close(out.double(), _reference(b, options), atol=2e-5, rtol=2e-5)


def test_block_table_is_req_to_token_every_page_size_th_slot_over_page_size():
    b = _pool([20, 50], 16)
    layout = PoolLayout(16)
    table = layout.block_table(b["req_to_token"], b["req_pool_indices"])
    assert table.shape == (2, -(-CONTEXT // 16)) == (2, layout.table_width(b["req_to_token"]))
    expected = b["req_to_token"][b["req_pool_indices"].long(), ::16] // 16
    assert table.tolist() == expected.tolist()
    assert layout.block_table(b["req_to_token"], b["req_pool_indices"], width=4).tolist() == expected[:, :4].tolist()
    pages = layout.pages(b["k_buffer"])
    assert pages.shape == (b["k_buffer"].shape[0] // 16, 16, HKV, D) and pages.data_ptr() == b["k_buffer"].data_ptr()
    with pytest.raises(ValueError, match="page_size 16"):
        layout.pages(b["k_buffer"][:-1])


def test_decode_graph_buffers_are_refilled_in_place_and_padded_requests_stay_finite():
    """As SGLang's decode graphs run them: buffers sized for max_bs, a batch padded to a captured size (padded
    requests: seq_len 1 at req_to_token row 0), `bind` before capture, `fill` recorded, then refilled for the next
    batch; the views keep their storage."""
    layout, options = PoolLayout(16), LayerOptions(D ** -0.5)
    first = _decode_batch([5, 90, 1], 16, seed=1)
    graph = DecodeGraphBuffers(layout, 8, first["req_to_token"])
    bound = graph.bind(4)
    padded_idx = torch.cat([first["req_pool_indices"], torch.zeros(1, dtype=torch.int64)])
    padded_lens = torch.cat([first["seq_lens"], torch.ones(1, dtype=torch.int64)])
    step = graph.fill(first["req_to_token"], padded_idx, padded_lens)
    assert step.block_table.data_ptr() == bound.block_table.data_ptr()
    assert step.seq_lens.data_ptr() == bound.seq_lens.data_ptr()
    q = torch.cat([first["q"], torch.randn(1, HQ, D)])
    out = run_decode(bound, layout, options, q, first["k_buffer"], first["v_buffer"], _nan_like(q))
    assert not out.isnan().any()
    torch.testing.assert_close(out[:3].double(), _reference(first, options), atol=2e-5, rtol=2e-5)
    # the next batch (a replay): other requests and lengths, read through the views bound before capture
    second = _decode_batch([7, 2, 100, 60], 16, seed=2)
    graph.fill(second["req_to_token"], second["req_pool_indices"], second["seq_lens"])
    out = run_decode(bound, layout, options, second["q"], second["k_buffer"], second["v_buffer"],
                     _nan_like(second["q"]))
    torch.testing.assert_close(out.double(), _reference(second, options), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="max_bs 8"):
        graph.bind(9)


def test_window_and_softcap():
    """SGLang's sliding_window_size W (keys q - W .. q) as window (W, 0)."""
    options = LayerOptions(D ** -0.5, window=(15, 0), softcap=5.0)
    b = _extend_batch([30, 12, 1], [0, 38, 79], 16, seed=3)
    _, out = _extend(b, options)
    torch.testing.assert_close(out.double(), _reference(b, options), atol=2e-5, rtol=2e-5)
    d = _decode_batch([80, 5], 16, seed=3)
    _, out = _decode(d, PoolLayout(16), options)
    torch.testing.assert_close(out.double(), _reference(d, options), atol=2e-5, rtol=2e-5)


def _to_e4m3(b, k_scale, v_scale):
    """The pool as SGLang's fp8_e4m3 cache holds it (x / scale); the step's new keys as the model computed them."""
    b["k_buffer"], b["v_buffer"] = (b["k_buffer"] / k_scale).to(torch.float8_e4m3fn), \
        (b["v_buffer"] / v_scale).to(torch.float8_e4m3fn)
    b["keys"] = [b["k_buffer"][s] for s in b["slots"]]
    b["values"] = [b["v_buffer"][s] for s in b["slots"]]
    if "k" in b:
        b["k"] = torch.cat([k[p:] for k, p in zip(b["keys"], b["prefix_lens"])]).float() * k_scale
        b["v"] = torch.cat([v[p:] for v, p in zip(b["values"], b["prefix_lens"])]).float() * v_scale


def test_e4m3_pool_dequantizes_with_the_layer_scales():
    scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.25]))
    options = LayerOptions(D ** -0.5)
    d = _decode_batch([40, 3, 90], 16, seed=5)
    _to_e4m3(d, 0.5, 0.25)
    _, out = _decode(d, PoolLayout(16), options, **scales)
    torch.testing.assert_close(out.double(), _reference(d, options, 0.5, 0.25), atol=1e-4, rtol=1e-4)
    e = _extend_batch([20, 6, 1], [0, 84, 12], 16, seed=5)
    _to_e4m3(e, 0.5, 0.25)
    _, out = _extend(e, options, **scales)
    torch.testing.assert_close(out.double(), _reference(e, options, 0.5, 0.25), atol=1e-4, rtol=1e-4)


def test_packed_keys():
    cu, requests, positions = packed_keys(np.array([2, 0, 3]))
    assert cu.tolist() == [0, 2, 2, 5] and cu.dtype == np.int32
    assert requests.tolist() == [0, 0, 2, 2, 2] and positions.tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 256, 512])
def test_page_sizes_the_kernels_read(page_size):
    assert page_size_refusal(page_size) is None


@pytest.mark.parametrize("page_size", [1, 8, 24, 100])
def test_other_page_sizes_are_refused_with_the_setting_to_pass(page_size):
    line = page_size_refusal(page_size)
    assert "--page-size 16" in line and f"got --page-size {page_size}" in line and "\n" not in line


def test_build_extend_refuses_counts_of_another_batch():
    b = _extend_batch([3, 4], [0, 0], 16)
    with pytest.raises(ValueError, match="one entry per request"):
        build_extend(b["req_to_token"], b["req_pool_indices"], [3, 4, 5], [0, 0, 0])


def test_register_without_sglang_logs_one_line_and_registers_nothing(monkeypatch, caplog):
    from flashmoe_science.integrations import versions

    monkeypatch.setattr(versions, "installed", lambda distribution: None)
    with caplog.at_level(logging.WARNING, logger="flashmoe_science.integrations.sglang"):
        register()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "sglang is not installed" in lines[0] and "sglang>=0.5.17,<0.6" in lines[0]
    monkeypatch.setattr(versions, "installed", lambda distribution: "0.6.1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashmoe_science.integrations.sglang"):
        register()
    assert len(caplog.records) == 1 and "installed: sglang 0.6.1" in caplog.records[0].getMessage()


def test_the_sglang_plugin_is_an_entry_point():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["sglang.srt.plugins"]
    assert plugins == {"flashmoe_science": "flashmoe_science.integrations.sglang:register"}


# ------------------------------------------------------------------ the backend on stand-ins of SGLang's classes
class _Mode:
    def __init__(self, name):
        self.name = name

    def is_idle(self):
        return self.name == "IDLE"

    def is_decode(self):
        return self.name == "DECODE"

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")

    def is_extend(self):
        return self.name in ("EXTEND", "MIXED", "TARGET_VERIFY")

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self):
        return False


class _Pool:
    """SGLang 0.5.17's MHATokenToKVPool as the backend uses it: per-layer K and V buffers, and set_kv_buffer's
    e4m3 write (it divides the given k and v by the scales in place)."""

    kv_cache_layout = "nhd"

    def __init__(self, k_buffer, v_buffer, dtype):
        self.k_buffer, self.v_buffer, self.dtype = [k_buffer], [v_buffer], dtype

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k, cache_v = cache_k.to(self.dtype), cache_v.to(self.dtype)
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]


class _Attention(torch.nn.Module):
    def __init__(self, **settings):
        super().__init__()
        self.tp_q_head_num, self.tp_k_head_num, self.qk_head_dim, self.v_head_dim = HQ, HKV, D, D
        self.layer_id, self.scaling, self.logit_cap, self.logit_capping_method = 0, D ** -0.5, 0.0, "tanh"
        self.sliding_window_size, self.is_cross_attention, self.attn_type = -1, False, "decoder"
        self.k_scale = self.v_scale = None
        self.xai_temperature_len = -1
        self.__dict__.update(settings)


@pytest.fixture
def sglang_backend(monkeypatch):
    """`integrations.sglang.backend` imported against stand-in SGLang modules (removed after the test)."""
    import importlib
    import types
    from enum import Enum

    stubs = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
        "sglang.srt.layers.attention.base_attn_backend", "sglang.srt.layers.radix_attention", "sglang.srt.mem_cache",
        "sglang.srt.mem_cache.memory_pool")}
    stubs["sglang.srt.layers.attention.base_attn_backend"].AttentionBackend = type("AttentionBackend", (), {})
    stubs["sglang.srt.layers.radix_attention"].AttentionType = Enum("AttentionType", {"DECODER": "decoder",
                                                                                      "ENCODER_ONLY": "encoder_only"})
    stubs["sglang.srt.mem_cache.memory_pool"].MHATokenToKVPool = _Pool
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "flashmoe_science.integrations.sglang.backend", raising=False)
    module = importlib.import_module("flashmoe_science.integrations.sglang.backend")
    yield module
    sys.modules.pop("flashmoe_science.integrations.sglang.backend", None)


def _runner(b, backend_module, page_size=16, pool_dtype=torch.bfloat16, **layer_settings):
    layer = _Attention(attn_type=backend_module.AttentionType.DECODER, **layer_settings)
    model = torch.nn.Sequential(layer)
    return SimpleNamespace(
        server_args=SimpleNamespace(speculative_algorithm=None, dcp_size=1, enable_deterministic_inference=False),
        page_size=page_size, use_mla_backend=False, model_config=SimpleNamespace(is_encoder_decoder=False),
        token_to_kv_pool=_Pool(b["k_buffer"], b["v_buffer"], pool_dtype), token_to_kv_pool_allocator=SimpleNamespace(),
        req_to_token_pool=SimpleNamespace(req_to_token=b["req_to_token"]), device="cpu", dtype=torch.bfloat16,
        model=model), layer


def test_backend_writes_the_new_keys_then_attends_extend_and_graph_decode(sglang_backend):
    """An extend batch with prefixes (its new keys not yet in the pool: the backend writes them), then decode
    batches through the CUDA-graph hooks (out-graph bind, in-graph fill) with a padded request."""
    e = _extend_batch([9, 1, 20], [30, 15, 0], 16, dtype=torch.bfloat16, seed=7)
    runner, layer = _runner(e, sglang_backend)
    backend = sglang_backend.FlashMoEAttnBackend(runner)
    new = e["out_cache_loc"]
    e["k_buffer"][new], e["v_buffer"][new] = 0, 0
    fb = SimpleNamespace(forward_mode=_Mode("EXTEND"), batch_size=3, req_pool_indices=e["req_pool_indices"],
                         seq_lens=e["seq_lens"], seq_lens_cpu=e["seq_lens"], extend_seq_lens_cpu=e["q_lens"],
                         extend_prefix_lens_cpu=e["prefix_lens"], out_cache_loc=new)
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(e["q"].reshape(-1, HQ * D), e["k"], e["v"], layer, fb)
    assert out.shape == (sum(e["q_lens"]), HQ * D)
    options = LayerOptions(D ** -0.5)
    torch.testing.assert_close(out.view(-1, HQ, D).double(), _reference(e, options), atol=2e-2, rtol=2e-2)
    assert torch.equal(e["k_buffer"][new], e["k"])

    d = _decode_batch([17, 60], 16, dtype=torch.bfloat16, seed=8)
    runner, layer = _runner(d, sglang_backend)
    backend = sglang_backend.FlashMoEAttnBackend(runner)
    backend.init_cuda_graph_state(4, 4)
    idx = torch.cat([d["req_pool_indices"], torch.zeros(1, dtype=torch.int64)])
    fb = SimpleNamespace(forward_mode=_Mode("DECODE"), batch_size=3, req_pool_indices=idx,
                         seq_lens=torch.cat([d["seq_lens"], torch.ones(1, dtype=torch.int64)]),
                         out_cache_loc=torch.stack([s[-1] for s in d["slots"]] + [torch.tensor(0)]))
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_in_graph(fb)
    q = torch.cat([d["q"], torch.zeros(1, HQ, D, dtype=torch.bfloat16)])
    k_new = torch.stack([k[-1] for k in d["keys"]] + [torch.zeros(HKV, D, dtype=torch.bfloat16)])
    v_new = torch.stack([v[-1] for v in d["values"]] + [torch.zeros(HKV, D, dtype=torch.bfloat16)])
    out = backend.forward_decode(q.reshape(3, -1), k_new, v_new, layer, fb)
    torch.testing.assert_close(out[:2].view(-1, HQ, D).double(), _reference(d, options), atol=2e-2, rtol=2e-2)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(SimpleNamespace(forward_mode=_Mode("TARGET_VERIFY"), batch_size=2))
    with pytest.raises(NotImplementedError, match="decode CUDA graphs only"):
        backend.init_forward_metadata_out_graph(SimpleNamespace(forward_mode=_Mode("EXTEND"), batch_size=2))


def test_backend_exposes_its_pools_for_models_whose_rope_writes_the_keys(sglang_backend):
    """SGLang's Qwen3 models read the pool through the backend (forward_context.get_token_to_kv_pool), write the new
    keys into it with their rope, then call attention with save_kv_cache=False: the backend attends to them there."""
    e = _extend_batch([9, 1, 20], [30, 15, 0], 16, dtype=torch.bfloat16, seed=11)
    runner, layer = _runner(e, sglang_backend)
    backend = sglang_backend.FlashMoEAttnBackend(runner)
    assert backend.token_to_kv_pool is runner.token_to_kv_pool
    assert backend.req_to_token_pool is runner.req_to_token_pool
    new = e["out_cache_loc"]
    e["k_buffer"][new], e["v_buffer"][new] = e["k"], e["v"]  # the rope's fused write
    fb = SimpleNamespace(forward_mode=_Mode("EXTEND"), batch_size=3, req_pool_indices=e["req_pool_indices"],
                         seq_lens=e["seq_lens"], seq_lens_cpu=e["seq_lens"], extend_seq_lens_cpu=e["q_lens"],
                         extend_prefix_lens_cpu=e["prefix_lens"], out_cache_loc=new)
    backend.init_forward_metadata(fb)
    written = runner.token_to_kv_pool.set_kv_buffer
    runner.token_to_kv_pool.set_kv_buffer = None  # not called
    out = backend.forward_extend(e["q"].reshape(-1, HQ * D), e["k"], e["v"], layer, fb, save_kv_cache=False)
    runner.token_to_kv_pool.set_kv_buffer = written
    torch.testing.assert_close(out.view(-1, HQ, D).double(), _reference(e, LayerOptions(D ** -0.5)), atol=2e-2,
                               rtol=2e-2)


def test_backend_on_an_e4m3_pool_keeps_the_models_keys(sglang_backend):
    """SGLang's pool divides the keys it is given by the scales in place: the backend gives it copies in extend,
    whose fresh keys it attends to afterwards."""
    e = _extend_batch([12, 5], [0, 0], 16, dtype=torch.bfloat16, seed=9)
    e["k_buffer"], e["v_buffer"] = (e["k_buffer"].to(torch.float8_e4m3fn), e["v_buffer"].to(torch.float8_e4m3fn))
    runner, layer = _runner(e, sglang_backend, pool_dtype=torch.float8_e4m3fn, k_scale=torch.tensor(0.5),
                            v_scale=torch.tensor(0.25))
    backend = sglang_backend.FlashMoEAttnBackend(runner)
    k, v = e["k"].clone(), e["v"].clone()
    fb = SimpleNamespace(forward_mode=_Mode("EXTEND"), batch_size=2, req_pool_indices=e["req_pool_indices"],
                         seq_lens=e["seq_lens"], seq_lens_cpu=e["seq_lens"], extend_seq_lens_cpu=e["q_lens"],
                         extend_prefix_lens_cpu=e["prefix_lens"], out_cache_loc=e["out_cache_loc"])
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(e["q"].reshape(-1, HQ * D), k, v, layer, fb)
    assert torch.equal(k, e["k"]) and torch.equal(v, e["v"])
    torch.testing.assert_close(out.view(-1, HQ, D).double(), _reference(e, LayerOptions(D ** -0.5)), atol=2e-2,
                               rtol=2e-2)
    stored = e["k_buffer"][e["out_cache_loc"]].float() * 0.5
    torch.testing.assert_close(stored, e["k"].float(), atol=0.07, rtol=0.07)


@pytest.mark.parametrize("change, named", [
    (dict(page_size=1), "pass --page-size 16"),
    (dict(use_mla_backend=True), "MLA models"),
    (dict(server_args=SimpleNamespace(speculative_algorithm="EAGLE", dcp_size=1)), "--speculative-algorithm EAGLE"),
    (dict(dtype=torch.float32), "--dtype must be bfloat16 or float16"),
    (dict(layer=dict(logit_capping_method="other", logit_cap=30.0)), "logit capping 'other'"),
    (dict(layer=dict(v_head_dim=64)), "head sizes must be equal"),
])
def test_backend_refuses_at_construction_naming_the_setting(sglang_backend, change, named):
    b = _pool([20], 16, dtype=torch.bfloat16)
    change = dict(change)
    runner, _ = _runner(b, sglang_backend, **change.pop("layer", {}))
    runner.__dict__.update(change)
    with pytest.raises(ValueError, match=f"--attention-backend flashmoe: .*{re.escape(named)}"):
        sglang_backend.FlashMoEAttnBackend(runner)


def test_backend_maps_sglangs_window_and_softcap(sglang_backend):
    layer = _Attention(sliding_window_size=4095, logit_cap=30.0)
    assert sglang_backend._options(layer) == LayerOptions(D ** -0.5, (4095, 0), 30.0)
    assert sglang_backend._options(_Attention()) == LayerOptions(D ** -0.5)


GPU_DECODE = {"decode 1..32k": [1, 2, 100, 1000, 8191, 32768]}
GPU_EXTEND = {
    "ragged extend with prefixes": ([1, 513, 64, 1000, 7], [4000, 0, 1000, 2000, 2048]),
    "prefill, no prefixes": ([300, 1024, 77, 2048], [0, 0, 0, 0]),
}


def _within_twice_torchs_error(b, out, options, ks=1.0, vs=1.0):
    ref = _reference(b, options, ks, vs)
    torch_error = (_reference(b, options, ks, vs, dtype=torch.bfloat16).double() - ref).abs().max().item()
    error = (out.double() - ref).abs().max().item()
    assert not out.isnan().any()
    assert error <= 2 * torch_error + 2e-3, (error, torch_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(GPU_DECODE) + list(GPU_EXTEND))
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 1, 256)])
@pytest.mark.parametrize("fp8", [False, True])
def test_batches_on_gpu_within_twice_torchs_error(case, page_size, heads, fp8):
    hq, hkv, d = heads
    shape = dict(dtype=torch.bfloat16, seed=11, device="cuda", hq=hq, hkv=hkv, d=d)
    b = (_decode_batch(GPU_DECODE[case], page_size, **shape) if case in GPU_DECODE
         else _extend_batch(*GPU_EXTEND[case], page_size, **shape))
    scales, ks, vs = {}, 1.0, 1.0
    if fp8:
        ks, vs = 0.5, 0.75
        scales = dict(k_scale=torch.tensor([ks], device="cuda"), v_scale=torch.tensor([vs], device="cuda"))
        _to_e4m3(b, ks, vs)
        if "k" in b:
            b["k"], b["v"] = b["k"].to(torch.bfloat16), b["v"].to(torch.bfloat16)
    options = LayerOptions(d ** -0.5)
    _, out = (_decode(b, PoolLayout(page_size), options, **scales) if case in GPU_DECODE
              else _extend(b, options, **scales))
    _within_twice_torchs_error(b, out, options, ks, vs)
