"""The causal window calls as `auto` plans them on a Hopper GPU (one CTA per query tile at L=32k with 16 heads,
persistent rounds at L=128k with 4 heads: tiles.sm90_band_schedule), against float64 on sampled query rows: the
first rows (clipped windows), rows around the window's length and the last rows. Per row the reference reads only
the row's window, so the (L, L) scores are never formed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import OUT_SLACK
from sm90_helpers import hopper_attention_module

WINDOW = 4096
CASES = {"per-tile": (16, 32768), "persistent": (4, 131072)}


def _rows_reference(q, k, v, rows: torch.Tensor, dtype) -> torch.Tensor:
    """Attention of query `rows` over keys [row - WINDOW + 1, row] in `dtype` (float64: the oracle; bf16: what
    PyTorch itself gets), one block of keys covering every sampled row."""
    first, last = max(int(rows.min()) - WINDOW + 1, 0), int(rows.max()) + 1
    keys = torch.arange(first, last, device=q.device)
    seen = (keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - WINDOW)
    return F.scaled_dot_product_attention(q[:, :, rows].to(dtype), k[:, :, first:last].to(dtype),
                                          v[:, :, first:last].to(dtype), attn_mask=seen)


@pytest.mark.parametrize("name", list(CASES))
def test_band_plans_match_float64_on_sampled_rows(name):
    hopper_attention_module("fwd_sm90")
    from flashmoe_science import flash_attention_science
    from flashmoe_science.attention.api import describe_dispatch

    heads, length = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    reason = describe_dispatch(q, k, v, causal=True, window=(WINDOW - 1, 0)).reason
    assert ("one CTA per query tile" in reason) == (name == "per-tile"), reason
    out = flash_attention_science(q, k, v, causal=True, window=(WINDOW - 1, 0))
    for block in (torch.arange(0, 200), torch.arange(WINDOW - 100, WINDOW + 150), torch.arange(length - 130, length)):
        rows = block.cuda()
        oracle = _rows_reference(q, k, v, rows, torch.float64)
        torch_err = (_rows_reference(q, k, v, rows, torch.bfloat16).double() - oracle).abs().max().item()
        ours_err = (out[:, :, rows].double() - oracle).abs().max().item()
        assert ours_err <= 2 * torch_err + OUT_SLACK[torch.bfloat16], (name, int(rows[0]), ours_err, torch_err)
