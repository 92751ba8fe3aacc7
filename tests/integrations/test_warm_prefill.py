"""The engines' warm-up covers the packed forward's builds that their steps meet: a step as large as the engine's
token budget takes the causal work-list order of K/V that outgrows L2 (its own build), so the warm-up holds a batch
that large."""

from __future__ import annotations

import pytest

from flashmoe_science.attention.hopper.tiles import sm90_varlen_band
from flashmoe_science.integrations.engine_attention import STEP_WARM_SEQUENCE, WARM_BATCHES, warm_batches


def _band(lengths, num_kv_heads=8, head_dim=128, group=4):
    tokens = sum(lengths)
    return sm90_varlen_band(tokens * num_kv_heads * head_dim * 2 * 2, tokens, len(lengths), group)


def test_no_step_batch_without_a_budget_or_under_the_fixed_ones():
    assert warm_batches(None) == WARM_BATCHES
    assert warm_batches(max(sum(q) for q, _ in WARM_BATCHES)) == WARM_BATCHES


@pytest.mark.parametrize("group", [1, 4], ids=["MHA", "GQA"])
@pytest.mark.parametrize("step_tokens", [8192, 16384, 16385, 32768])
def test_the_step_batch_takes_the_band_any_step_of_that_budget_takes(step_tokens, group):
    """A layer of 8 KV heads x 128, bf16 (Llama-8B's with 4 query heads per KV head): every band a step of at most
    `step_tokens` tokens can take is taken by some warm batch (vLLM's prefill steps of 256..2048-token prompts met
    the two-tile bands uncompiled)."""
    batches = warm_batches(step_tokens)
    q_lens, k_lens = batches[-1]
    assert q_lens == k_lens and sum(q_lens) == step_tokens
    assert max(q_lens) == STEP_WARM_SEQUENCE
    warmed = {_band(q, group=group) for q, _ in batches}
    for lengths in ([step_tokens], [1024] * (step_tokens // 1024), [256, 2048] * (step_tokens // 2304)):
        assert _band(lengths, group=group) in warmed
