"""vLLM's FlashAttention-3 build as a peer of `flashmoe-science bench` (the dense `fa3` backend, the varlen suite's
`fa3-varlen`, the decode suite's `fa3-paged64` and `fa3-chunk-paged64`): skipped with its reason where
`vllm.vllm_flash_attn` does not import, has no FA3 library or the GPU is not sm_90; where it runs, forward only, with
the records and FLOP counts of ours. On the CPU a stand-in `vllm.vllm_flash_attn` (a float64-exact reference that
checks FA3's argument contract: token-major packed tensors, int32 cumulative lengths, paged pools with seqused_k and a
block table) takes its place; the GPU test at the end compares the real one with ours."""

import importlib.metadata
import io
import sys
import types

import pytest
import torch

from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench import decode as decode_bench
from flashmoe_science.bench import features, report
from flashmoe_science.bench.attention import AttentionShape
from test_bench_fa4 import _quick_varlen_run, _varlen_cases  # the varlen suite's CPU harness, shared with fa4's


def _reference(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """One sequence, (L, H, D) layout: attention with grouped KV heads and a bottom-right causal mask."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _fake_fa3(monkeypatch, fa3_available: bool = True) -> list[dict]:
    """Install a stand-in vllm.vllm_flash_attn whose flash_attn_varlen_func checks FA3's contract and computes the
    attention per sequence; returns the calls' arguments."""
    calls = []

    def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                               cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                               causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0, pack_gqa=None,
                               sm_margin=0):
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch_size,)
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch_size + 1,)
        metadata = torch.zeros(1 + 4 * batch_size, dtype=torch.int32)
        calls.append({"metadata": metadata, "page_size": page_size, "num_splits": num_splits, "causal": causal,
                      "heads": (num_heads_q, num_heads_kv, headdim), "max_seqlen_q": max_seqlen_q})
        return metadata

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                               softmax_scale=None, causal=False, block_table=None, scheduler_metadata=None,
                               num_splits=0, fa_version=2):
        assert fa_version == 3 and q.dim() == 3 and all(t.stride(-1) == 1 for t in (q, k, v))
        assert (cu_seqlens_k is None) != (seqused_k is None) and (block_table is None or seqused_k is not None)
        assert cu_seqlens_q.dtype == torch.int32
        q_bounds = cu_seqlens_q.tolist()
        assert q_bounds[-1] == q.shape[0] and max_seqlen_q == max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
        if block_table is None:
            k_bounds = cu_seqlens_k.tolist()
            assert cu_seqlens_k.dtype == torch.int32 and k_bounds[-1] == k.shape[0]
            keys = [(k[a:b], v[a:b]) for a, b in zip(k_bounds, k_bounds[1:])]
        else:
            assert k.dim() == 4 and block_table.dtype == seqused_k.dtype == torch.int32
            keys = [(k[blocks].flatten(0, 1)[:n], v[blocks].flatten(0, 1)[:n])
                    for blocks, n in zip(block_table.long(), seqused_k.tolist())]
        assert max_seqlen_k == max(kk.shape[0] for kk, _ in keys)
        if scheduler_metadata is not None:
            assert any(c.get("metadata") is scheduler_metadata and c["num_splits"] == num_splits for c in calls)
        calls.append({"q": (tuple(q.shape), q.data_ptr()), "k": tuple(k.shape), "cu_seqlens_q": q_bounds,
                      "max_seqlen": (max_seqlen_q, max_seqlen_k), "causal": causal, "scale": softmax_scale,
                      "paged": block_table is not None, "num_splits": num_splits})
        return torch.cat([_reference(q[a:b], kk, vv, causal, softmax_scale)
                          for (a, b), (kk, vv) in zip(zip(q_bounds, q_bounds[1:]), keys)])

    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    package = types.ModuleType("vllm.vllm_flash_attn")
    package.__path__ = []
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.FA3_AVAILABLE = fa3_available
    interface.FA3_UNAVAILABLE_REASON = None if fa3_available else "libcudart.so.13: cannot open shared object file"
    for module in (package, interface):
        module.flash_attn_varlen_func = flash_attn_varlen_func
        module.get_scheduler_metadata = get_scheduler_metadata
    package.flash_attn_interface = interface
    vllm.vllm_flash_attn = package
    for name, module in (("vllm", vllm), ("vllm.vllm_flash_attn", package),
                         ("vllm.vllm_flash_attn.flash_attn_interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _calls_to(calls: list[dict]) -> list[dict]:
    return [call for call in calls if "q" in call]


# --------------------------------------------------------------------------------------------------------------------
# where it is skipped
# --------------------------------------------------------------------------------------------------------------------
def test_fa3_is_skipped_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    reason = attention_bench.BACKENDS["fa3"].skip_reason(AttentionShape(1, 2, 64, 64, 64, causal=False))
    assert "vllm.vllm_flash_attn (vLLM's FlashAttention-3) does not import" in reason
    assert "vllm" not in report.peer_versions()


def test_fa3_is_skipped_where_vllm_has_no_fa3_library(monkeypatch):
    _fake_fa3(monkeypatch, fa3_available=False)
    reason = attention_bench.fa3_skip_reason(128)
    assert "no FlashAttention-3 library" in reason and "libcudart" in reason
    assert "vllm" not in report.peer_versions()


def test_fa3_is_skipped_off_hopper_and_at_head_dims_it_does_not_take(monkeypatch):
    _fake_fa3(monkeypatch)
    from flashmoe_science.device import DeviceTraits

    monkeypatch.setattr(attention_bench, "current_traits", lambda: DeviceTraits((10, 0), 148, 232448))
    assert "compute capability 9.x, not sm_100" in attention_bench.fa3_skip_reason(128)
    monkeypatch.setattr(attention_bench, "current_traits", lambda: DeviceTraits((9, 0), 132, 232448))
    assert attention_bench.fa3_skip_reason(128) is None
    assert "multiples of 8" in attention_bench.fa3_skip_reason(60)
    assert "multiples of 8" in attention_bench.fa3_skip_reason(512)


def _installed_vllm(monkeypatch, version: str) -> None:
    """importlib.metadata sees vLLM `version` installed (and the rest as they are)."""
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: version if name == "vllm" else real_version(name))


def test_peer_versions_report_vllm_where_its_fa3_imports(monkeypatch):
    _installed_vllm(monkeypatch, "0.26.0")
    _fake_fa3(monkeypatch)
    assert report.peer_versions()["vllm"] == "0.26.0"
    _fake_fa3(monkeypatch, fa3_available=False)
    assert "vllm" not in report.peer_versions()


# --------------------------------------------------------------------------------------------------------------------
# the dense backend
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [AttentionShape(2, 3, 48, 48, 16, causal=False),
                                   AttentionShape(2, 3, 48, 48, 16, causal=True),
                                   AttentionShape(2, 4, 24, 40, 16, causal=True, Hkv=2)], ids=str)
