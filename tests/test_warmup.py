"""flashmoe_science.warmup: the cases a transformers config needs (every layer type and layout), their checks, and
the command line's refusals on a machine without a GPU (tests/integrations/test_warmup_gpu.py compiles them)."""

import pytest
import torch

from flashmoe_science import cli
from flashmoe_science.warmup import WarmupCase, cases_for_config, packed_lengths

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def test_cases_of_a_dense_config():
    config = transformers.LlamaConfig(**COMMON, head_dim=16)
    cases = cases_for_config(config, seq_lens=[128, 256], batch=2, dtype="bf16")
    assert [(case.layout, case.seq_len) for case in cases] == [("dense", 128), ("dense", 256), ("varlen", 128),
                                                               ("varlen", 256)]
    assert {(case.head_dim, case.heads, case.kv_heads, case.batch, case.causal, case.window, case.backward)
            for case in cases} == {(16, 4, 2, 2, True, None, True)}


def test_cases_of_each_layer_type():
    config = transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0)
    cases = cases_for_config(config, seq_lens=[64], layouts=("varlen",), backward=False)
    assert [(case.window, case.softcap) for case in cases] == [(None, 5.0), ((7, 0), 5.0)]  # full, sliding
    assert not any(case.backward for case in cases)


def test_unsupported_config_refused():
    config = transformers.LlamaConfig(**COMMON, head_dim=16, attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention dropout"):
        cases_for_config(config, seq_lens=[64])


def test_packed_lengths_reach_every_power_of_two_interval():
    assert packed_lengths(2048) == [2048, 1024, 512, 256, 128]
    assert packed_lengths(3000, shortest=300) == [3000, 1500, 750, 375]
    assert packed_lengths(100) == [100]
    # every length up to seq_len has a case in its power-of-two interval
    intervals = {length.bit_length() for length in packed_lengths(3000, shortest=1)}
    assert all(length.bit_length() in intervals for length in range(1, 3001))
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        packed_lengths(0)


@pytest.mark.parametrize("fields, message", [
    (dict(seq_len=0), "seq_len must be a positive int"),
    (dict(heads=3), r"heads \(3\) must be a multiple of kv_heads \(2\)"),
    (dict(dtype="fp32"), "dtype must be one of"),
    (dict(layout="paged"), "layout must be one of"),
])
def test_case_checks(fields, message):
    with pytest.raises(ValueError, match=message):
        WarmupCase(**{**dict(head_dim=64, heads=4, kv_heads=2, seq_len=128), **fields})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_command_refuses_without_cuda(capsys):
    assert cli.main(["warmup", "--head-dim", "64", "--heads", "4", "--seq-len", "128"]) == cli.EXIT_ERROR
    assert "no CUDA device" in capsys.readouterr().err


def test_command_help_lists_warmup(capsys):
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--help"])
    assert "--hf-config" in capsys.readouterr().out
