"""`flashmoe-science bench --suite decode` on the CPU, and the decode table's arithmetic (a few seconds)."""

import json


from flashmoe_science import cli
from flashmoe_science.bench import decode as decode_bench


def test_decode_suite_on_cpu_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    assert cli.main(["bench", "--suite", "decode", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out and "ours/best-torch" in out
    (path,) = sorted(tmp_path.glob("*.json"))
    records = json.loads(path.read_text())["records"]
    assert {r["backend"] for r in records} == {"flashmoe", "flashmoe-paged64", "sdpa-math"}
    for record in records:
        assert record["op"] == "decode" and record["B"] == 1 and record["L"] == decode_bench.CPU_CONTEXTS[0]
        assert record["ms"] > 0 and record["tbps"] > 0 and record["of_read"] is None  # no read kernel on the CPU
    assert path.with_suffix(".png").exists()


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
