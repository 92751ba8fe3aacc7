"""FlashAttention's varlen test grid (its tests/test_flash_attn.py, test_flash_attn_varlen_output: the
(seqlen_q, seqlen_k) pairs, head dims 32..256 with the odd 59 and 111, causal, local windows, softcap, ALiBi,
GQA/MQA, deterministic backward, padding masks) through the flash_attn-shaped call, forward and backward, bf16 and
fp16, against the float64 oracle within 2 x PyTorch's same-dtype error + slack (flash_attn_grid.py).

Every case compiles its own kernels (head dim, dtype, features), so the parameters are paired rather than crossed:
24 cases in which every seqlen pair appears twice, every head dim at least twice, every variant three times and
every padding mode six times. Run on a GPU:
`PYTHONPATH=src python -m pytest -m gpu -q -n 3 -p no:cacheprovider tests/attention/test_flash_attn_varlen_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn_grid import PADDING, VARIANTS, run_paged_varlen_case, run_varlen_grid_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQLENS = [(1, 239), (3, 799), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
           (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
HEAD_DIMS = (32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
CASES = [(*SEQLENS[i % len(SEQLENS)], HEAD_DIMS[i % len(HEAD_DIMS)], list(VARIANTS)[i % len(VARIANTS)],
          PADDING[i % len(PADDING)], (torch.bfloat16, torch.float16)[i // len(SEQLENS)]) for i in range(24)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,variant,padding,dtype", CASES, ids=str)
def test_flash_attn_varlen_grid(seqlen_q, seqlen_k, d, variant, padding, dtype):
    run_varlen_grid_case(seqlen_q, seqlen_k, d, variant, padding, dtype, "cuda")
    torch.cuda.synchronize()


# its paged varlen test at FlashAttention 2's block sizes, 256 and 512 (read as two 256-row pages: decode.pages),
# and smaller pages; causal and local masks, GQA
PAGED_CASES = [(113, 203, 64, 256, "causal", "random"), (1024, 1023, 128, 512, "causal-local-gqa", "third"),
               (256, 512, 128, 64, "full", "zero"), (2048, 2048, 64, 512, "causal", "full")]


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,block_size,variant,padding", PAGED_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_paged_varlen_grid(seqlen_q, seqlen_k, d, block_size, variant, padding, dtype):
    run_paged_varlen_case(seqlen_q, seqlen_k, d, block_size, variant, padding, dtype, "cuda")
    torch.cuda.synchronize()
