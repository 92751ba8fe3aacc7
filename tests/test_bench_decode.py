"""The decode benchmark's harness on the CPU (the command refuses: its figures are GPU bandwidth), and the decode
table's arithmetic (a few seconds)."""

import io
import sys

import pytest
import torch

from flashmoe_science import cli
from flashmoe_science.bench import decode as decode_bench
from flashmoe_science.bench.report import Progress


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_decode_command_needs_a_gpu(tmp_path, capsys):
    assert cli.main(["bench", "--suite", "decode", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "needs a CUDA GPU" in captured.err and captured.out == "" and not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the harness at its CPU sizes")
def test_decode_harness_records_on_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # the FA3 peer, absent: one line says so (tests/test_bench_fa3.py)
    skips = []
    records = decode_bench.run_decode_bench(Progress(stream=io.StringIO()), skips, decode_bench.CPU_CONTEXTS[:1])
    assert {r["backend"] for r in records} == {"flashmoe", "flashmoe-paged64", "sdpa-math"}
    assert [line.split(":")[0] for line in skips] == ["fa3 (vLLM's FlashAttention-3)"]
    for record in records:
        assert record["op"] == "decode" and record["B"] == 1 and record["L"] == decode_bench.CPU_CONTEXTS[0]
        assert record["ms"] > 0 and record["tbps"] > 0 and record["of_read"] is None  # no read kernel on the CPU
    assert "ours/best-torch" in decode_bench.decode_table(records)


def test_decode_cases_cover_batch_one_and_256k_tokens():
    assert decode_bench.decode_cases((8192, 1 << 20)) == [(1, 8192), (32, 8192), (1, 1 << 20)]
    assert decode_bench.decode_cases((8192,), batched=False) == [(1, 8192)]


def test_decode_table_ratios():
    rows = [dict(B=1, L=32768, backend=name, tbps=tbps) for name, tbps in
            (("flashmoe", 3.0), ("flashmoe-paged64", 2.0), ("read", 4.0), ("sdpa-cudnn", 2.5), ("flex", 0.1))]
    table = decode_bench.decode_table(rows)
    last = table.splitlines()[-1].split()
    assert last[-3:] == ["0.75", "0.698", "1.20"]  # ours/read, ours/4.3 TB/s, best of ours / best of torch


def test_suite_flag_matches_the_positional_name():
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "--suite", "decode"]).suite == ["decode"]
    assert parser.parse_args(["bench", "decode"]).what == "decode"


def test_chunk_table_ratios():
    rows = [dict(op="prefill_chunk", Lq=128, L=4096, backend=name, tflops=tflops) for name, tflops in
            (("flashmoe-chunk", 300.0), ("flashmoe-dense", 400.0), ("sdpa-cudnn", 250.0), ("sdpa-efficient", 100.0))]
    last = decode_bench.chunk_table(rows).splitlines()[-1].split()
    assert last[-2:] == ["0.75", "1.20"]  # ours / our dense forward, ours / the best SDPA


def test_chunk_contenders_compute_the_same_attention():
    """The chunk rows time the same work: ours (contiguous and paged, appending the chunk) and the dense call over
    the whole cache give one output (the reference, on the CPU)."""
    calls = decode_bench._chunk_contenders(5, 128, "cpu", torch.float32)
    dense = calls["flashmoe-dense"]().transpose(1, 2)
    for name in ("flashmoe-chunk", "flashmoe-chunk-paged64"):
        torch.testing.assert_close(calls[name](), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page", decode_bench.SERVING_DECODE_PAGES)
def test_ragged_paged_cache_holds_each_sequence_in_its_own_pages(page):
    """The ragged decode rows time real attention over scattered pages: decoding through the pool's table equals
    attention over each sequence's keys gathered in order (the reference, on the CPU)."""
    from flashmoe_science import flash_attention_decode

    lengths = [1, page - 1, page, 3 * page + 5]
    k_pool, v_pool, table, seqlens = decode_bench.ragged_paged_cache(lengths, page, "cpu", torch.float32,
                                                                     torch.Generator().manual_seed(0))
    used = sorted(table[row, : -(-n // page)].tolist() for row, n in enumerate(lengths))
    assert sorted(sum(used, [])) == list(range(k_pool.shape[0]))  # every page once
    q = torch.randn(len(lengths), 1, decode_bench.HQ, decode_bench.HEAD_DIM)
    out = flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table)
    for row, n in enumerate(lengths):
        k, v = (pool[table[row]].flatten(0, 1)[:n] for pool in (k_pool, v_pool))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[row].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)


def test_serving_decode_table_ratio():
    rows = [dict(op="decode_ragged", B=256, L_min=128, L=640, layout="paged16", backend=name, tbps=tbps)
            for name, tbps in (("flashmoe", 2.4), ("fa3", 3.0))]
    assert decode_bench.serving_decode_table(rows).splitlines()[-1].split()[-1] == "0.8"