def test_fa3_dense_calls_its_varlen_entry_with_equal_lengths_and_is_exact(monkeypatch, shape):
    calls = _fake_fa3(monkeypatch)
    q = torch.randn(shape.B, shape.H, shape.Lq, shape.D, dtype=torch.float64)
    k, v = (torch.randn(shape.B, shape.Hkv, shape.Lk, shape.D, dtype=torch.float64) for _ in range(2))
    attend = attention_bench.BACKENDS["fa3"].prepare(shape, torch.device("cpu"))
    out = attend(q, k, v)
    expected = torch.stack([_reference(*(t[b].transpose(0, 1) for t in (q, k, v)), shape.causal, shape.D ** -0.5)
                            for b in range(shape.B)]).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert out.shape == q.shape
    first = _calls_to(calls)[-1]
    assert first["q"][0] == (shape.B * shape.Lq, shape.H, shape.D) and first["k"] == (shape.B * shape.Lk, shape.Hkv,
                                                                                     shape.D)
    assert first["cu_seqlens_q"] == [b * shape.Lq for b in range(shape.B + 1)]
    assert first["max_seqlen"] == (shape.Lq, shape.Lk) and first["causal"] == shape.causal
    assert first["scale"] == shape.D ** -0.5 and not first["paged"]
    attend(q, k, v)  # the timed calls: the token-major copies are the first call's, not made again
    assert _calls_to(calls)[-1]["q"][1] == first["q"][1]


