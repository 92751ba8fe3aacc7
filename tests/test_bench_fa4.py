"""FlashAttention-4 as a peer of `flashmoe-science bench` (the dense `fa4` backend, the varlen suite's `fa4-varlen`):
skipped where `flash_attn.cute` does not import or the GPU is not sm_90/sm_100, and, where it runs, measured into
records with the same fields as ours. On the CPU a stand-in `flash_attn.cute` (SDPA in FA4's (B, L, H, D) and packed
(total, H, D) layouts) takes its place; the real one runs in the GPU benchmark."""

import importlib.util
import io
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench import features, report
from flashmoe_science.bench.attention import AttentionShape


def _fake_fa4(monkeypatch) -> list[tuple]:
    """Install a stand-in flash_attn.cute whose flash_attn_func checks FA4's layout and returns (out, lse)."""
    calls = []

    def flash_attn_func(q, k, v, causal=False):
        calls.append((tuple(q.shape), q.stride(-1), causal))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
        return out, None

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, causal=False):
        calls.append((tuple(q.shape), cu_seqlens_q.dtype, max_seqlen_q, causal))
        assert qv is None and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(bounds, bounds[1:])) and bounds[-1] == q.shape[0]
        out = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                        is_causal=causal).transpose(0, 1)
                         for a, b in zip(bounds, bounds[1:])])
        return out, None

    package = types.ModuleType("flash_attn")
    package.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


