"""FlashAttention's varlen tests through the flash_attn-shaped call on the CPU (the reference backend, float32 against
float64): every variant and padding mode of flash_attn_grid.py once, at short lengths, and its paged varlen test
(keys and values through a block table) for the mask variants (the GPU grids: test_flash_attn_varlen_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from flash_attn_grid import PADDING, VARIANTS, run_paged_varlen_case, run_varlen_grid_case

SEQLENS = [(1, 23), (3, 79), (13, 20), (28, 17), (32, 32), (31, 33), (33, 31), (64, 64)]
HEAD_DIMS = (32, 59, 16, 40)
CASES = [(*SEQLENS[i], HEAD_DIMS[i % len(HEAD_DIMS)], variant, PADDING[i % len(PADDING)])
         for i, variant in enumerate(VARIANTS)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,variant,padding", CASES, ids=str)
def test_flash_attn_varlen_grid_on_cpu(seqlen_q, seqlen_k, d, variant, padding):
    run_varlen_grid_case(seqlen_q, seqlen_k, d, variant, padding, torch.float32, "cpu")


PAGED_CASES = [(1, 23, 32, 16, "causal", "random"), (13, 40, 16, 16, "full", "third"),
               (33, 31, 40, 32, "causal-local-gqa", "zero"), (64, 64, 32, 16, "causal", "full"),
               (13, 600, 16, 512, "causal", "random")]  # flash_attn 2's 512-row pages, read as 256-row ones


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,block_size,variant,padding", PAGED_CASES, ids=str)
def test_flash_attn_paged_varlen_on_cpu(seqlen_q, seqlen_k, d, block_size, variant, padding):
    run_paged_varlen_case(seqlen_q, seqlen_k, d, block_size, variant, padding, torch.float32, "cpu")