def test_fa3_records_have_our_fields_and_flops_and_its_backward_is_not_measured(monkeypatch):
    _fake_fa3(monkeypatch)
    shape = AttentionShape(2, 3, 48, 48, 16, causal=True)
    skips = attention_bench.SkipLog()
    records = attention_bench.run_attention_bench(
        [shape], ["fa3", "flashmoe"], ["fwd", "bwd"], torch.device("cpu"), torch.float32,
        attention_bench.cpu_median_ms, report.Progress(stream=io.StringIO()), skips)
    by_backend = {(r["backend"], r["pass"]): r for r in records}
    assert set(by_backend) == {("fa3", "fwd"), ("flashmoe", "fwd"), ("flashmoe", "bwd")}
    ours, peer = by_backend[("flashmoe", "fwd")], by_backend[("fa3", "fwd")]
    assert set(peer) == set(ours) - {"kernel"} or set(peer) == set(ours)
    assert peer["dtype"] == ours["dtype"] and peer["tflops"] > 0
    flops = attention_bench.attention_flops(shape, "fwd")
    for record in (ours, peer):  # the same FLOPs credited: tflops = flops / ms, to the records' 4 digits
        assert record["tflops"] == pytest.approx(flops / (record["ms"] * 1e9), rel=2e-3)
    assert skips.entries[("fa3", "bwd")] == [1, attention_bench.VLLM_FA3_FORWARD_ONLY]
    assert "ours/fa3" in attention_bench.attention_table(records, attention_bench.GPU_BASELINES)


def test_fa3_is_a_backend_and_a_baseline_of_the_gpu_run():
    assert "fa3" in attention_bench.BACKEND_ORDER and "fa3" in attention_bench.GPU_BASELINES
    assert "fa3" not in attention_bench.CPU_BACKENDS


# --------------------------------------------------------------------------------------------------------------------
# the varlen suite
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_varlen_takes_our_packed_tensors_as_they_are_and_matches_ours(monkeypatch, causal):
    calls = _fake_fa3(monkeypatch)
    case = next(c for c in _varlen_cases(quick=True) if c.name.endswith(", causal") == causal)
    q, k, v = case.contenders["fa3-varlen"].make_inputs()
    out = case.contenders["fa3-varlen"].attend(q, k, v)
    torch.testing.assert_close(out, case.contenders["flashmoe-varlen"].attend(q, k, v))
    call = _calls_to(calls)[-1]
    lengths = features.VARLEN_DISTRIBUTIONS["long tail"](features.CPU_SHRINK)
    assert call["q"] == (tuple(q.shape), q.data_ptr())  # packed (total, H, D) as ours, no copy
    assert call["max_seqlen"] == (max(lengths), max(lengths)) and call["causal"] == causal
    assert case.contenders["fa3-varlen"].passes == ("fwd",)


def test_fa3_varlen_records_are_forward_only_with_our_flops_and_its_ratio_column(monkeypatch):
    _fake_fa3(monkeypatch)
    with pytest.warns(UserWarning, match="fa3-varlen backward not run: vLLM's FlashAttention-3 build is forward-only"):
        records = _quick_varlen_run(monkeypatch)
    peer = {(r["case"], r["pass"]): r for r in records if r["backend"] == "fa3-varlen"}
    ours = {(r["case"], r["pass"]): r for r in records if r["backend"] == "flashmoe-varlen"}
    assert {p for _, p in peer} == {"fwd"} and len(peer) == 2
    for key, record in peer.items():
        assert set(record) == set(ours[key]) and record["flops"] == ours[key]["flops"] and record["tflops"] > 0
    assert ("flashmoe-varlen", "fa3-varlen") in features.measured_ratios("varlen", records)
    assert "varlen/fa3-varlen" in features.features_tables(records)


# --------------------------------------------------------------------------------------------------------------------
# the decode suite
# --------------------------------------------------------------------------------------------------------------------
def test_fa3_paged_decode_reads_our_pool_and_matches_ours(monkeypatch):
    calls = _fake_fa3(monkeypatch)
    torch.manual_seed(0)
    contenders = decode_bench._contenders(2, 256, torch.device("cpu"), torch.float32, on_gpu=False, fa3=True)
    torch.testing.assert_close(contenders["fa3-paged64"](), contenders["flashmoe-paged64"](), atol=1e-5, rtol=1e-5)
    schedule, call = calls[0], _calls_to(calls)[-1]
    assert schedule["page_size"] == decode_bench.PAGE and schedule["num_splits"] == decode_bench.FA3_DECODE_SPLITS
    assert schedule["heads"] == (decode_bench.HQ, decode_bench.HKV, decode_bench.HEAD_DIM)
    assert call["paged"] and call["k"] == (2 * 256 // decode_bench.PAGE, decode_bench.PAGE, decode_bench.HKV,
                                           decode_bench.HEAD_DIM)
    assert call["q"][0] == (2, decode_bench.HQ, decode_bench.HEAD_DIM) and call["max_seqlen"] == (1, 256)