def test_fa4_is_skipped_without_flash_attn_cute(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    reason = attention_bench.BACKENDS["fa4"].skip_reason(AttentionShape(1, 2, 64, 64, 64, causal=False))
    assert "does not import" in reason


def test_fa4_skips_head_dims_its_kernels_do_not_take(monkeypatch):
    _fake_fa4(monkeypatch)
    skip = attention_bench.BACKENDS["fa4"].skip_reason
    assert skip(AttentionShape(1, 2, 64, 64, 128, causal=True)) is None
    assert "multiples of 8" in skip(AttentionShape(1, 2, 64, 64, 60, causal=False))
    assert "multiples of 8" in skip(AttentionShape(1, 2, 64, 64, 512, causal=False))


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_records_have_our_fields_and_its_output_is_exact(monkeypatch, causal):
    calls = _fake_fa4(monkeypatch)
    shape = AttentionShape(2, 3, 48, 48, 16, causal=causal)
    q, k, v = (torch.randn(2, 3, 48, 16, dtype=torch.float64) for _ in range(3))
    out = attention_bench.BACKENDS["fa4"].prepare(shape, torch.device("cpu"))(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    assert calls[-1] == ((2, 48, 3, 16), 1, causal)  # FA4's (B, L, H, D), head dim contiguous, no copy

    progress = report.Progress(stream=io.StringIO())
    records = attention_bench.run_attention_bench(
        [shape], ["fa4", "flashmoe"], ["fwd", "bwd"], torch.device("cpu"), torch.float32,
        attention_bench.cpu_median_ms, progress)
    by_backend = {(r["backend"], r["pass"]): r for r in records}
    assert set(by_backend) == {("fa4", "fwd"), ("fa4", "bwd"), ("flashmoe", "fwd"), ("flashmoe", "bwd")}
    ours, peer = by_backend[("flashmoe", "bwd")], by_backend[("fa4", "bwd")]
    assert set(peer) == set(ours) - {"kernel"} or set(peer) == set(ours)
    assert peer["tflops"] > 0 and peer["dtype"] == ours["dtype"]


def test_fa4_is_skipped_on_gpus_other_than_sm90_and_sm100(monkeypatch):
    _fake_fa4(monkeypatch)
    from flashmoe_science.device import DeviceTraits

    monkeypatch.setattr(attention_bench, "current_traits", lambda: DeviceTraits((8, 0), 108, 166912))
    assert "not sm_80" in attention_bench.fa4_skip_reason(128)
    monkeypatch.setattr(attention_bench, "current_traits", lambda: DeviceTraits((9, 0), 132, 232448))
    assert attention_bench.fa4_skip_reason(128) is None


def _varlen_cases(quick: bool):
    return [case for case in features.feature_cases(["varlen"], quick, torch.device("cpu"), torch.float64)
            if not case.name.startswith("HF padded")]


def _quick_varlen_run(monkeypatch) -> list[dict]:
    """`bench --suite varlen --quick` on the CPU with a batch of three sequences (ours loops over sequences on the
    CPU) and each pass timed once: the records and the warnings, not the speed, are under test."""
    monkeypatch.setitem(features.VARLEN_DISTRIBUTIONS, "long tail", lambda shrink: [5, 2, 9])

    def one_call_ms(fn, grad_to_none=None):
        started = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - started)

    return features.run_features_bench(["varlen"], True, torch.device("cpu"), torch.float32, one_call_ms)


@pytest.mark.parametrize("package, peer, module", [("flash_attn", "fa4-varlen", "flash_attn.cute"),
                                                    ("vllm", "fa3-varlen", "vllm.vllm_flash_attn")])
def test_a_varlen_peer_is_skipped_cleanly_where_it_does_not_import(monkeypatch, package, peer, module):
    """FlashAttention-4 without `flash_attn.cute`, vLLM's FlashAttention-3 without `vllm` (tests/test_bench_fa3.py)."""
    monkeypatch.setitem(sys.modules, package, None)
    cases = _varlen_cases(quick=False)
    assert len(cases) == 2 * len(features.VARLEN_DISTRIBUTIONS)
    for case in cases:
        assert peer not in case.contenders and "does not import" in case.skipped[peer]
    with pytest.warns(UserWarning, match=f"{peer} not run: {module}") as caught:
        records = _quick_varlen_run(monkeypatch)
    assert sum(peer in str(w.message) for w in caught) == 1  # once per reason, not per case and pass
    assert records and all(r["backend"] != peer for r in records)
    assert ("flashmoe-varlen", peer) not in features.measured_ratios("varlen", records)


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_varlen_matches_a_float64_reference_per_sequence(monkeypatch, causal):
    """The contender hands FA4 our packed tensors and int32 cumulative lengths as they are; its output and gradients
    equal ours (`flashmoe-varlen`, the float64 reference on the CPU) and SDPA per sequence."""
    calls = _fake_fa4(monkeypatch)
    case = next(c for c in _varlen_cases(quick=True) if c.name.endswith(", causal") == causal)
    q, k, v = case.contenders["fa4-varlen"].make_inputs()
    dout = torch.randn_like(q)
    results = {}
    for name in ("fa4-varlen", "flashmoe-varlen"):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = case.contenders[name].attend(*inputs)
        out.backward(dout)
        results[name] = [out, *(t.grad for t in inputs)]
    for ours, theirs in zip(results["flashmoe-varlen"], results["fa4-varlen"]):
        torch.testing.assert_close(theirs, ours)
    shape, cu_dtype, longest, called_causal = calls[-1]
    lengths = features.VARLEN_DISTRIBUTIONS["long tail"](features.CPU_SHRINK)
    assert shape == tuple(q.shape) == (sum(lengths), features.HEADS, features.HEAD_DIM)  # packed, as ours, no copy
    assert (cu_dtype, longest, called_causal) == (torch.int32, max(lengths), causal)


def test_fa4_varlen_records_have_the_suites_fields_and_its_ratio_column(monkeypatch):
    _fake_fa4(monkeypatch)
    records = _quick_varlen_run(monkeypatch)
    peer = {(r["case"], r["pass"]): r for r in records if r["backend"] == "fa4-varlen"}
    ours = {(r["case"], r["pass"]): r for r in records if r["backend"] == "flashmoe-varlen"}
    assert set(peer) == set(ours) and {p for _, p in peer} == {"fwd", "bwd"} and len(peer) == 4
    for key, record in peer.items():
        assert set(record) == set(ours[key]) and record["flops"] == ours[key]["flops"] and record["tflops"] > 0
    assert features.measured_ratios("varlen", records)[0] == ("flashmoe-varlen", "fa4-varlen")
    assert "varlen/fa4-varlen" in features.features_tables(records)


def test_the_varlen_suite_has_the_ragged_and_packed_batches_fa4_is_measured_on():
    """On a GPU (no shrink): the long tail at its seed is 49 sequences of 64..1626 tokens, the packed batch one
    8192-token document and 30 shorter ones, 16384 tokens each; both causal and not, H=16, D=128."""
    ragged = features.VARLEN_DISTRIBUTIONS["long tail"](1)
    packed = features.VARLEN_DISTRIBUTIONS["packed documents"](1)
    assert (len(ragged), min(ragged), max(ragged), sum(ragged)) == (49, 64, 1626, 16384)
    assert (len(packed), max(packed), sum(packed)) == (31, 8192, 16384)
    assert (features.HEADS, features.HEAD_DIM) == (16, 128)
    names = [case.name for case in features.feature_cases(["varlen"], False, torch.device("cpu"), torch.float32)]
    for distribution in ("long tail", "packed documents"):
        assert sum(name.startswith(f"{distribution}:") for name in names) == 2  # causal and not


def test_without_transformers_the_packed_batches_run_and_the_padded_batch_says_why_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else real_find_spec(name, *args))
    with pytest.warns(UserWarning, match="padded Hugging Face batch not run: transformers is not installed"):
        records = _quick_varlen_run(monkeypatch)
    assert {r["backend"] for r in records} == {"flashmoe-varlen", "flashmoe-dense"}
