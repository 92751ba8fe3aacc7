"""FlashAttention-4 as a peer of `flashmoe-science bench`: skipped where `flash_attn.cute` does not import, and, where
it does, measured into records with the same fields as ours. On the CPU a stand-in `flash_attn.cute` (float64 SDPA
in FA4's (B, L, H, D) layout) takes its place; the real one runs in the GPU benchmark."""

import io
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench import report
from flashmoe_science.bench.attention import AttentionShape


def _fake_fa4(monkeypatch) -> list[tuple]:
    """Install a stand-in flash_attn.cute whose flash_attn_func checks FA4's layout and returns (out, lse)."""
    calls = []

    def flash_attn_func(q, k, v, causal=False):
        calls.append((tuple(q.shape), q.stride(-1), causal))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
        return out, None

    package = types.ModuleType("flash_attn")
    package.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
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