def test_fa3_chunk_attends_the_same_pairs_as_ours(monkeypatch):
    calls = _fake_fa3(monkeypatch)
    contenders = decode_bench._chunk_contenders(5, 128, "cpu", torch.float32, fa3=True)
    dense = contenders["flashmoe-dense"]().transpose(1, 2)
    torch.testing.assert_close(contenders["fa3-chunk-paged64"](), dense, atol=1e-5, rtol=1e-5)
    assert _calls_to(calls)[-1]["max_seqlen"] == (5, 128) and calls[0]["num_splits"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the harness at its CPU sizes")
def test_fa3_decode_records_count_the_bytes_ours_do(monkeypatch):
    _fake_fa3(monkeypatch)
    skips = []
    records = decode_bench.run_decode_bench(report.Progress(stream=io.StringIO()), skips,
                                            decode_bench.CPU_CONTEXTS[:1])
    by_backend = {r["backend"]: r for r in records}
    assert not skips and "fa3-paged64" in by_backend
    ours, peer = by_backend["flashmoe-paged64"], by_backend["fa3-paged64"]
    assert set(peer) == set(ours) and peer["layout"] == "paged64" and peer["kv_dtype"] == ours["kv_dtype"]
    assert peer["tbps"] * peer["ms"] == pytest.approx(ours["tbps"] * ours["ms"], rel=2e-3)  # the same bytes
    assert "paged/fa3" in decode_bench.decode_table(records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the harness at its CPU sizes")
def test_decode_without_vllm_says_why_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    skips = []
    records = decode_bench.run_decode_bench(report.Progress(stream=io.StringIO()), skips,
                                            decode_bench.CPU_CONTEXTS[:1])
    assert all(r["backend"] != "fa3-paged64" for r in records)
    assert len(skips) == 1 and skips[0].startswith("fa3 (vLLM's FlashAttention-3): vllm.vllm_flash_attn")
    decode_bench.fa3_missing_line(skips)  # the chunk table asks again: no second line
    assert len(skips) == 1


def test_chunk_table_shows_ours_on_the_paged_pool_against_fa3():
    rows = [dict(op="prefill_chunk", Lq=128, L=4096, backend=name, tflops=tflops) for name, tflops in
            (("flashmoe-chunk", 300.0), ("flashmoe-chunk-paged64", 280.0), ("fa3-chunk-paged64", 350.0),
             ("flashmoe-dense", 400.0), ("sdpa-cudnn", 250.0))]
    table = decode_bench.chunk_table(rows)
    assert "paged/fa3" in table.splitlines()[0] and table.splitlines()[-1].split()[-3:] == ["0.8", "0.75", "1.20"]


# --------------------------------------------------------------------------------------------------------------------
# the real one, on a GPU
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_agrees_with_ours_on_an_h100(causal):
    """vLLM's FlashAttention-3 (dense through its varlen entry, and paged decode) against ours, bf16."""
    reason = attention_bench.fa3_skip_reason(128)
    if reason is not None:
        pytest.skip(reason)
    from flashmoe_science import flash_attention_decode, flash_attention_science

    torch.manual_seed(0)
    device = torch.device("cuda")
    shape = AttentionShape(2, 8, 512, 512, 128, causal=causal, Hkv=2)
    q = torch.randn(shape.B, shape.H, shape.Lq, shape.D, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(shape.B, shape.Hkv, shape.Lk, shape.D, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    out = attention_bench.BACKENDS["fa3"].prepare(shape, device)(q, k, v)
    ours = flash_attention_science(q, k, v, causal=causal)
    torch.testing.assert_close(out.float(), ours.float(), atol=2e-2, rtol=2e-2)

    batch, length, hq, hkv, dim = 3, 1024, 16, 4, 128
    q = torch.randn(batch, 1, hq, dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, hkv, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    k_pool, v_pool, table = decode_bench._paged_copy(k, v)
    seqlens = torch.tensor([length, length - 100, 37], dtype=torch.int32, device=device)
    theirs = decode_bench.fa3_paged(q, k_pool, v_pool, seqlens, table, length, decode_bench.FA3_DECODE_SPLITS)()
    ours = flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table)
    torch.testing.assert_close(theirs.float(), ours.float(), atol=2e-2, rtol=2e-2)
